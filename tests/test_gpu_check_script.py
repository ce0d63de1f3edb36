"""`scripts/gpu_check.sh` and `benchmarks/gpu_check.py` without a GPU: the script refuses at once
(one line, nothing installed) where CUDA is missing, keeps going past failing steps and writes its
summary; the Python steps run on CPU virtual devices with a tiny model, so the one run on a lent GPU
cannot die for a trivial reason (an argument, a key, a JSON field)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import lightning_roundpipe
from lightning_roundpipe.integration.strategy import stage_memory_bytes
from _helpers import CausalLMModule, TokenData, loader, tiny_hf, trainer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))


def _spy_python(tmp_path: Path) -> tuple[Path, Path]:
    """A ``python`` first on PATH that logs its arguments, then runs this interpreter; with
    ``SPY_FAKE_PIP=1`` it answers ``-m pip ...`` itself (exit 1 for the first ``install`` of
    ``.[test]``, else 0) without running pip."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "python_calls.txt"
    bin_dir.mkdir()
    spy = bin_dir / "python"
    spy.write_text(f"""#!/usr/bin/env bash
echo "$*" >> "{calls}"
if [ "${{SPY_FAKE_PIP:-0}}" = 1 ] && [ "$1 $2" = "-m pip" ]; then
  case "$*" in *".[test]"*) [ -e "{calls}.failed" ] && exit 0; touch "{calls}.failed"; exit 1 ;; esac
  exit 0
fi
exec "{sys.executable}" "$@"
""")
    spy.chmod(0o755)
    return bin_dir, calls


def _run_script(tmp_path: Path, timeout: float, **env: str) -> tuple[subprocess.CompletedProcess, float, Path]:
    bin_dir, calls = _spy_python(tmp_path)
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "PYTHON"}
    full.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", GPU_CHECK_OUT=str(tmp_path / "out"), **env)
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start, calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_script_without_cuda_fails_at_once_with_one_line_and_installs_nothing(tmp_path):
    proc, elapsed, calls = _run_script(tmp_path, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and not proc.stderr.strip(), proc.stdout + proc.stderr
    assert lines[0].startswith("gpu_check: FAILED before installing anything: torch.cuda.is_available() is False")
    assert elapsed < 60
    used = calls.read_text()
    assert used and "-m pip" not in used  # the python on PATH ran the check; pip never did
    assert not (tmp_path / "out").exists()


def test_script_without_torch_fails_with_one_line(tmp_path):
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no torch in this environment')\n")
    proc, elapsed, calls = _run_script(tmp_path, timeout=60, PYTHONPATH=str(fake.parent))
    assert proc.returncode == 3
    assert proc.stdout.strip().splitlines() == [
        f"gpu_check: FAILED before installing anything: torch is not importable by {sys.executable}"
        " (ImportError: no torch in this environment)"]
    assert "-m pip" not in calls.read_text()


def test_script_out_of_budget_skips_every_step_and_exits_nonzero_with_a_summary(tmp_path):
    """Steps that cannot get 5 s of the budget are recorded as failed (exit 124), not silently left out."""
    proc, _, calls = _run_script(tmp_path, timeout=120, GPU_CHECK_ACCELERATOR="cpu", GPU_CHECK_BUDGET_S="1",
                                 GPU_CHECK_STEPS="parity,sanitizer")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["ok"] is False
    assert [(s["name"], s["rc"]) for s in summary["steps"]] == [("install", 124), ("parity", 124), ("sanitizer", 124)]
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "step parity: SKIPPED" in log and "gpu_check: FAILED" in log
    assert "-m pip" not in calls.read_text()


def test_script_installs_with_torch_pinned_and_falls_back_to_every_requirement_but_torch(tmp_path):
    """pip (faked) refuses ``-e .[test]``: the package goes in without dependencies, then every other
    requirement, all under the installed torch's pin."""
    proc, _, calls = _run_script(tmp_path, timeout=120, GPU_CHECK_ACCELERATOR="cpu", GPU_CHECK_STEPS="none",
                                 SPY_FAKE_PIP="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    pips = [line for line in calls.read_text().splitlines() if line.startswith("-m pip install")]
    assert len(pips) == 3, pips
    constraint = f"-c {out}/constraints.txt"
    assert constraint in pips[0] and pips[0].endswith("-e .[test]")
    assert "--no-deps -e ." in pips[1] and constraint not in pips[1]
    assert constraint in pips[2] and pips[2].endswith(f"-r {out}/requirements-without-torch.txt")
    assert (out / "constraints.txt").read_text().strip() == f"torch=={torch.__version__}"
    reqs = (out / "requirements-without-torch.txt").read_text().split()
    assert "torchmetrics>=1.0" in reqs and "pytest>=8" in reqs and not any(r.startswith("torch=") for r in reqs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True and [(s["name"], s["rc"]) for s in summary["steps"]] == [("install", 0)]


def _check_throughput(result: dict) -> None:
    def finite_pos(x):
        return isinstance(x, (int, float)) and math.isfinite(x) and x > 0

    assert result["ok"] is True and result["check"] == "throughput"
    assert result["devices"] == ["cpu", "cpu"] and result["physical_devices"] == 1
    assert finite_pos(result["model_flops_per_step"]) and finite_pos(result["peak_flops"]["measured_matmul"])
    assert result["peak_flops"]["datasheet"] is None  # no CPU entry
    plain, rp = result["plain"], result["roundpipe"]
    for run in (plain, rp):
        assert finite_pos(run["tokens_per_s"]) and finite_pos(run["median_step_s"])
        assert 0 < run["mfu"]["measured_matmul"] < 1 and run["mfu"]["datasheet"] is None
        assert math.isclose(run["tokens_per_s"] * run["median_step_s"], result["tokens_per_step"])
    assert len(plain["step_s"]) == 1 + 3 and len(rp["step_s"]) == 2 + 1 + 3  # warm-up/profiled + timed
    assert plain["peak_memory_gib"] is None and rp["peak_memory_gib_per_gpu"] is None  # no GPU
    assert finite_pos(rp["predicted_step_s"]) and finite_pos(rp["logged_step_s"])
    assert rp["predicted_vs_measured"] == pytest.approx((rp["predicted_step_s"] - rp["median_step_s"]) / rp["median_step_s"])
    assert rp["logged_step_s"] <= rp["median_step_s"] * 1.5  # the strategy's step inside the synchronized one
    assert finite_pos(rp["logged_tokens_per_s"]) and rp["logged_mfu_pct"] is None  # no peak known on the CPU
    assert set(rp["logged_peak_memory_gib_per_device"]) == {"0", "1"}
    assert all(finite_pos(v) for v in rp["logged_peak_memory_gib_per_device"].values())
    assert rp["weight_chunks"] > 0 and finite_pos(rp["weight_upload_s"])
    assert 0 <= rp["weight_upload_hidden_s"] <= rp["weight_upload_s"]
    assert 0.0 <= rp["hidden_upload_fraction"] <= 1.0
    assert rp["loads_overlapping_own_compute"] == 0
    assert finite_pos(result["ratio_roundpipe_over_plain"]) and finite_pos(result["wall_s"])


def test_python_steps_on_cpu_virtual_devices(tmp_path):
    """The parity, throughput and sanitizer steps, in this process, on 2 CPU virtual devices."""
    import gpu_check

    common = ["--accelerator", "cpu", "--tiny", "--devices", "2", "--device-memory-bytes", str(2**30),
              "--root-dir", str(tmp_path)]
    assert gpu_check.main(["parity", *common, "--json", str(tmp_path / "parity.json")]) == 0
    parity = json.loads((tmp_path / "parity.json").read_text())
    assert parity["ok"] is True and parity["model"]["layers"] == 4 and parity["parameters"] > 0
    assert len(parity["plain_losses"]) == len(parity["roundpipe_losses"]) == 3
    assert all(math.isfinite(x) and x > 0 for x in parity["plain_losses"] + parity["roundpipe_losses"])
    assert max(parity["loss_rel_diff"]) <= parity["loss_tol"] and parity["update_rel_error"] <= parity["update_tol"]
    assert parity["plain_losses"] != parity["plain_losses"][:1] * 3  # the weights moved

    assert gpu_check.main(["throughput", *common, "--json", str(tmp_path / "throughput.json")]) == 0
    _check_throughput(json.loads((tmp_path / "throughput.json").read_text()))

    assert gpu_check.main(["sanitizer", *common, "--json", str(tmp_path / "sanitizer.json")]) == 0
    sanitizer = json.loads((tmp_path / "sanitizer.json").read_text())
    assert sanitizer["ok"] is True and len(sanitizer["losses"]) == 2 and sanitizer["sanitized_threads"] is None


def test_parity_check_fails_outside_its_tolerance(tmp_path):
    import gpu_check

    args = ["parity", "--accelerator", "cpu", "--tiny", "--parity-steps", "2", "--update-tol", "0",
            "--root-dir", str(tmp_path), "--json", str(tmp_path / "parity.json")]
    assert gpu_check.main(args) == 1
    parity = json.loads((tmp_path / "parity.json").read_text())
    assert parity["ok"] is False and parity["update_rel_error"] > 0


def test_upload_overlap_from_intervals():
    from gpu_check import upload_overlap
    from lightning_roundpipe.metrics.timeline import Interval, Timeline

    w = lambda s, e, stage=1: Interval(0, "H2D", stage, None, s, e, nbytes=10, stream="weights")  # noqa: E731
    c = lambda s, e, stage=0: Interval(0, "F", stage, 0, s, e, stream="compute")  # noqa: E731
    got = upload_overlap([Timeline(1, [w(0.0, 2.0), w(1.0, 3.0), c(1.0, 1.5), c(1.25, 2.5), w(4.0, 5.0, stage=2),
                                       c(4.5, 6.0, stage=2)])])
    # uploads [0, 3] and [4, 5]; compute [1, 2.5] and [4.5, 6]: hidden [1, 2.5] and [4.5, 5]
    assert got["weight_upload_s"] == pytest.approx(4.0) and got["weight_upload_hidden_s"] == pytest.approx(2.0)
    assert got["hidden_upload_fraction"] == pytest.approx(0.5)
    assert got["loads_overlapping_own_compute"] == 1  # stage 2's chunk runs until 5.0, its compute starts at 4.5
    assert upload_overlap([Timeline(1, [c(0.0, 1.0)])])["hidden_upload_fraction"] is None


@pytest.mark.slow
def test_script_on_cpu_virtual_devices_keeps_going_past_a_failing_step(tmp_path):
    """The whole script in its CPU mode: parity made to fail (a negative tolerance), throughput still
    runs and passes; exit 1; summary.json has both steps' exit codes and results."""
    proc, _, calls = _run_script(tmp_path, timeout=400, GPU_CHECK_ACCELERATOR="cpu", GPU_CHECK_SKIP_INSTALL="1",
                                 GPU_CHECK_STEPS="parity,throughput", GPU_CHECK_ARGS="--loss-tol -1")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["name"], s["rc"]) for s in summary["steps"]] == [("parity", 1), ("throughput", 0)]
    assert summary["ok"] is False and summary["results"]["parity"]["ok"] is False
    _check_throughput(summary["results"]["throughput"])
    log = (out / "log.txt").read_text()
    assert "step parity: exit code 1" in log and "step throughput: exit code 0" in log
    assert "-m pip" not in calls.read_text()


# ------------------------------------------------------------------ several workers on one device
def test_parallel_devices_may_name_one_device_several_times():
    seen = []

    class Count(lightning_roundpipe.RoundPipeMetricsCallback):
        def on_train_batch_end(self, trainer, *args, **kwargs):
            seen.append([b.device_index for b in trainer.strategy.engine.backends])
            super().on_train_batch_end(trainer, *args, **kwargs)

    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default",
                                                     parallel_devices=[torch.device("cpu")] * 3)
    t = trainer(strategy, devices=1, max_steps=1, callbacks=[Count()])
    assert t.num_devices == 3
    t.fit(CausalLMModule(tiny_hf("llama")), loader(TokenData()))
    assert seen == [[0, 1, 2]]


def test_stage_memory_is_shared_by_the_logical_workers_of_one_gpu(monkeypatch):
    total = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda = torch.device
    assert stage_memory_bytes([cuda("cuda:0")], None) == total // 2
    assert stage_memory_bytes([cuda("cuda:0"), cuda("cuda:1")], None) == total // 2
    assert stage_memory_bytes([cuda("cuda:0")] * 4, None) == total // 8
    assert stage_memory_bytes([cuda("cuda:0"), cuda("cuda:1"), cuda("cuda:1")], None) == total // 4
    assert stage_memory_bytes([cuda("cuda"), cuda("cuda:0")], None) == total // 4  # "cuda" is the current GPU
    assert stage_memory_bytes([cuda("cuda:0")] * 4, 2**30) == 2**29  # a budget is one worker's memory
    assert stage_memory_bytes([cuda("cpu")] * 2, None) is None
