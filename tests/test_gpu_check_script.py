"""`scripts/gpu_check.sh` and `benchmarks/gpu_check.py` without a GPU, so that the one run on a lent GPU
cannot die for a trivial reason (an argument, a key, a JSON field): the script refuses at once (one
line, nothing installed or written) where CUDA or torch is missing, installs without replacing torch,
keeps going past failing, hanging and unscheduled steps and writes its summary; the Python steps run
on CPU virtual devices with a tiny model; the timeline analysis counts what it should."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["throughput", "parity", "throughput_logical", "dropout_accum", "async_steady", "fp8_lora", "sanitizer",
         "pytest_logical", "pytest_all"]  # after install, in the script's order: the measuring steps first


def _gpu_check(name: str = "gpu_check"):
    """``benchmarks/<name>.py`` as a module (``gpu_check``, or its timeline analysis ``gpu_check_timeline``)."""
    spec = importlib.util.spec_from_file_location(f"roundpipe_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _spy_python(tmp_path: Path, cases: str = "") -> tuple[Path, Path]:
    """A ``python`` first on PATH that logs its arguments, answers the shell ``case`` patterns of
    ``cases`` itself, and runs this interpreter otherwise; ``pip``/``pip3`` fail and are logged."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f"""#!/usr/bin/env bash
echo "python $*" >> "{calls}"
case "$*" in
{cases}
esac
exec "{sys.executable}" "$@"
""")
    for pip in ("pip", "pip3"):
        (bin_dir / pip).write_text(f'#!/bin/sh\necho "{pip} $*" >> "{calls}"\nexit 1\n')
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    return bin_dir, calls


def _run_script(tmp_path: Path, timeout: float, cases: str = "", **env: str):
    bin_dir, calls = _spy_python(tmp_path, cases)
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "PYTHON"}
    full.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", GPU_CHECK_OUT=str(tmp_path / "out"), **env)
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start, calls.read_text().splitlines() if calls.exists() else []


def _summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out" / "summary.json").read_text())


# ------------------------------------------------------------------ the script: refusal, install, going on
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_script_without_cuda_fails_at_once_with_one_line_and_installs_nothing(tmp_path):
    proc, _, calls = _run_script(tmp_path, timeout=600)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and not proc.stderr.strip(), proc.stdout + proc.stderr
    assert lines[0].startswith("gpu_check: FAILED before installing anything: torch.cuda.is_available() is False")
    assert [c.split()[:3] for c in calls] == [["python", "-W", "ignore"]], calls  # the check alone: no pip, no pytest
    assert not (tmp_path / "out").exists()


def test_script_without_torch_fails_with_one_line(tmp_path):
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no torch in this environment')\n")
    proc, _, calls = _run_script(tmp_path, timeout=600, PYTHONPATH=str(fake.parent))
    assert proc.returncode == 3
    assert proc.stdout.strip().splitlines() == [
        f"gpu_check: FAILED before installing anything: torch is not importable by {sys.executable}"
        " (ImportError: no torch in this environment)"]
    assert not any("pip" in c for c in calls)


def test_script_installs_with_torch_pinned_and_falls_back_to_every_requirement_but_torch(tmp_path):
    """pip (faked) refuses ``-e .[test]``: the package goes in without dependencies, then every other
    requirement, all under the installed torch's pin; pip itself never runs."""
    cases = """  *"-m pip --version"*) exit 0 ;;
  *"-m pip install"*".[test]"*) exit 1 ;;
  *"-m pip install"*) exit 0 ;;"""
    proc, _, calls = _run_script(tmp_path, timeout=600, cases=cases, GPU_CHECK_ACCELERATOR="cpu",
                                 GPU_CHECK_STEPS="none")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    pips = [c for c in calls if c.startswith("python -m pip install")]
    assert len(pips) == 3, pips
    constraint = f"-c {out}/constraints.txt"
    assert constraint in pips[0] and pips[0].endswith("-e .[test]")
    assert pips[1].endswith("--no-deps -e .") and constraint not in pips[1]
    assert constraint in pips[2] and pips[2].endswith(f"-r {out}/requirements-without-torch.txt")
    assert (out / "constraints.txt").read_text().strip() == f"torch=={torch.__version__}"
    reqs = (out / "requirements-without-torch.txt").read_text().split()
    assert "torchmetrics>=1.0" in reqs and "pytest>=8" in reqs and not any(r.startswith("torch=") for r in reqs)
    summary = _summary(tmp_path)
    assert summary["ok"] is True and [(s["name"], s["exit_code"], s["status"]) for s in summary["steps"]] == [
        ("install", 0, "ok")]


def test_script_out_of_budget_records_every_step_as_not_run_and_exits_1(tmp_path):
    proc, _, calls = _run_script(tmp_path, timeout=600, GPU_CHECK_ACCELERATOR="cpu", GPU_CHECK_BUDGET_S="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = _summary(tmp_path)
    assert summary["ok"] is False and summary["failed_steps"] == ["install", *STEPS]
    assert all(s["status"] == "not run (budget spent)" and s["exit_code"] is None for s in summary["steps"])
    assert "=== [parity] not run: no time left" in (tmp_path / "out" / "log.txt").read_text()
    assert "gpu_check: FAILED steps: install throughput" in proc.stdout
    assert not any("-m pip" in c or "-m pytest" in c for c in calls)


def test_script_runs_measuring_steps_first_within_limits_that_sum_to_its_budget(tmp_path):
    """Every step answered at once by a fake `python`: the steps run in the script's order (the
    throughput and parity steps before the pytest steps, whatever GPU_CHECK_STEPS says), each under
    its own time limit, and those limits add up to no more than the 530 s budget; each step's exit
    code is in the summary."""
    cases = """  *"-m pytest"*) exit 0 ;;
  *"gpu_check.py fp8_lora"*) exit 5 ;;
  *"gpu_check.py"*) exit 0 ;;"""
    steps = ",".join(reversed(STEPS))
    proc, _, calls = _run_script(tmp_path, timeout=600, cases=cases, GPU_CHECK_ACCELERATOR="cpu",
                                 GPU_CHECK_SKIP_INSTALL="1", GPU_CHECK_STEPS=steps)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = _summary(tmp_path)
    ran = summary["steps"][1:]
    assert [s["name"] for s in ran] == STEPS
    assert [(s["exit_code"], s["status"]) for s in ran if s["name"] == "fp8_lora"] == [(5, "failed")]
    assert summary["failed_steps"] == ["fp8_lora"]  # the steps after it ran all the same
    assert all(s["exit_code"] == 0 for s in ran if s["name"] != "fp8_lora")
    script = SCRIPT.read_text()
    limits = dict(re.findall(r"\[(\w+)\]=(\d+)", script[script.index("declare -A LIMITS"):]))
    assert sum(map(int, limits.values())) <= summary["budget_s"] == 530 and set(limits) == {"install", *STEPS}
    assert [s["timeout_s"] for s in ran] == [int(limits[name]) for name in STEPS]  # each got its whole limit
    benches = [c.split()[2] for c in calls if "gpu_check.py" in c]
    assert benches == ["throughput", "parity", "throughput", "dropout_accum", "async_steady", "fp8_lora", "sanitizer"]
    assert "--devices 2" in next(c for c in calls if "gpu_check.py dropout_accum" in c)


@pytest.mark.slow
def test_script_goes_on_after_failed_timed_out_and_unscheduled_steps(tmp_path):
    """`python` answers for the steps: the tests pass, parity exits 3, throughput passes, the sanitizer
    hangs until its timeout, and the budget leaves nothing for the later steps. Every one is reported
    with its exit code; the script ends with its summary and exit 1.

    Budget 40 s: the steps after throughput keep 180/530 of it (13 s), so throughput runs while the
    script's start took under 17 s: its preflight (`import torch`, 10 s and more on a loaded machine)
    is answered by the fake `python` too, which leaves the start a few shell lines and one standard-
    library summary (with a real preflight and 20 s of budget it was skipped under load). The
    sanitizer's hang (at most its 30 s limit) then leaves under 10 s for `pytest_logical`, which is not run;
    the last step gets the seconds both kept and runs or not by the start's speed.
    That the script keeps to its budget is read from its own schedule (each step's timeout after the
    seconds the steps before it took), not from the wall time of the run."""
    BUDGET_S = 40
    cases = """  "-W ignore -") echo "torch (fake preflight); CPU virtual devices (GPU_CHECK_ACCELERATOR=cpu)"; exit 0 ;;
  *"-m pytest"*) echo "fake pytest: passed"; exit 0 ;;
  *"gpu_check.py parity"*) echo "fake parity: out of tolerance"; exit 3 ;;
  *"gpu_check.py throughput"*) echo "fake throughput"; exit 0 ;;
  *"gpu_check.py sanitizer"*) exec sleep 300 ;;"""
    proc, _, _ = _run_script(tmp_path, timeout=300, cases=cases, GPU_CHECK_ACCELERATOR="cpu",
                             GPU_CHECK_SKIP_INSTALL="1", GPU_CHECK_BUDGET_S=str(BUDGET_S),
                             GPU_CHECK_STEPS="pytest_logical,parity,throughput,sanitizer,pytest_all")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = _summary(tmp_path)
    # the schedule keeps to the budget: a step's timeout never reaches past it, counted from the seconds
    # the steps before it took (a lower bound of its start)
    spent = 0
    for step in summary["steps"]:
        assert spent + step["timeout_s"] <= BUDGET_S, summary["steps"]
        spent += step["seconds"]
    # the script keeps its own order of steps, whatever the order of GPU_CHECK_STEPS
    steps = [(s["name"], s["status"], s["exit_code"]) for s in summary["steps"]]
    assert steps[:3] == [("install", "skipped", None), ("throughput", "ok", 0), ("parity", "failed", 3)], steps
    assert steps[3] == ("sanitizer", "timed out", 124) or steps[3] == ("sanitizer", "not run (budget spent)", None)
    assert steps[4] == ("pytest_logical", "not run (budget spent)", None)
    # the last step is given what the skipped one kept too (13 s less the start's seconds): it runs (the fake
    # pytest passes) where the script started fast, and is not run where its start took over 3 s (a loaded machine)
    assert steps[5] in (("pytest_all", "not run (budget spent)", None), ("pytest_all", "ok", 0)), steps
    assert summary["ok"] is False and "parity" in summary["failed_steps"] and "sanitizer" in summary["failed_steps"]
    assert "=== [parity] exit code 3 (failed)" in proc.stdout
    failed = "parity sanitizer pytest_logical" + (" pytest_all" if steps[5][1] != "ok" else "")
    assert f"gpu_check: FAILED steps: {failed}\n" in proc.stdout


@pytest.mark.slow
def test_script_on_cpu_virtual_devices_runs_every_step_past_a_failing_one(tmp_path):
    """The whole script in its CPU mode, parity made to fail (a negative tolerance): every other step
    runs and passes; summary.json holds each step's exit code and the Python steps' results.

    The step limits are sized for a GPU's 15 minutes; on a loaded 2-core machine CPU steps ran up to them
    (fp8_lora timed out at its 35 s with two busy loops and another test job beside it). What is tested here
    is the script's flow, not the machine's speed: the budget is 10x the GPU one, which scales each step's limit 10x."""
    budget_s = 10 * 530
    env = dict(GPU_CHECK_ACCELERATOR="cpu", GPU_CHECK_SKIP_INSTALL="1", GPU_CHECK_ARGS="--loss-tol -1",
               PYTHON=sys.executable, GPU_CHECK_BUDGET_S=str(budget_s))
    proc, _, _ = _run_script(tmp_path, timeout=budget_s + 300, **env)  # a hang guard: the budget bounds the run
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = _summary(tmp_path)
    statuses = {s["name"]: (s["status"], s["exit_code"]) for s in summary["steps"]}
    assert [s["name"] for s in summary["steps"]] == ["install", *STEPS]
    # the overlapped dropout run: RoundPipe's RNG guard raised there until issue 30's RNG fix (another branch)
    known = summary["results"].get("dropout_accum", {}).get("error", "").startswith("ValueError: RoundPipe: layer")
    failing = {"parity", "dropout_accum"} if known else {"parity"}
    assert statuses["parity"] == ("failed", 1) and statuses["install"] == ("skipped", None)
    assert all(statuses[name] == ("ok", 0) for name in STEPS if name not in failing), statuses
    assert summary["failed_steps"] == [n for n in STEPS if n in failing] and summary["elapsed_s"] <= summary["budget_s"]
    for step in summary["steps"][-2:]:  # the GPU tests: collected, skipped without CUDA
        assert step["tests"]["tests"] > 0 and step["tests"]["failures"] == step["tests"]["errors"] == 0
    results = summary["results"]
    assert results["parity"]["ok"] is False and results["parity"]["loss_tol"] == -1
    assert results["throughput"]["ok"] is True and 0 <= results["throughput"]["roundpipe"]["hidden_upload_fraction"] <= 1
    assert results["sanitizer"]["ok"] is True and results["throughput_logical"]["ok"] is True
    for step in summary["steps"][1:-2]:  # every Python step: its figures beside its exit code
        assert step["figures"]["ok"] is (step["exit_code"] == 0), step
    assert summary["steps"][1]["figures"]["plain.batch_size"] == 4
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "=== [throughput] exit code 0 (ok)" in log and "  throughput: plain " in log


# ------------------------------------------------------------------ the Python steps on CPU virtual devices
def test_python_steps_on_cpu_virtual_devices(tmp_path):
    """parity, throughput and sanitizer of benchmarks/gpu_check.py, in this process, on 2 CPU virtual
    devices with the tiny model: every field the GPU run reports, with sane values."""
    gpu_check = _gpu_check()
    common = ["--accelerator", "cpu", "--tiny", "--devices", "2", "--root-dir", str(tmp_path / "root")]

    assert gpu_check.main(["parity", *common, "--json", str(tmp_path / "parity.json")]) == 0
    parity = json.loads((tmp_path / "parity.json").read_text())
    assert parity["ok"] is True and parity["devices"] == ["cpu", "cpu"] and parity["model"]["layers"] == 4
    assert len(parity["plain_losses"]) == len(parity["roundpipe_losses"]) == 3
    assert all(_finite_positive(x) for x in parity["plain_losses"] + parity["roundpipe_losses"])
    assert parity["plain_losses"] != parity["plain_losses"][:1] * 3  # the weights moved
    assert max(parity["loss_rel_diff"]) <= parity["loss_tol"] == 1e-2
    assert 0 < parity["update_rel_error"] <= parity["update_tol"] == 5e-2  # bf16 noise: not bitwise, not far
    assert math.isfinite(parity["param_max_abs_diff"])

    budget = 256 * 2**20
    assert gpu_check.main(["throughput", *common, "--device-memory-bytes", str(budget), "--profile-steps", "2",
                           "--warmup", "0", "--steps", "2", "--json", str(tmp_path / "throughput.json")]) == 0
    tp = json.loads((tmp_path / "throughput.json").read_text())
    plain, rp = tp["plain"], tp["roundpipe"]
    assert tp["ok"] is True and tp["problems"] == [] and tp["physical_devices"] == 1
    assert tp["tokens_per_step"] == 4 * 32 and _finite_positive(tp["model_flops_per_step"])
    assert tp["peak_flops"]["datasheet"] is None and _finite_positive(tp["peak_flops"]["measured_matmul"])
    assert len(plain["step_s"]) == 2 and len(rp["step_s"]) == 4  # plain: timed; RoundPipe: profiled + timed
    for run in (plain, rp):
        assert _finite_positive(run["median_step_s"]) and _finite_positive(run["tokens_per_s"])
        assert run["tokens_per_s"] == pytest.approx(tp["tokens_per_step"] / run["median_step_s"])
        # the MFU's peak was measured with the host's speed of that moment (other jobs may hold the cores then
        # and not later): a figure against the machine's current speed, so its formula is checked, not its range
        assert run["mfu"]["measured_matmul"] == pytest.approx(
            tp["model_flops_per_step"] / run["median_step_s"] / tp["peak_flops"]["measured_matmul"])
        assert run["mfu"]["datasheet"] is None
    assert tp["ratio_roundpipe_over_plain"] == pytest.approx(rp["tokens_per_s"] / plain["tokens_per_s"])
    assert _finite_positive(rp["predicted_step_s"])
    assert rp["predicted_vs_measured"] == pytest.approx((rp["predicted_step_s"] - rp["median_step_s"]) / rp["median_step_s"])
    assert _finite_positive(rp["logged_step_s"]) and rp["logged_step_s"] <= rp["median_step_s"] * 1.5
    assert _finite_positive(rp["logged_tokens_per_s"]) and rp["logged_mfu_pct"] is None  # no CPU peak known
    assert 0 <= rp["logged_bubble_pct"] <= 100 and rp["logged_optimizer_s"] >= 0
    peaks = rp["logged_peak_memory_gib_per_device"]
    assert sorted(peaks) == ["0", "1"] and all(0 < v <= budget / 2**30 for v in peaks.values()), peaks
    assert plain["peak_memory_gib"] is None and rp["peak_memory_gib_per_gpu"] is None  # no GPU
    assert 0.0 <= rp["hidden_upload_fraction"] <= 1.0
    assert rp["weight_chunks"] > 0 and rp["computes"] > 0 and rp["computes_before_their_upload"] == 0
    assert 0 <= rp["weight_upload_hidden_s"] <= rp["weight_upload_s"]

    assert gpu_check.main(["sanitizer", *common, "--json", str(tmp_path / "sanitizer.json")]) == 0
    san = json.loads((tmp_path / "sanitizer.json").read_text())
    assert san["ok"] is True and len(san["losses"]) == 2 and all(map(_finite_positive, san["losses"]))
    assert san["sanitizer"]["enabled"] is False and san["sanitizer"]["runtime_threads_sanitized"] == 0


def test_mode_steps_on_cpu_virtual_devices(tmp_path):
    """async_steady and fp8_lora of benchmarks/gpu_check_modes.py, and throughput on 2 logical devices (on
    CPU virtual devices every device is one: the script's CPU mode runs that step as throughput), in this
    process, tiny model: the fields the summary takes, with their oracles."""
    gpu_check = _gpu_check()
    common = ["--accelerator", "cpu", "--tiny", "--devices", "2", "--root-dir", str(tmp_path / "root"), "--warmup", "1",
              "--mode-steps", "2"]

    assert gpu_check.main(["async_steady", *common, "--json", str(tmp_path / "async.json")]) == 0
    run = json.loads((tmp_path / "async.json").read_text())
    stale, exact = run["async_run"], run["sync_run"]
    assert run["ok"] is True and run["problems"] == [] and len(stale["losses"]) == len(exact["losses"]) == 2
    assert run["first_loss_rel_diff"] <= run["loss_tol"] == 1e-2  # both first steps on the initial weights
    assert stale["losses"][1] != exact["losses"][1]  # the second: async on weights one step stale
    assert _finite_positive(stale["logged_optimizer_thread_s"]) and stale["logged_optimizer_wait_s"] >= 0
    for one in (stale, exact):
        assert _finite_positive(one["median_step_s"]) and one["peak_memory_gib_per_gpu"] is None  # no GPU
        assert one["tokens_per_s"] == pytest.approx(4 * 32 / one["median_step_s"])
    assert run["step_ratio_async_over_sync"] == pytest.approx(stale["median_step_s"] / exact["median_step_s"])

    assert gpu_check.main(["fp8_lora", *common, "--json", str(tmp_path / "fp8.json")]) == 0
    fp8 = json.loads((tmp_path / "fp8.json").read_text())
    assert fp8["ok"] is True and fp8["frozen_weights"] == "fp8" and len(fp8["fp8"]["losses"]) == 2
    assert max(fp8["loss_rel_diff"]) <= fp8["loss_tol"] == 5e-2 and fp8["loss_rel_diff"] != [0.0, 0.0]  # fp8 is not bf16
    assert 1.0 <= fp8["fp8"]["logged_frozen_matmul_host_bytes_per_param"] <= 1.1
    assert fp8["compute_dtype"]["logged_frozen_matmul_host_bytes_per_param"] >= 2  # bf16 or fp32 frozen weights


def test_dropout_accumulation_step_on_cpu_virtual_devices(tmp_path):
    """dropout_accum: LoRA dropout 0.1 under overlapped accumulation matches the same run without overlap."""
    gpu_check = _gpu_check()
    args = ["dropout_accum", "--accelerator", "cpu", "--tiny", "--devices", "2", "--root-dir", str(tmp_path),
            "--warmup", "1", "--mode-steps", "2", "--json", str(tmp_path / "dropout.json")]
    assert gpu_check.main(args) == 0
    run = json.loads((tmp_path / "dropout.json").read_text())
    assert run["ok"] is True and len(run["overlapped"]["losses"]) == len(run["not_overlapped"]["losses"]) == 4
    assert max(run["loss_rel_diff"]) <= run["loss_tol"] == 1e-2


def test_plain_baseline_falls_back_to_a_smaller_batch_on_oom(tmp_path, monkeypatch):
    """The plain single-device run raises CUDA's OOM above 1 row (faked): throughput halves its batch
    until it fits, reports the batch and the fallback, and computes the plain tokens/s and MFU from
    the batch it ran; RoundPipe keeps the full batch. Another error is not taken for an OOM."""
    gpu_check = _gpu_check()
    real_fit = gpu_check.fit
    tried = []

    def fit(args, model, roundpipe, steps, optimizer_name, lr, clip=None, batch_size=None, **kw):
        if not roundpipe:
            tried.append(batch_size)
            if batch_size > 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (faked)")
        return real_fit(args, model, roundpipe, steps, optimizer_name, lr, clip, batch_size, **kw)

    monkeypatch.setattr(gpu_check, "fit", fit)
    common = ["--accelerator", "cpu", "--tiny", "--devices", "2", "--root-dir", str(tmp_path / "root")]
    assert gpu_check.main(["throughput", *common, "--profile-steps", "2", "--warmup", "0", "--steps", "2",
                           "--device-memory-bytes", str(256 * 2**20), "--json", str(tmp_path / "throughput.json")]) == 0
    tp = json.loads((tmp_path / "throughput.json").read_text())
    plain = tp["plain"]
    assert tried == [4, 2, 1] and plain["batch_size"] == 1
    assert plain["fallback"] == "plain single-device run out of memory at batch 4, 2; ran at batch 1"
    assert plain["tokens_per_s"] == pytest.approx(1 * 32 / plain["median_step_s"])
    assert tp["tokens_per_step"] == 4 * 32  # RoundPipe's batch
    assert tp["ratio_roundpipe_over_plain"] == pytest.approx(tp["roundpipe"]["tokens_per_s"] / plain["tokens_per_s"])

    def broken(args, model, roundpipe, *rest, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_check, "fit", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        gpu_check.main(["parity", *common, "--json", str(tmp_path / "parity.json")])


def test_parity_check_fails_outside_its_tolerance(tmp_path):
    args = ["parity", "--accelerator", "cpu", "--tiny", "--parity-steps", "2", "--update-tol", "0",
            "--root-dir", str(tmp_path), "--json", str(tmp_path / "parity.json")]
    assert _gpu_check().main(args) == 1
    parity = json.loads((tmp_path / "parity.json").read_text())
    assert parity["ok"] is False and parity["update_rel_error"] > 0


def test_gpu_check_refuses_cuda_without_it(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as info:
        _gpu_check().parse_args(["parity"])
    assert info.value.code == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_upload_overlap_of_measured_timelines():
    """The hidden fraction is the weight-upload time under compute on the same device; a compute that
    starts before a complete upload of its stage (all chunks of one round) counts."""
    from lightning_roundpipe.metrics.timeline import Interval, Timeline

    def load(stage, chunk, start, end, rnd=0, device=0):
        label = f"{stage}LOAD.c{chunk}" + (f"@{rnd}" if rnd else "")
        return Interval(device, "H2D", stage, None, start, end, nbytes=100, stream="weights", label=label)

    def comp(stage, start, end, device=0, mb=0):
        return Interval(device, "F", stage, mb, start, end, stream="compute", label=f"{stage}F{mb}")

    overlap = _gpu_check("gpu_check_timeline").upload_overlap
    # device 0: stage 1 uploads in [1, 3] (two chunks) while stage 0 computes in [0, 2]; stage 1 computes
    # from 3; device 1: an upload with no compute at all
    tl = Timeline(2, [comp(0, 0.0, 2.0), load(0, 0, -1.0, 0.0), load(1, 0, 1.0, 2.0), load(1, 1, 2.0, 3.0),
                      comp(1, 3.0, 4.0), comp(1, 4.0, 5.0, mb=1), load(2, 0, 0.0, 1.0, device=1)])
    got = overlap([tl])
    assert got["weight_upload_s"] == pytest.approx(1.0 + 2.0 + 1.0)
    assert got["weight_upload_hidden_s"] == pytest.approx(1.0)  # [1, 2] of stage 1's upload under stage 0
    assert got["hidden_upload_fraction"] == pytest.approx(0.25)
    assert got["weight_chunks"] == 4 and got["computes"] == 3 and got["computes_before_their_upload"] == 0
    # stage 1 starts while its second chunk is still uploading
    early = Timeline(1, [load(1, 0, 0.0, 1.0), load(1, 1, 1.0, 2.0), comp(1, 1.5, 3.0)])
    assert overlap([early])["computes_before_their_upload"] == 1
    # a later round of stage 1 uploading (the other slot) while round 0 computes: not early
    rounds = Timeline(1, [load(1, 0, 0.0, 1.0), comp(1, 1.0, 3.0), load(1, 0, 2.0, 2.5, rnd=1), comp(1, 3.0, 4.0)])
    assert overlap([rounds])["computes_before_their_upload"] == 0
    assert overlap([Timeline(1, [comp(0, 0.0, 1.0)])])["hidden_upload_fraction"] is None
