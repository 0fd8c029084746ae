#!/bin/bash
# The chaos run of issue 38 against SmolLM2 served from this checkout: `flexdraft serve` (adaptive, an
# untrained drafter so every step kind runs, 2 CPUs, an API key), then `flexdraft loadtest --chaos`.
# Run from the repository root with the venv made by `make install`; ~5 min on a 2-core machine.
set -uo pipefail
export FLEXDRAFT_API_KEY=${FLEXDRAFT_API_KEY:-chaos-key} RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
OUT=${OUT:-docs/results/2026-12-03-hardening}
setsid .venv/bin/flexdraft serve --drafter init > /tmp/flexdraft-chaos-serve.log 2>&1 &
SERVE=$!
trap 'kill -INT -- -$SERVE 2>/dev/null; sleep 10; kill -KILL -- -$SERVE 2>/dev/null; .venv/bin/ray stop --force >/dev/null 2>&1' EXIT
t0=$(date +%s)
until curl -sf -H "Authorization: Bearer $FLEXDRAFT_API_KEY" http://127.0.0.1:8000/health >/dev/null; do
  sleep 2; [ $(( $(date +%s) - t0 )) -gt 600 ] && { echo "the app did not come up"; exit 1; }
done
echo "app up in $(( $(date +%s) - t0 )) s"
for round in 1 2 3 4 5 6; do  # six rounds against the same replica: does its RSS keep growing?
  .venv/bin/flexdraft loadtest --chaos --url http://127.0.0.1:8000 --requests 400 --concurrency 8 --seed $round \
    --max-seconds 600 --output "$OUT/chaos_smollm2_round$round.json" 2>&1 | tee -a "$OUT/chaos_smollm2.txt"
done
