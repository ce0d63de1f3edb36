"""One process of the data-parallel tests (tests/test_data_parallel.py), started 2x by the test with
``torchrun`` or with ``subprocess.Popen`` and Lightning's environment variables.

Usage: ``python _dp_worker.py MODE OUT_DIR [CKPT]``; MODE is ``train`` (tiny Llama and MLP, 3 steps,
accumulation 2, clipping; then the resume runs: MLP 2 steps saving a checkpoint, and ``CKPT``
resumed to 4 steps), ``raise`` (rank 1's worker raises in step 2), ``kill`` (rank 1 SIGKILLs itself
in step 2); the failing rank writes the time of its failure to ``OUT_DIR/failed_at``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "disabled")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import lightning_roundpipe  # noqa: E402
from _helpers import CausalLMModule, MLPModule, TokenData, VectorData, loader, params, tiny_hf, trainer  # noqa: E402

ROWS = 3  # per process and batch; the single-process oracle uses 2 * ROWS
CLIP = 0.05


#: the process group's timeout of the failure modes: longer than the test waits for the processes (300 s), so
#: a rank that stops in time was stopped by its peer's failure, never by the timeout (no wall-time assertion)
FAIL_TIMEOUT_S = 900


def strategy(timeout_s: float = 30, **kw) -> lightning_roundpipe.RoundPipeStrategy:
    return lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default",
                                                 data_parallel=lightning_roundpipe.DataParallel(timeout_s=timeout_s), **kw)


class Launched(L.Callback):
    """Buckets launched during the backward (overlapped), seen right after it, before the strategy's wait."""

    def __init__(self) -> None:
        self.launched: list[tuple[int, int]] = []

    def on_after_backward(self, trainer, pl_module) -> None:
        reducer = trainer.strategy.data_parallel_sync.reducer
        if reducer.sync:
            self.launched.append((reducer._next, reducer.num_buckets))


def info(t: L.Trainer) -> dict:
    sampler = t.train_dataloader.sampler if t.train_dataloader is not None else None
    return {"num_devices": t.num_devices, "world_size": t.world_size, "global_rank": t.global_rank,
            "node_rank": t.node_rank, "num_nodes": t.num_nodes, "env": type(t.strategy.cluster_environment).__name__,
            "sampler_replicas": sampler.num_replicas if isinstance(sampler, DistributedSampler) else None,
            "sampler_kwargs": t.strategy.distributed_sampler_kwargs,
            "metric_keys": sorted(k for k in t.strategy.step_metrics if k.startswith("roundpipe/")),
            "launched": next(c.launched for c in t.callbacks if isinstance(c, Launched))}


class TwiceMLP(MLPModule):
    """Calls the pipelined model twice per step (two pipelines feed one backward); the loss is the
    batch's summed cross entropy over its rows, so it splits between processes exactly."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        ce = nn.functional.cross_entropy
        return (ce(self.model(x[:1]), y[:1], reduction="sum") + ce(self.model(x[1:]), y[1:], reduction="sum")) / len(x)


def ordered(ds) -> DataLoader:
    """Rows ``rank, rank + 2, ...`` in order (Lightning's own ``DistributedSampler`` shuffles training data)."""
    sampler = DistributedSampler(ds, num_replicas=2, rank=int(os.environ["RANK"]), shuffle=False)
    return DataLoader(ds, batch_size=ROWS, sampler=sampler)


def train(out: Path, ckpt: str) -> None:
    report = {}
    models = {}
    for name, make, data, steps, accumulate in (
            ("llama", lambda: CausalLMModule(tiny_hf("llama", layers=3)), TokenData(n=12 * ROWS), 3, 2),
            ("llama_noacc", lambda: CausalLMModule(tiny_hf("llama", layers=3)), TokenData(n=12 * ROWS), 2, 1),
            ("mlp", MLPModule, VectorData(n=12 * ROWS), 3, 2),
            ("mlp_twice", lambda: TwiceMLP(scheduler=False), VectorData(n=12 * ROWS), 2, 1)):
        models[name] = make()
        t = trainer(strategy(), devices=2, num_nodes=2, max_steps=steps, accumulate_grad_batches=accumulate,
                    gradient_clip_val=CLIP, log_every_n_steps=1, callbacks=[Launched()])
        t.fit(models[name], ordered(data))
        report[name] = info(t)
    if t.global_rank == 0:
        torch.save({name: params(module) for name, module in models.items()}, out / "params.pt")
    (out / f"info{t.global_rank}.json").write_text(json.dumps(report))
    resume(out, ckpt)


def resume(out: Path, ckpt: str) -> None:
    def fit(max_steps: int, ckpt_path=None, save_dir=None):
        module = MLPModule(scheduler=False)
        callbacks = [ModelCheckpoint(dirpath=save_dir, save_last=True)] if save_dir else []
        t = trainer(strategy(), devices=2, num_nodes=2, max_steps=max_steps, gradient_clip_val=CLIP,
                    enable_checkpointing=bool(save_dir), callbacks=callbacks)
        # one global batch per epoch: Lightning's DistributedSampler (shuffling) splits it between the processes
        t.fit(module, loader(VectorData(n=2 * ROWS), ROWS), ckpt_path=ckpt_path)
        assert isinstance(t.train_dataloader.sampler, DistributedSampler) and t.train_dataloader.sampler.num_replicas == 2
        return t, module

    fit(2, save_dir=out / "ckpt2p")
    t, module = fit(4, ckpt_path=ckpt)
    if t.global_rank == 0:
        torch.save(params(module), out / "resumed2p.pt")


def failed_at() -> None:
    Path(sys.argv[2], "failed_at").write_text(repr(time.time()))


class FailOnRank(nn.Module):
    """Identity; raises on rank 1 from the second training call on."""

    calls = 0

    def forward(self, x):
        if torch.is_grad_enabled() and os.environ.get("NODE_RANK") == "1":
            FailOnRank.calls += 1
            if FailOnRank.calls >= 2:
                failed_at()
                raise RuntimeError("injected failure on rank 1")
        return x


class KillOnRank(L.Callback):
    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_rank == 1 and trainer.global_step >= 1:
            failed_at()
            os.kill(os.getpid(), signal.SIGKILL)


def fail(mode: str) -> None:
    module = MLPModule(scheduler=False)
    if mode == "raise":
        module.model.insert(2, FailOnRank())
    t = trainer(strategy(timeout_s=FAIL_TIMEOUT_S), devices=2, num_nodes=2, max_steps=20,
                callbacks=[KillOnRank()] if mode == "kill" else [])
    t.fit(module, loader(VectorData(n=20 * ROWS), ROWS))


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "train":
        train(out, sys.argv[3])
    else:
        fail(mode)
