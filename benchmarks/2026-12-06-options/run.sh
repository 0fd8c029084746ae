#!/usr/bin/env bash
# The three runs of the request options' speed, one after another (about 10 minutes on 2 cores), with the drafter
# `make demo` registers (DRAFTER= another):   benchmarks/2026-12-06-options/run.sh   (from the repository root)
set -euo pipefail
here=$(dirname "$0")
for name in plain penalties json; do
  .venv/bin/flexdraft bench --config "$here/$name.yaml" --drafter "${DRAFTER:-models:/flexdraft-drafter-smollm2/1}" \
    --output-dir "${OUT:-$here/out}/$name"
done
