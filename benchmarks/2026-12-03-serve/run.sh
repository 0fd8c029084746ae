#!/bin/bash
# The side-by-side Serve measurement of docs/results/2026-12-03-serve: adaptive vs mode ar through HTTP (flexdraft
# loadtest --baseline), the offline engine vs HTTP at concurrency 1, and flexdraft bench on the same prompts.
set -u
cd "$(dirname "$0")/../../.."  # the repository root
export FLEXDRAFT_HOME=${FLEXDRAFT_HOME:-$HOME/.flexdraft} RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
export PATH=$PWD/.venv/bin:$PATH
OUT=${OUT:-/tmp/flexdraft-serve-measure}; mkdir -p $OUT
THREADS=${THREADS:-0}
python benchmarks/2026-12-03-serve/two_apps.py $PWD $FLEXDRAFT_HOME $THREADS > $OUT/serve.yaml
ray stop --force >/dev/null 2>&1
ray start --head --num-cpus=2 --disable-usage-stats --metrics-export-port=8089 > $OUT/ray_start.log 2>&1
t0=$(date +%s)
# the adaptive app first, alone: its replica measures the policy's cost profile on a quiet machine
python -c "
import yaml; c = yaml.safe_load(open('$OUT/serve.yaml')); c['applications'] = c['applications'][:1]
yaml.safe_dump(c, open('$OUT/serve-adaptive.yaml', 'w'), sort_keys=False)"
serve deploy $OUT/serve-adaptive.yaml > $OUT/deploy.log 2>&1
until curl -sf 127.0.0.1:8000/health >/dev/null; do sleep 2; done
serve deploy $OUT/serve.yaml >> $OUT/deploy.log 2>&1
until curl -sf 127.0.0.1:8000/health >/dev/null && curl -sf 127.0.0.1:8000/ar/health >/dev/null; do sleep 2; done
echo "apps up after $(( $(date +%s) - t0 )) s"
vmstat 10 > $OUT/vmstat.txt &
VM=$!
flexdraft loadtest --url http://127.0.0.1:8000 --baseline http://127.0.0.1:8000/ar --dataset gsm8k \
  --concurrency 1 4 --requests 16 --max-tokens 64 --stream --output $OUT/loadtest.json 2>&1 | grep -v "^\[loadtest\] results"
flexdraft loadtest --url http://127.0.0.1:8000 --baseline http://127.0.0.1:8000/ar --dataset gsm8k \
  --concurrency 16 --requests 64 --max-tokens 64 --stream --output $OUT/loadtest16.json 2>&1 | grep -v "^\[loadtest\] results"
for t in 1 2; do python benchmarks/2026-12-04-serve/offline_vs_http.py --requests 16 --max-tokens 64 --threads $t 2>&1 | grep -v WARN; done
curl -s 127.0.0.1:8089/metrics | grep "^ray_flexdraft" | grep -v _bucket > $OUT/scrape.txt
serve shutdown -y > /dev/null 2>&1; ray stop --force > /dev/null 2>&1
flexdraft bench --config docs/results/2026-12-03-serve/bench.yaml --output-dir $OUT/bench > $OUT/bench.log 2>&1
kill $VM
grep -A4 "| method | batch 1" $OUT/bench/results.md; grep "| gsm8k" $OUT/bench/results.md
awk 'NR>2 {st+=$17; us+=$13; n++} END {printf "mean CPU user %.0f%%, steal %.0f%% over %d samples\n", us/n, st/n, n}' $OUT/vmstat.txt
