"""fit / validate / test / predict through the strategy, and the per-device metrics it logs."""

import csv
import os

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger

import lightning_roundpipe
from _helpers import MLPModule, VectorData, loader, trainer


def test_validate_test_predict_match_default():
    module = MLPModule()
    data = loader(VectorData(n=21))
    ref_val = trainer().validate(module, data, verbose=False)[0]["val/loss"]
    ref_pred = torch.cat(trainer().predict(module, data))
    t = trainer("roundpipe", devices=3)
    val = t.validate(module, data, verbose=False)[0]["val/loss"]
    pred = torch.cat(t.predict(module, data))
    assert abs(val - ref_val) < 1e-6
    assert torch.allclose(pred, ref_pred, atol=1e-6)
    assert t.strategy.engine is None  # torn down after each run


def test_metrics_logged_with_units(tmp_path):
    module = MLPModule()
    logger = CSVLogger(tmp_path)
    t = trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=4), devices=3, max_steps=4, logger=logger,
                log_every_n_steps=1)
    t.fit(module, loader(VectorData()))
    rows = list(csv.DictReader(open(os.path.join(logger.log_dir, "metrics.csv"))))
    keys = set(rows[0])
    for d in range(3):
        for name in ("bubble(%)", "compute(s)", "idle(s)", "h2d(bytes)", "d2h(bytes)", "h2d(GiB/s)"):
            assert f"roundpipe/device{d}/{name}" in keys
    step_rows = [r for r in rows if r.get("roundpipe/device0/bubble(%)")]
    assert len(step_rows) == 4
    for r in step_rows:
        for d in range(3):
            assert 0.0 <= float(r[f"roundpipe/device{d}/bubble(%)"]) <= 100.0
            assert float(r[f"roundpipe/device{d}/compute(s)"]) > 0
        # every device uploads weights and the trainable stages send gradients back
        assert sum(float(r[f"roundpipe/device{d}/h2d(bytes)"]) for d in range(3)) > 0
        assert sum(float(r[f"roundpipe/device{d}/d2h(bytes)"]) for d in range(3)) > 0


def test_wandb_offline_logger(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="roundpipe-test", save_dir=str(tmp_path), offline=True)
    t = trainer("roundpipe", devices=2, max_steps=2, logger=logger, log_every_n_steps=1)
    t.fit(MLPModule(), loader(VectorData()))
    logged = logger.experiment.summary
    assert "roundpipe/device1/bubble(%)" in dict(logged)
    logger.experiment.finish()
