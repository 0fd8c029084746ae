#!/bin/bash
# start `mlflow server` (SQLite) with/without MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: seconds to /health, processes, RSS
BIN=${BIN:-.venv/bin}  # run from the repository root
for mode in default false; do
  d=$(mktemp -d); port=5077
  t0=$(date +%s.%N)
  if [ $mode = false ]; then export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false; else unset MLFLOW_SERVER_ENABLE_JOB_EXECUTION; fi
  setsid $BIN/mlflow server --host 127.0.0.1 --port $port --workers 1 --backend-store-uri sqlite:///$d/m.db --artifacts-destination $d/a > $d/log 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:$port/health >/dev/null; do sleep 0.2; done
  t1=$(date +%s.%N)
  sleep 20
  pgid=$(ps -o pgid= $pid | tr -d ' ')
  n=$(ps -eo pgid= | tr -d ' ' | grep -cx "$pgid")
  rss=$(ps -eo pgid=,rss= | awk -v g=$pgid '$1==g {s+=$2} END {print int(s/1024)}')
  cpu=$(ps -eo pgid=,pcpu= | awk -v g=$pgid '$1==g {s+=$2} END {print s}')
  echo "job execution $mode: /health after $(echo "$t1 - $t0" | bc) s; after 20 s: $n processes, ${rss} MB RSS, ${cpu}% CPU summed"
  kill -- -$pgid; sleep 2
done
