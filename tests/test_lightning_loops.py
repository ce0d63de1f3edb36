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
        for name in ("bubble(%)", "compute(s)", "idle(s)", "h2d(bytes)", "d2h(bytes)", "h2d(GiB/s)", "peak_weights(bytes)"):
            assert f"roundpipe/device{d}/{name}" in keys
    step_rows = [r for r in rows if r.get("roundpipe/device0/bubble(%)")]
    assert len(step_rows) == 4
    for r in step_rows:
        for d in range(3):
            assert 0.0 <= float(r[f"roundpipe/device{d}/bubble(%)"]) <= 100.0
            assert float(r[f"roundpipe/device{d}/compute(s)"]) > 0
            assert float(r[f"roundpipe/device{d}/peak_weights(bytes)"]) > 0
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


class _Upstream(MLPModule):
    """A trainable module in front of the pipelined model: gradients must flow through the pipeline's input."""

    def __init__(self):
        super().__init__(scheduler=False)
        torch.manual_seed(3)
        self.pre = torch.nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(self.pre(x)), y)


@pytest.mark.parametrize("devices,num_microbatches", [(1, 1), (3, 4)])
def test_gradients_reach_modules_upstream(devices, num_microbatches):
    from _helpers import fit_params, max_diff

    ref = fit_params(_Upstream, VectorData(), max_steps=3)
    got = fit_params(_Upstream, VectorData(), devices=devices, max_steps=3,
                     strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=num_microbatches))
    assert max_diff(ref, got) <= 1e-5
    assert max_diff(got, fit_params(_Upstream, VectorData(), max_steps=0)) > 1e-3


def test_input_gradient_with_autograd_grad():
    from lightning_roundpipe.adapters import make_layer_sequence
    from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
    from _helpers import tiny_mlp

    model, ref = tiny_mlp(), tiny_mlp()
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * 2, num_microbatches=3)
    engine.install()
    try:
        x = torch.randn(5, 8, requires_grad=True)
        (g,) = torch.autograd.grad(model(x).pow(2).sum(), x)
        x2 = x.detach().clone().requires_grad_(True)
        (g_ref,) = torch.autograd.grad(ref(x2).pow(2).sum(), x2)
        assert torch.allclose(g, g_ref, atol=1e-6)
        with pytest.raises(RuntimeError, match="Double backward"):
            out = model(x).pow(2).sum()
            torch.autograd.grad(torch.autograd.grad(out, x, create_graph=True)[0].sum(), x)
    finally:
        engine.close()


def test_batchnorm_running_stats_are_written_back():
    class BN(MLPModule):
        def __init__(self):
            super().__init__(scheduler=False)
            self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                             torch.nn.Linear(16, 4))

    module = BN()
    trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=2), devices=2, max_steps=3).fit(module, loader(VectorData()))
    bn = module.model[1]
    # the whole batch is one microbatch while the BatchNorm is in train mode (tests/test_lightning_semantics.py):
    # once per step, never in recomputation
    assert int(bn.num_batches_tracked) == 3
    assert bn.running_mean.abs().sum() > 0


def test_scalar_output_of_sequential_is_an_error():
    class Mean(torch.nn.Module):
        def forward(self, x):
            return x.pow(2).mean()

    class Scalar(MLPModule):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(8, 4), Mean())

        def training_step(self, batch, batch_idx):
            return self.model(batch[0])

    with pytest.raises(ValueError, match="batch on dim 0"):
        trainer("roundpipe", devices=2, max_steps=1).fit(Scalar(), loader(VectorData()))
