#!/usr/bin/env bash
# CI under load (issue 31): run `.ci/run` (or another command) N times in a row while busy-loop processes
# hold every core, and print each run's exit code and wall time.
#
#   bash scripts/ci_under_load.sh [N] [COMMAND...]     # N default 5; COMMAND default: bash .ci/run
#   CI_LOAD_BUSY=2 bash scripts/ci_under_load.sh 1 python -m pytest -q -n 2   # the README's test command
#
# Settings (environment): CI_LOAD_BUSY  busy-loop processes (default: the number of cores, `nproc`);
#                         CI_LOAD_LOG   folder for each run's output (default: ci_under_load_logs/)
# The busy loops are plain shell `while :; do :; done` processes, each started here and killed on exit
# (normal end, error, Ctrl-C or SIGTERM) by their process ids. Exit code: 0 when every run passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
RUNS=${1:-5}
shift $(($# > 0 ? 1 : 0))
if (($# == 0)); then set -- bash .ci/run; fi
BUSY=${CI_LOAD_BUSY:-$(nproc)}
LOG=${CI_LOAD_LOG:-ci_under_load_logs}
mkdir -p "$LOG"

BUSY_PIDS=()
RUN_PID=
stop_busy() {
  local pid
  for pid in "${BUSY_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${BUSY_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
  BUSY_PIDS=()
}
stop_all() {  # on INT/TERM: the run in flight (its process group: pytest and its workers) and the loops
  if [ -n "$RUN_PID" ]; then kill -TERM -- "-$RUN_PID" 2>/dev/null || kill -TERM "$RUN_PID" 2>/dev/null; fi
  stop_busy
}
trap stop_busy EXIT
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
set -m  # each run in its own process group (killed as one on INT/TERM); waited for with `wait`, so traps run at once

for ((i = 0; i < BUSY; i++)); do
  bash -c 'while :; do :; done' &
  BUSY_PIDS+=($!)
done
echo "ci_under_load: $BUSY busy loops (pids ${BUSY_PIDS[*]}) on $(nproc) cores; $RUNS runs of: $*"

FAILED=0
RESULTS=()
for ((run = 1; run <= RUNS; run++)); do
  start=$SECONDS
  "$@" > "$LOG/run$run.log" 2>&1 < /dev/null &
  RUN_PID=$!
  wait "$RUN_PID"
  rc=$?
  RUN_PID=
  seconds=$((SECONDS - start))
  summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed).* in " "$LOG/run$run.log" | tail -2 | tr '\n' ' ')
  line="run $run: exit code $rc after ${seconds} s ($((seconds / 60)) min) | $summary| $LOG/run$run.log"
  echo "$line"
  RESULTS+=("$line")
  ((rc != 0)) && FAILED=1
done
stop_busy
echo "ci_under_load: summary"
printf '  %s\n' "${RESULTS[@]}"
exit $FAILED
