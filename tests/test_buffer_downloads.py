"""Buffers downloaded at a training forward stage's ``DROP`` (issue 30, smaller items): only the persistent
ones (BatchNorm running statistics, what a checkpoint keeps). Non-persistent buffers (rotary
``inv_freq``: derived from the config, the device never changes them) used to be downloaded and written
back into the masters at every forward-stage ``DROP`` of every step. Oracle: the D2H bytes of the
write-backs per step (0 for a Llama; the BatchNorm's persistent buffers for an MLP with one), and
the default strategy's state after fit."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

import lightning_roundpipe
from _helpers import CausalLMModule, MLPModule, TokenData, VectorData, loader, max_diff, tiny_hf, trainer
from lightning_roundpipe.runtime.execution.transfers import TransferOps


class _Downloads(L.Callback):
    """Bytes handed to the buffers' write-back download per training batch."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self.current = 0
        self.engine = None

    def add(self, nbytes: int) -> None:
        self.current += nbytes

    def on_train_batch_start(self, trainer, *args) -> None:
        self.engine = trainer.strategy.engine
        self.current = 0

    def on_train_batch_end(self, trainer, *args) -> None:
        self.per_step.append(self.current)


@pytest.fixture
def downloads(monkeypatch):
    watch = _Downloads()
    original = TransferOps._write_back

    def write_back(self, backend, op, run, pairs, publish):
        watch.add(sum(view.numel() * view.element_size() for _, view in pairs))
        return original(self, backend, op, run, pairs, publish)

    monkeypatch.setattr(TransferOps, "_write_back", write_back)
    return watch


def test_rotary_inv_freq_is_not_downloaded(downloads):
    """A Llama's layers hold the rotary ``inv_freq`` (non-persistent): no write-back download at all."""
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default")
    trainer(strategy, 2, max_steps=3, callbacks=[downloads]).fit(CausalLMModule(tiny_hf("llama", layers=3)),
                                                                 loader(TokenData(n=21)))
    assert downloads.per_step == [0, 0, 0]
    store = downloads.engine.store
    derived = [entry for entry in store.tensors.values() if not entry.is_param and not entry.persistent]
    assert derived and all(entry.master.is_floating_point() for entry in derived)  # inv_freq and its original


class _BatchNorm(MLPModule):
    def __init__(self) -> None:
        super().__init__(scheduler=False)
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
        self.model[0].register_buffer("derived", torch.arange(8.0), persistent=False)


def test_batchnorm_statistics_are_downloaded_and_match_the_default_strategy(downloads):
    """The persistent BatchNorm buffers (running mean and variance: 16 fp32 each, the batch count: one
    int64) are downloaded at each training forward DROP of their stage, the non-persistent one next to
    them never; the statistics equal the default strategy's."""
    states = {}
    for name, strategy, callbacks in (("auto", "auto", []), ("roundpipe", lightning_roundpipe.RoundPipeStrategy(
            num_microbatches=3, partition="default"), [downloads])):
        module = _BatchNorm()
        trainer(strategy, 2 if name == "roundpipe" else 1, max_steps=3, callbacks=callbacks).fit(
            module, loader(VectorData(n=21)))
        states[name] = {k: v.float() for k, v in module.model.state_dict().items()}
    statistics = 16 * 4 * 2 + 8
    assert len(downloads.per_step) == 3 and all(b > 0 and b % statistics == 0 for b in downloads.per_step)
    assert max_diff(states["roundpipe"], states["auto"]) <= 1e-5
