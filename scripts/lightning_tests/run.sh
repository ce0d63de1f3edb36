#!/usr/bin/env bash
# Lightning's own tests under RoundPipeStrategy on 2 CPU virtual devices (see README.md).
# usage: scripts/lightning_tests/run.sh TESTS_DIR [IDS_FILE] [pytest args...]
#   TESTS_DIR: the folder holding `tests_pytorch` (Lightning's tests at the installed version's tag)
#   IDS_FILE:  test ids, one a line (default: selected_ids.txt next to this script)
# env: PYTHON (default: python), REPO (default: the checkout holding this script), LOG (default: ./lightning_tests.log), ROUNDPIPE_LT_LAYERS=1|3,
#      ROUNDPIPE_LT_OFF=1 (the default strategy: the oracle), WORKERS (default 2), TIMEOUT_S (default 3600),
#      ORACLE=0 (do not re-run the failures under the default strategy)
set -u
here="$(cd "$(dirname "$0")" && pwd)"
repo="${REPO:-$(cd "$here/../.." && pwd)}"  # the lightning_roundpipe checkout
tests="$(cd "$1" && pwd)"; shift
ids="${1:-$here/selected_ids.txt}"; [ $# -gt 0 ] && shift
log="${LOG:-$PWD/lightning_tests.log}"
export ROUNDPIPE_LT_REASONS="$log.reasons"; : >"$ROUNDPIPE_LT_REASONS"  # the plugin's one-line reasons, as they happen
python="${PYTHON:-python}"
workers="${WORKERS:-2}"
xdist=(); [ "$workers" != 0 ] && xdist=(-n "$workers")
mapfile -t idlist < <(grep -v -e '^#' -e '^$' "$ids")  # one id a line; ids may hold spaces
cd "$tests"
# -rfE: the failures' one-line reasons at the end; -v: one line per finished test (counted even if the run is cut)
PYTHONPATH="$repo:$here:$tests${PYTHONPATH:+:$PYTHONPATH}" timeout "${TIMEOUT_S:-3600}" \
  "$python" -m pytest -p roundpipe_plugin -p no:cacheprovider -v -rfE --tb=line "${xdist[@]}" "$@" \
  "${idlist[@]}" >"$log" 2>&1
rc=$?
"$python" "$here/summarize.py" "$log" --failed-out "$log.failed" >/dev/null
if [ "${ORACLE:-1}" = 1 ] && [ -s "$log.failed" ] && [ "${ROUNDPIPE_LT_OFF:-0}" != 1 ]; then
  # the oracle: the failed ids again under the default strategy (a test failing there too is not RoundPipe's)
  mapfile -t failed < "$log.failed"
  PYTHONPATH="$repo:$here:$tests${PYTHONPATH:+:$PYTHONPATH}" ROUNDPIPE_LT_OFF=1 ROUNDPIPE_LT_REASONS="$log.oracle.reasons" timeout "${TIMEOUT_S:-3600}" \
    "$python" -m pytest -p roundpipe_plugin -p no:cacheprovider -v -rfE --tb=line "${xdist[@]}" "$@" \
    "${failed[@]}" >"$log.oracle" 2>&1
  "$python" "$here/summarize.py" "$log" --oracle "$log.oracle"
else
  "$python" "$here/summarize.py" "$log"
fi
echo "pytest exit status: $rc (124: cut by TIMEOUT_S); log: $log"
