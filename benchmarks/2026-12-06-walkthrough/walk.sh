#!/bin/bash
# The README's "Scaling out" walkthrough, command by command as written, with a fresh FLEXDRAFT_HOME.
cd "$(git rev-parse --show-toplevel)"
source .venv/bin/activate
export FLEXDRAFT_HOME=${1:?usage: walk.sh EMPTY_FLEXDRAFT_HOME}
step() { echo; echo "\$ $*"; local t0=$(date +%s); "$@"; local rc=$?; echo "[rc=$rc, $(( $(date +%s) - t0 )) s]"; }
step flexdraft cluster up
echo '$ eval "$(flexdraft cluster env)"'; eval "$(flexdraft cluster env)"; env | grep -E "^(RAY_ADDRESS|RAY_DASHBOARD_ADDRESS|MLFLOW_TRACKING_URI|RAY_AUTH_MODE)="
step ray job submit --working-dir . -- flexdraft pipeline --config configs/demo.yaml
step ray job submit --working-dir . -- python tuning/sweep.py --config tuning/configs/decode.yaml \
    --drafter models:/flexdraft-drafter-smollm2@champion
step flexdraft serve --num-cpus 1 --deploy --drafter models:/flexdraft-drafter-smollm2@champion
step flexdraft cluster status
echo '$ curl a chat completion'; sleep 5
curl -s -m 120 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "Name three primary colors."}], "max_tokens": 24, "temperature": 0}'; echo
step flexdraft cluster down
