#!/usr/bin/env bash
# The GPU check (DESIGN.md section 10): one run on a bare CUDA machine with this repository and a
# package index, under 9 minutes on one large GPU (one H200: about 6 minutes), never stopping at a
# failing step.
#
#   GPU_CHECK_OUT=/some/folder bash scripts/gpu_check.sh      # default folder: gpu_check_out/
#
# Steps (each under `timeout`, each one's exit code printed; a global deadline trims the timeouts):
#   preflight   torch importable and torch.cuda.is_available(), else one line and exit 3 at once,
#               before anything is installed (the python on PATH, or $PYTHON)
#   install     pip install -e ".[test]" with torch pinned to the installed CUDA build (never
#               installs torch; falls back to --no-deps plus every other requirement)
#   pytest_logical  the `gpu`-marked tests on 4 logical workers of cuda:0 (round-robin on one GPU,
#               cross-stream waits between workers)
#   pytest_all  the same tests on every GPU
#   parity      bf16-mixed RoundPipe vs plain single-GPU Lightning, random-weight Qwen3-1.7B shape,
#               seq 2048: losses and the parameter update within stated tolerances
#   throughput  tokens/s of both, MFU, measured vs predicted step, peak memory per device, the
#               fraction of weight-upload time hidden under compute (benchmarks/gpu_check.py)
#   sanitizer   a tiny model, 2 steps on 2 logical workers of cuda:0 under TORCH_CUDA_SANITIZER=1
# Writes $GPU_CHECK_OUT/log.txt (everything printed), summary.json (each step's exit code, seconds
# and timeout, the Python steps' results) and the steps' own files; exits 0 when every step passed,
# 1 when one failed, 3 when CUDA is missing.
#
# Settings (environment): GPU_CHECK_OUT (output folder), GPU_CHECK_BUDGET_S (total seconds, default
# 530), GPU_CHECK_SKIP_INSTALL=1 (a rerun), GPU_CHECK_STEPS (comma list of the steps after install,
# default all), GPU_CHECK_ACCELERATOR=cpu (the Python steps on 2 CPU virtual devices with a tiny
# model, no CUDA needed: what tests/test_gpu_check_script.py runs), GPU_CHECK_ARGS (more arguments
# for the benchmarks/gpu_check.py steps, e.g. "--batch-size 2"), PYTHON (the interpreter).
set -u
cd "$(dirname "$0")/.." || { echo "gpu_check: FAILED: cannot cd to the repository root"; exit 2; }

OUT="${GPU_CHECK_OUT:-gpu_check_out}"
ACCELERATOR="${GPU_CHECK_ACCELERATOR:-cuda}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-530}"
STEPS="${GPU_CHECK_STEPS:-pytest_logical,pytest_all,parity,throughput,sanitizer}"
PY="${PYTHON:-$(command -v python || command -v python3 || true)}"
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
START=$(date +%s)

# ---------------------------------------------------------------- preflight: before anything else
if [ -z "$PY" ]; then
  echo "gpu_check: FAILED: no python on PATH (set PYTHON=/path/to/python)"
  exit 3
fi
if ! command -v timeout >/dev/null 2>&1; then
  echo "gpu_check: FAILED: the \`timeout\` command (coreutils) is missing"
  exit 3
fi
PREFLIGHT_ERR=$(mktemp)
PREFLIGHT=$(ACCELERATOR="$ACCELERATOR" timeout -k 5 90 "$PY" - 2>"$PREFLIGHT_ERR" <<'PY'
import os, sys
try:
    import torch
except BaseException as e:  # noqa: BLE001
    print(f"torch is not importable by {sys.executable} ({type(e).__name__}: {e})".replace("\n", " "))
    sys.exit(1)
if os.environ["ACCELERATOR"] == "cpu":
    print(f"torch {torch.__version__} on {sys.executable}; CPU virtual devices (GPU_CHECK_ACCELERATOR=cpu)")
    sys.exit(0)
if not torch.cuda.is_available():
    print(f"torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA {torch.version.cuda},"
          f" CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, {sys.executable})")
    sys.exit(1)
names = ", ".join(f"{i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count()))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) [{names}]; {sys.executable}")
PY
)
PREFLIGHT_RC=$?
if [ "$PREFLIGHT_RC" -ne 0 ]; then
  REASON=$(printf '%s\n' "$PREFLIGHT" | tail -n 1)
  [ -n "$REASON" ] || REASON="$PY exited with code $PREFLIGHT_RC: $(tail -n 1 "$PREFLIGHT_ERR")"
  rm -f "$PREFLIGHT_ERR"
  echo "gpu_check: FAILED before installing anything: $REASON"
  exit 3
fi
rm -f "$PREFLIGHT_ERR"

mkdir -p "$OUT" || { echo "gpu_check: FAILED: cannot create the output folder $OUT"; exit 2; }
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/log.txt"

NAMES=(); RCS=(); SECS=(); TIMEOUTS=()

# run_step NAME TIMEOUT_S RESERVE_S CMD...: CMD under `timeout` (at most TIMEOUT_S, and never past the
# deadline minus RESERVE_S kept for the later steps); its exit code is recorded, never fatal.
run_step() {
  local name=$1 limit=$2 reserve=$3
  shift 3
  local now left rc t0 t1
  now=$(date +%s)
  left=$((START + BUDGET_S - now - reserve))
  [ "$left" -lt "$limit" ] && limit=$left
  echo
  echo "==== step $name (timeout ${limit} s): $*"
  if [ "$limit" -lt 5 ]; then
    echo "==== step $name: SKIPPED, no time left in the ${BUDGET_S} s budget"
    NAMES+=("$name"); RCS+=(124); SECS+=(0); TIMEOUTS+=("$limit")
    return
  fi
  t0=$(date +%s.%N)
  timeout -k 15 "$limit" "$@"
  rc=$?
  t1=$(date +%s.%N)
  local secs
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "==== step $name: TIMED OUT after ${limit} s"
  echo "==== step $name: exit code $rc (${secs} s)"
  NAMES+=("$name"); RCS+=("$rc"); SECS+=("$secs"); TIMEOUTS+=("$limit")
}

want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# a function: run as `bash -c install_deps` under `timeout` (which runs programs, not functions)
install_deps() {
  local torch_version
  torch_version=$("$PY" -c 'import torch; print(torch.__version__)') || return 1
  echo "torch==$torch_version" > "$OUT/constraints.txt"
  echo "keeping the installed torch==$torch_version (pip constraint)"
  "$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip --upgrade || return 1
  # a lent machine's system python may be marked externally managed (PEP 668); older pips ignore this
  export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
  if "$PY" -m pip install --disable-pip-version-check --progress-bar off -q -c "$OUT/constraints.txt" -e ".[test]"; then
    return 0
  fi
  echo "pip install -e \".[test]\" failed with torch pinned; installing the package without dependencies and every requirement but torch"
  "$PY" - > "$OUT/requirements-without-torch.txt" <<'PY' || return 1
import re
text = open("pyproject.toml").read()
try:
    import tomllib
    project = tomllib.loads(text)["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
except ImportError:  # Python 3.10: the two arrays by pattern
    reqs = []
    for key in ("dependencies", "test"):
        block = re.search(rf"^{key}\s*=\s*\[(.*?)\]\s*$", text, re.M | re.S)
        reqs += re.findall(r'"([^"]+)"', block.group(1)) if block else []
for req in reqs:
    if not re.match(r"torch(?![A-Za-z0-9_.-])", req):
        print(req)
PY
  "$PY" -m pip install --disable-pip-version-check --progress-bar off -q --no-deps -e . || return 1
  "$PY" -m pip install --disable-pip-version-check --progress-bar off -q -c "$OUT/constraints.txt" \
    -r "$OUT/requirements-without-torch.txt"
}

main() {
  echo "gpu_check: $PREFLIGHT"
  echo "gpu_check: output folder $OUT, budget ${BUDGET_S} s, steps: $STEPS"
  command -v git >/dev/null 2>&1 && git log -1 --oneline 2>/dev/null | sed 's/^/gpu_check: commit /'
  [ "$ACCELERATOR" = cuda ] && command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi
  local bench=(benchmarks/gpu_check.py) bench_args=()
  if [ "$ACCELERATOR" = cpu ]; then
    bench_args=(--accelerator cpu --tiny --devices 2 --device-memory-bytes 1000000000)
  fi
  local extra=()
  read -r -a extra <<< "${GPU_CHECK_ARGS:-}"
  bench_args+=("${extra[@]}")
  if [ "${GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
    echo "gpu_check: GPU_CHECK_SKIP_INSTALL=1: not installing"
  else
    export -f install_deps
    export PY OUT
    run_step install 150 300 bash -c install_deps
  fi
  # the tests read ROUNDPIPE_GPU_TEST_DEVICES (tests/test_gpu.py)
  want pytest_logical && run_step pytest_logical 100 220 env ROUNDPIPE_GPU_TEST_DEVICES=cuda:0,cuda:0,cuda:0,cuda:0 \
    "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -rfEs --junitxml "$OUT/pytest_logical.xml"
  want pytest_all && run_step pytest_all 80 180 env ROUNDPIPE_GPU_TEST_DEVICES=all \
    "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -rfEs --junitxml "$OUT/pytest_all.xml"
  want parity && run_step parity 120 110 "$PY" "${bench[@]}" parity "${bench_args[@]}" --json "$OUT/parity.json"
  want throughput && run_step throughput 180 45 "$PY" "${bench[@]}" throughput "${bench_args[@]}" --json "$OUT/throughput.json"
  # on CPU virtual devices the same run without the sanitizer (it checks CUDA streams only)
  local sanitize=(env TORCH_CUDA_SANITIZER=1) sanitize_args=(--tiny --devices cuda:0,cuda:0)
  [ "$ACCELERATOR" = cpu ] && sanitize=() && sanitize_args=()
  want sanitizer && run_step sanitizer 60 0 "${sanitize[@]}" "$PY" "${bench[@]}" sanitizer "${sanitize_args[@]}" \
    "${bench_args[@]}" --json "$OUT/sanitizer.json"

  local failed=0 i
  echo
  echo "==== summary (${BUDGET_S} s budget, $(( $(date +%s) - START )) s used)"
  for i in "${!NAMES[@]}"; do
    printf '  %-16s exit %-4s %7s s  %s\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}" \
      "$([ "${RCS[$i]}" -eq 0 ] && echo ok || echo FAILED)"
    [ "${RCS[$i]}" -eq 0 ] || failed=1
  done
  local steps_json="" sep=""
  for i in "${!NAMES[@]}"; do
    steps_json+="$sep{\"name\": \"${NAMES[$i]}\", \"rc\": ${RCS[$i]}, \"seconds\": ${SECS[$i]}, \"timeout_s\": ${TIMEOUTS[$i]}}"
    sep=", "
  done
  STEPS_JSON="[$steps_json]" OUT="$OUT" START="$START" PREFLIGHT="$PREFLIGHT" ACCELERATOR="$ACCELERATOR" \
    BUDGET_S="$BUDGET_S" "$PY" - <<'PY' || { echo "gpu_check: could not write summary.json"; failed=1; }
import json, os, time
out = os.environ["OUT"]
steps = json.loads(os.environ["STEPS_JSON"])
results = {}
for name in ("parity", "throughput", "sanitizer"):
    path = os.path.join(out, f"{name}.json")
    if os.path.exists(path):
        try:
            results[name] = json.load(open(path))
        except ValueError as e:
            results[name] = {"error": f"unreadable {path}: {e}"}
summary = {"ok": all(s["rc"] == 0 for s in steps), "accelerator": os.environ["ACCELERATOR"],
           "environment": os.environ["PREFLIGHT"], "budget_s": int(os.environ["BUDGET_S"]),
           "total_s": round(time.time() - int(os.environ["START"]), 1), "steps": steps, "results": results}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
PY
  echo "gpu_check: wrote $OUT/summary.json and $OUT/log.txt"
  if [ "$failed" -ne 0 ]; then
    echo "gpu_check: FAILED (a step above has a non-zero exit code)"
    return 1
  fi
  echo "gpu_check: all steps passed"
  return 0
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
