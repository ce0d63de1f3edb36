#!/usr/bin/env bash
# The GPU check (DESIGN.md section 10; docs/usage.md, "The GPU check"): one run on a bare CUDA machine
# that has this repository, a CUDA build of torch and a package index; under 9 minutes on one large
# GPU, never stopping at a failing step.
#
#   GPU_CHECK_OUT=/some/folder bash scripts/gpu_check.sh      # default folder: gpu_check_out/
#
# Steps, in this order (each under `timeout`; its time limit, in seconds of the default 530 s budget,
# in LIMITS below: they add up to the budget, and a step never runs into the time of the steps after
# it; the measuring steps run first, so a slow install or a hanging test cannot starve them):
#   preflight       torch importable and torch.cuda.is_available(), else ONE line and exit 3 at once,
#                   before anything is installed or written (the python on PATH, or $PYTHON)
#   install         pip install -e ".[test]" with torch pinned to the installed build (never replaces
#                   torch; falls back to --no-deps plus every other requirement)
#   throughput      tokens/s of RoundPipe on every GPU and of plain single-GPU Lightning (synchronized),
#                   MFU, measured vs predicted step, peak memory per GPU, the fraction of weight-upload
#                   time hidden under compute (CUDA events); random-weight Qwen3-1.7B shape, 4 x 2048
#                   tokens: the plain baseline (no checkpointing, ~70-75 GiB) halves its batch on OOM
#                   and says so (`plain.fallback` in the summary)
#   parity          bf16-mixed RoundPipe vs plain single-GPU Lightning, the same shape: per-step losses
#                   and the whole parameter update within tolerances (the same OOM fallback, both runs)
#   throughput_logical  throughput on 2 logical devices of cuda:0 (8 layers of the shape)
#   dropout_accum   LoRA dropout 0.1, accumulate_grad_batches=2 (overlapped batches) vs the same run
#                   without overlap (4 layers of the shape, seq 1024)
#   async_steady    optimizer="async" in its steady state vs "sync" (4 layers, seq 1024)
#   fp8_lora        LoRA on frozen_weights="fp8" vs frozen weights in bf16 (4 layers, seq 1024)
#   sanitizer       a tiny model, 2 steps on 2 logical workers of cuda:0 under TORCH_CUDA_SANITIZER=1
#   pytest_logical  the `gpu`-marked tests of tests/test_gpu.py on 4 logical workers of cuda:0
#                   (round-robin dispatch and cross-stream event waits on one GPU)
#   pytest_all      every `gpu`-marked test of tests/ on every GPU
# Prints each step's exit code and a summary; writes $GPU_CHECK_OUT/log.txt (everything printed),
# summary.json (rewritten after every step: each step's exit code, status, seconds, timeout, test
# counts, its main figures, and the Python steps' whole results) and the steps' own JSON/JUnit files. Exit 0 when every step
# passed, 1 when one failed (or timed out, or found no time left), 3 when CUDA or torch is missing.
#
# Settings (environment):
#   GPU_CHECK_OUT          output folder (default gpu_check_out/ in the repository)
#   GPU_CHECK_BUDGET_S     seconds for everything (default 530; a larger one scales each step's limit up)
#   GPU_CHECK_SKIP_INSTALL=1   no install step (a rerun)
#   GPU_CHECK_STEPS        comma list of the steps after install (default: all, in the order above)
#   GPU_CHECK_ARGS         more arguments for the benchmarks/gpu_check.py steps (e.g. "--batch-size 2")
#   GPU_CHECK_ACCELERATOR=cpu  no CUDA needed: the Python steps on 2 CPU virtual devices with a tiny
#                          model, the GPU tests only collected (tests/test_gpu_check_script.py runs this)
#   PYTHON                 the interpreter (default: python on PATH, else python3)
if [ -z "${BASH_VERSION:-}" ]; then exec bash "$0" "$@"; fi  # run as `sh scripts/gpu_check.sh` too
set -uo pipefail  # no -e: a failing step never stops the script

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || { echo "gpu_check: FAILED: cannot find the repository"; exit 2; }
cd "$ROOT" || exit 2
OUT=${GPU_CHECK_OUT:-gpu_check_out}
ACCELERATOR=${GPU_CHECK_ACCELERATOR:-cuda}
DEFAULT_BUDGET_S=530  # the sum of LIMITS
BUDGET_S=${GPU_CHECK_BUDGET_S:-$DEFAULT_BUDGET_S}
ORDER=(install throughput parity throughput_logical dropout_accum async_steady fp8_lora sanitizer pytest_logical pytest_all)
declare -A LIMITS=([install]=80 [throughput]=110 [parity]=80 [throughput_logical]=45 [dropout_accum]=40
                   [async_steady]=40 [fp8_lora]=35 [sanitizer]=30 [pytest_logical]=30 [pytest_all]=40)  # sum: 530
STEPS=${GPU_CHECK_STEPS:-$(IFS=,; echo "${ORDER[*]:1}")}
PY=${PYTHON:-$(command -v python || command -v python3 || true)}

# ---------------------------------------------------------------- preflight: before anything else
if [ -z "$PY" ]; then
  echo "gpu_check: FAILED before installing anything: no python on PATH (set PYTHON=/path/to/python)"
  exit 3
fi
if ! command -v timeout >/dev/null 2>&1; then
  echo "gpu_check: FAILED before installing anything: the \`timeout\` command (coreutils) is missing"
  exit 3
fi
PREFLIGHT=$(ACCELERATOR="$ACCELERATOR" timeout -k 5 90 "$PY" -W ignore - 2>&1 <<'PY'
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
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    print(f"torch.cuda.is_available() is False (torch {torch.__version__}, {build},"
          f" CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, {sys.executable})")
    sys.exit(1)
names = ", ".join(f"{i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count()))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) [{names}]; {sys.executable}")
PY
)
PREFLIGHT_RC=$?
PREFLIGHT=${PREFLIGHT##*$'\n'}  # the last line: what the check printed (after any stray warning)
if [ "$PREFLIGHT_RC" -ne 0 ]; then
  echo "gpu_check: FAILED before installing anything: ${PREFLIGHT:-$PY exited with code $PREFLIGHT_RC}"
  exit 3
fi

mkdir -p "$OUT" || { echo "gpu_check: FAILED: cannot create the output folder $OUT"; exit 2; }
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/log.txt
TABLE=$OUT/steps.tsv
: > "$LOG"
: > "$TABLE"
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
FAILED=()
STEP_DESC=

say() { echo "$*" | tee -a "$LOG"; }

# summary.json from steps.tsv and the steps' files (standard library only); after every step, so a
# run killed from outside still leaves one
summarize() {
  "$PY" - "$OUT" "$BUDGET_S" "$SECONDS" "$ACCELERATOR" "$PREFLIGHT" <<'PY' >/dev/null 2>>"$LOG"
import json, os, sys, xml.etree.ElementTree as ET
out, budget, elapsed, accelerator, environment = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
steps, results = [], {}
FIGURES = {  # per step, its main figures (dotted paths into its JSON); every step: ok, problems, error
    "throughput": ["ratio_roundpipe_over_plain", "plain.tokens_per_s", "plain.batch_size", "plain.fallback",
                   "plain.peak_memory_gib", "roundpipe.tokens_per_s", "roundpipe.median_step_s",
                   "roundpipe.predicted_step_s", "roundpipe.predicted_vs_measured", "roundpipe.hidden_upload_fraction",
                   "roundpipe.mfu.datasheet", "roundpipe.mfu.measured_matmul", "roundpipe.peak_memory_gib_per_gpu"],
    "parity": ["loss_rel_diff", "update_rel_error", "batch_size", "plain_fallback"],
    "dropout_accum": ["loss_rel_diff", "overlapped.median_step_s", "overlapped.tokens_per_s",
                      "not_overlapped.median_step_s", "overlapped.peak_memory_gib_per_gpu"],
    "async_steady": ["first_loss_rel_diff", "step_ratio_async_over_sync", "async_run.tokens_per_s",
                     "sync_run.tokens_per_s", "async_run.logged_optimizer_wait_s", "async_run.peak_memory_gib_per_gpu"],
    "fp8_lora": ["loss_rel_diff", "fp8.logged_frozen_matmul_host_bytes_per_param", "fp8.peak_memory_gib_per_gpu",
                 "compute_dtype.peak_memory_gib_per_gpu", "fp8.tokens_per_s", "compute_dtype.tokens_per_s"],
    "sanitizer": ["sanitizer.enabled", "sanitizer.runtime_threads_sanitized", "sanitizer.positive_control"],
}
FIGURES["throughput_logical"] = FIGURES["throughput"]
def figures(name, result):
    out = {}
    for path in ["ok", "problems", "error"] + FIGURES.get(name, []):
        value = result
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None or path == "ok":
            out[path] = value
    return out
for row in open(os.path.join(out, "steps.tsv")):
    name, rc, seconds, limit, status, result = (row.rstrip("\n").split("\t") + ["-"] * 6)[:6]
    step = {"name": name, "exit_code": None if rc == "-" else int(rc), "status": status,
            "seconds": int(seconds), "timeout_s": int(limit)}
    path = os.path.join(out, result)
    if result.endswith(".json") and os.path.exists(path):
        try:
            results[name] = json.load(open(path))
        except ValueError as error:
            results[name] = {"error": f"unreadable {path}: {error}"}
    elif result.endswith(".xml") and os.path.exists(path):
        try:
            root = ET.parse(path).getroot()
            suite = root if root.tag == "testsuite" else root.find("testsuite")
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
            counts["failed"] = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                                if case.find("failure") is not None or case.find("error") is not None]
            step["tests"] = counts
        except (ET.ParseError, AttributeError, ValueError) as error:
            step["tests"] = {"error": f"unreadable {path}: {error}"}
    if name in results and isinstance(results[name], dict):
        step["figures"] = figures(name, results[name])
    steps.append(step)
failed = [s["name"] for s in steps if s["status"] not in ("ok", "skipped")]
summary = {"ok": not failed, "failed_steps": failed, "accelerator": accelerator, "environment": environment,
           "budget_s": budget, "elapsed_s": elapsed, "log": os.path.join(out, "log.txt"), "steps": steps,
           "results": results}
with open(os.path.join(out, "summary.json.tmp"), "w") as f:
    json.dump(summary, f, indent=2, default=str)
os.replace(os.path.join(out, "summary.json.tmp"), os.path.join(out, "summary.json"))
PY
}

record() {  # name rc seconds timeout status result-file: one tab-separated row, "-" for none
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$TABLE"
  case $5 in ok|skipped) ;; *) FAILED+=("$1") ;; esac
  summarize
}

# the seconds kept for the wanted steps after NAME: their limits, scaled to GPU_CHECK_BUDGET_S
reserve_after() {
  local after=0 total=0 sum=0 step
  for step in "${ORDER[@]}"; do
    total=$((total + LIMITS[$step]))
    if ((after)) && want "$step"; then sum=$((sum + LIMITS[$step])); fi
    [ "$step" = "$1" ] && after=1
  done
  echo $((sum * BUDGET_S / total))
}

# run_step NAME RESULT-FILE CMD...: CMD under `timeout`, at most LIMITS[NAME] seconds and never past
# the budget minus what the later steps are given (reserve_after); its exit code is recorded, never fatal
run_step() {
  local name=$1 limit=$((LIMITS[$1] * BUDGET_S / DEFAULT_BUDGET_S)) reserve result=$2
  ((limit < LIMITS[$1])) && limit=${LIMITS[$1]}  # a budget over the default 530 s scales every step's limit up
  reserve=$(reserve_after "$name")
  shift 2
  local left=$((BUDGET_S - SECONDS - reserve))
  ((left < limit)) && limit=$left
  say ""
  if ((limit < 10)); then
    say "=== [$name] not run: no time left in the ${BUDGET_S} s budget"
    record "$name" - 0 0 "not run (budget spent)" -
    STEP_DESC=
    return
  fi
  [ "$result" != - ] && rm -f "$OUT/$result"
  say "=== [$name] $(date -u +%H:%M:%S) timeout ${limit} s: ${STEP_DESC:-$*}"
  STEP_DESC=
  local t0=$SECONDS
  timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]} status=ok
  if ((rc == 124 || rc == 137)); then status="timed out"; elif ((rc != 0)); then status=failed; fi
  say "=== [$name] exit code $rc ($status) after $((SECONDS - t0)) s"
  record "$name" "$rc" $((SECONDS - t0)) "$limit" "$status" "$result"
}

want() { [ "$1" = install ] && [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ] && return 0
         case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# run as `bash -c install_deps` under `timeout` (which runs programs, not functions)
install_deps() {
  local torch_version
  torch_version=$("$PY" -c 'import torch; print(torch.__version__)') || return 1
  echo "torch==$torch_version" > "$OUT/constraints.txt"
  echo "keeping the installed torch==$torch_version (pip constraint)"
  "$PY" -m pip --version >/dev/null 2>&1 || "$PY" -m ensurepip --upgrade || return 1
  # a lent machine's system python may be marked externally managed (PEP 668); older pips ignore this
  export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
  local pip=("$PY" -m pip install --disable-pip-version-check --progress-bar off -q)
  "${pip[@]}" -c "$OUT/constraints.txt" -e ".[test]" && return 0
  echo "install: pip failed (above) with torch pinned; the package without dependencies, then every requirement but torch"
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
  "${pip[@]}" --no-deps -e . || return 1
  "${pip[@]}" -c "$OUT/constraints.txt" -r "$OUT/requirements-without-torch.txt"
}

# ---------------------------------------------------------------- the machine
say "gpu_check: $PREFLIGHT"
say "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), output folder $OUT, budget ${BUDGET_S} s, steps: $STEPS"
command -v git >/dev/null 2>&1 && git log -1 --oneline 2>/dev/null | cut -c1-120 | sed 's/^/gpu_check: commit /' | tee -a "$LOG"
if [ "$ACCELERATOR" = cuda ] && command -v nvidia-smi >/dev/null 2>&1; then
  timeout 20 nvidia-smi 2>&1 | tee -a "$LOG"
fi

BENCH=("$PY" benchmarks/gpu_check.py)
read -r -a EXTRA <<< "${GPU_CHECK_ARGS:-}"
if [ "$ACCELERATOR" = cpu ]; then
  # the same steps on 2 CPU virtual devices, a tiny model (a budget: the peak memory metric)
  COMMON=(--accelerator cpu --tiny "${EXTRA[@]}")
  PARITY=(--devices 2)
  THROUGHPUT=(--devices 2 --device-memory-bytes $((256 * 2**20)) --profile-steps 2 --warmup 0 --steps 2)
  LOGICAL_THROUGHPUT=("${THROUGHPUT[@]}")  # CPU virtual devices are logical devices of one host already
  MODES=(--devices 2 --warmup 1 --mode-steps 2)
  SANITIZER=(env "$PY" benchmarks/gpu_check.py sanitizer --devices 2)  # the CUDA sanitizer needs CUDA
  LOGICAL=all
  ALL_TESTS=tests/test_gpu.py  # skipped without CUDA: collecting them is the check
else
  GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 1)
  COMMON=(--accelerator cuda "${EXTRA[@]}")
  if ((GPUS > 1)); then PARITY=(--devices all); else PARITY=(--devices cuda:0,cuda:0); fi  # round-robin on one GPU too
  THROUGHPUT=(--devices all)  # every GPU vs plain training on one
  LOGICAL_THROUGHPUT=(--devices cuda:0,cuda:0 --layers 8 --profile-steps 2 --warmup 1 --steps 2)
  MODES=(--devices all --layers 4 --seq-len 1024 --warmup 1 --mode-steps 3)
  SANITIZER=(env TORCH_CUDA_SANITIZER=1 "$PY" benchmarks/gpu_check.py sanitizer --tiny --devices cuda:0,cuda:0)
  LOGICAL=cuda:0,cuda:0,cuda:0,cuda:0
  ALL_TESTS=tests/
fi

# ---------------------------------------------------------------- the steps
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
  say ""
  say "=== [install] skipped (GPU_CHECK_SKIP_INSTALL=1)"
  record install - 0 0 skipped -
else
  export -f install_deps
  export PY OUT
  STEP_DESC="pip install -e \".[test]\" with torch pinned to the installed build"
  run_step install - bash -c install_deps
fi
bench_step() {  # NAME CHECK ARGS...: benchmarks/gpu_check.py CHECK, its JSON as NAME.json
  local name=$1 check=$2
  shift 2
  want "$name" && run_step "$name" "$name.json" "${BENCH[@]}" "$check" "${COMMON[@]}" "$@" --json "$OUT/$name.json"
}
bench_step throughput throughput "${THROUGHPUT[@]}"
bench_step parity parity "${PARITY[@]}"
bench_step throughput_logical throughput "${LOGICAL_THROUGHPUT[@]}"
bench_step dropout_accum dropout_accum "${MODES[@]}"
bench_step async_steady async_steady "${MODES[@]}"
bench_step fp8_lora fp8_lora "${MODES[@]}"
want sanitizer && run_step sanitizer sanitizer.json "${SANITIZER[@]}" "${COMMON[@]}" --json "$OUT/sanitizer.json"
PYTEST=("$PY" -m pytest -q -m gpu -p no:cacheprovider -rfEs)
want pytest_logical && run_step pytest_logical pytest_logical.xml env ROUNDPIPE_GPU_TEST_DEVICES="$LOGICAL" \
  "${PYTEST[@]}" tests/test_gpu.py --junitxml="$OUT/pytest_logical.xml"
want pytest_all && run_step pytest_all pytest_all.xml env ROUNDPIPE_GPU_TEST_DEVICES=all \
  "${PYTEST[@]}" "$ALL_TESTS" --junitxml="$OUT/pytest_all.xml"

# ---------------------------------------------------------------- summary
say ""
say "=== summary: ${SECONDS} s of the ${BUDGET_S} s budget; $OUT/summary.json, $LOG"
while IFS=$'\t' read -r name rc seconds limit status result; do
  say "$(printf '  %-16s exit %-4s %-24s %4s s' "$name" "$rc" "$status" "$seconds")"
done < "$TABLE"
"$PY" - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return None
def fmt(x, spec=".3g"):
    return "-" if not isinstance(x, (int, float)) else format(x, spec)
p = load("parity.json")
if p:
    print(f"  parity: losses plain {[round(x, 4) for x in p.get('plain_losses', [])]}, roundpipe"
          f" {[round(x, 4) for x in p.get('roundpipe_losses', [])]}; update rel. error {fmt(p.get('update_rel_error'))}"
          f" (tol {p.get('update_tol')}); ok {p.get('ok')}")
for name in ("throughput", "throughput_logical"):
  t = load(name + ".json")
  if t and "roundpipe" in t:
    r, b = t["roundpipe"], t.get("plain", {})
    if b.get("fallback"):
        print(f"  {name}: FALLBACK: {b['fallback']}")
    print(f"  {name}: plain {fmt(b.get('tokens_per_s'), '.0f')} tokens/s, roundpipe {fmt(r.get('tokens_per_s'), '.0f')}"
          f" tokens/s (x{fmt(t.get('ratio_roundpipe_over_plain'))}); MFU plain {fmt((b.get('mfu') or {}).get('datasheet'))},"
          f" roundpipe {fmt((r.get('mfu') or {}).get('datasheet'))}; step {fmt(r.get('median_step_s'))} s measured,"
          f" {fmt(r.get('predicted_step_s'))} s predicted; upload hidden {fmt(r.get('hidden_upload_fraction'))};"
          f" peak GiB per GPU {r.get('peak_memory_gib_per_gpu')}; ok {t.get('ok')} {t.get('problems') or ''}")
if p and p.get("plain_fallback"):
    print(f"  parity: FALLBACK: {p['plain_fallback']}")
for name, run in (("dropout_accum", "overlapped"), ("async_steady", "async_run"), ("fp8_lora", "fp8")):
    m = load(name + ".json")
    if m:
        r = m.get(run) or {}
        print(f"  {name}: losses {[round(x, 4) for x in r.get('losses', [])]}; step {fmt(r.get('median_step_s'))} s,"
              f" {fmt(r.get('tokens_per_s'), '.0f')} tokens/s; peak GiB per GPU {r.get('peak_memory_gib_per_gpu')};"
              f" ok {m.get('ok')} {m.get('problems') or m.get('error') or ''}")
s = load("sanitizer.json")
if s:
    print(f"  sanitizer: {s.get('sanitizer')}; ok {s.get('ok')} {s.get('problems') or ''}")
PY
summarize
if ((${#FAILED[@]})); then
  say "gpu_check: FAILED steps: ${FAILED[*]}"
  exit 1
fi
say "gpu_check: all steps passed"
exit 0
