#!/bin/bash
# The Serve measurements of issue 41 (docs/results/2026-12-04-serve/README.md): deploy to first answer with and
# without a cached cost profile; learned vs static planner vs AR (and AR again: the noise floor) through
# `flexdraft loadtest` on GSM8K and ShareGPT's long documents at concurrency 1-16; the same with a CPU hog on one
# core in the middle phase; offline engine vs HTTP at concurrency 1.
#   FLEXDRAFT_HOME=<a home with a trained drafter> run.sh DRAFTER STORE      (about 45 minutes)
set -u
cd "$(dirname "$0")/../../.."  # the repository root
DRAFTER=$1 STORE=$2
HERE=benchmarks/2026-12-04-serve
export FLEXDRAFT_HOME=${FLEXDRAFT_HOME:-$HOME/.flexdraft} RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
export PATH=$PWD/.venv/bin:$PATH
OUT=${OUT:-/tmp/flexdraft-serve-41}; mkdir -p $OUT
URL=http://127.0.0.1:8000
python $HERE/apps.py $PWD $FLEXDRAFT_HOME $DRAFTER $STORE > $OUT/serve.yaml
python $HERE/apps.py $PWD $FLEXDRAFT_HOME $DRAFTER $STORE learned > $OUT/serve-learned.yaml

first_answer() {  # seconds from $1 (epoch) until the app at $2 answers a chat completion
  until curl -sf -o /dev/null -X POST $2/v1/chat/completions -H 'content-type: application/json' \
      -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}'; do sleep 0.5; done
  python -c "import time; print(f'{time.time() - $1:.1f}')"
}
loadtest() {  # NAME DATASET REQUESTS CONCURRENCY...
  local name=$1 dataset=$2 n=$3; shift 3
  flexdraft loadtest --url $URL --baseline $URL/ar --compare static=$URL/static ar2=$URL/ar2 --dataset $dataset \
    --concurrency "$@" --requests $n --max-tokens 64 --stream --output $OUT/$name.json 2>&1 \
    | grep -v "^\[loadtest\] results" | tee $OUT/$name.md
}

ray stop --force >/dev/null 2>&1
ray start --head --num-cpus=4 --disable-usage-stats --metrics-export-port=8089 > $OUT/ray_start.log 2>&1
echo "## deploy to first answer (the learned app alone, Serve not running before)" | tee $OUT/startup.md
for cache in none cached; do
  [ $cache = none ] && rm -rf $FLEXDRAFT_HOME/profiles
  t0=$(date +%s.%N); serve deploy $OUT/serve-learned.yaml >> $OUT/deploy.log 2>&1
  echo "profile $cache: $(first_answer $t0 $URL) s" | tee -a $OUT/startup.md
  serve shutdown -y >> $OUT/deploy.log 2>&1
done
serve deploy $OUT/serve.yaml >> $OUT/deploy.log 2>&1
for route in "" /static /ar /ar2; do first_answer $(date +%s) $URL$route > /dev/null; done
echo "four apps up"
vmstat 10 > $OUT/vmstat.txt &
VM=$!
loadtest gsm8k gsm8k 16 1 2 4 8 16
loadtest long sharegpt-long 8 1 2 4 8
loadtest hog-before gsm8k 8 1 4
taskset -c 1 python -c "while True: pass" &
HOG=$!
loadtest hog-during gsm8k 8 1 4
kill $HOG
loadtest hog-after gsm8k 8 1 4
for mode in ar adaptive; do
  route=$([ $mode = ar ] && echo /ar || echo "")
  python $HERE/offline_vs_http.py --url $URL$route --mode $mode --drafter $DRAFTER --store $STORE --threads 1 \
    --requests 16 2>&1 | grep "reaches the client" | tee -a $OUT/offline_vs_http.md
done
curl -s 127.0.0.1:8089/metrics | grep "^ray_flexdraft" | grep -v _bucket > $OUT/scrape.txt
kill $VM
serve shutdown -y > /dev/null 2>&1; ray stop --force > /dev/null 2>&1
awk 'NR>2 {st+=$17; us+=$13; n++} END {printf "mean CPU user %.0f%%, steal %.0f%% over %d samples\n", us/n, st/n, n}' $OUT/vmstat.txt
