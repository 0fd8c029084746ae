#!/bin/bash
# The exported policy against the defaults through Ray Serve: two apps (defaults at /, the policy at /tuned), one
# 1-CPU replica each, `flexdraft loadtest --baseline` in alternating rounds at concurrency 1, 4 and 16.
set -u
cd "$(dirname "$0")/../../.."  # the repository root
export FLEXDRAFT_HOME=${FLEXDRAFT_HOME:-$HOME/.flexdraft} RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
export PATH=$PWD/.venv/bin:$PATH
OUT=${OUT:-/tmp/flexdraft-sweep-serve}; mkdir -p $OUT
POLICY=${POLICY:-$PWD/docs/results/2026-12-03-sweep/policy.yaml}
python docs/results/2026-12-03-sweep/serve_ab.py $PWD $FLEXDRAFT_HOME $POLICY > $OUT/serve.yaml
ray stop --force >/dev/null 2>&1
ray start --head --num-cpus=2 --disable-usage-stats > $OUT/ray_start.log 2>&1
serve deploy $OUT/serve.yaml > $OUT/deploy.log 2>&1
until curl -sf 127.0.0.1:8000/health >/dev/null && curl -sf 127.0.0.1:8000/tuned/health >/dev/null; do sleep 2; done
flexdraft loadtest --url http://127.0.0.1:8000/tuned --baseline http://127.0.0.1:8000 --dataset gsm8k \
  --concurrency 1 4 --requests 16 --max-tokens 64 --stream --output $OUT/loadtest.json 2>&1 | grep -v "^\[loadtest\] results"
flexdraft loadtest --url http://127.0.0.1:8000/tuned --baseline http://127.0.0.1:8000 --dataset gsm8k \
  --concurrency 16 --requests 64 --max-tokens 64 --stream --output $OUT/loadtest16.json 2>&1 | grep -v "^\[loadtest\] results"
serve shutdown -y > /dev/null 2>&1; ray stop --force > /dev/null 2>&1
