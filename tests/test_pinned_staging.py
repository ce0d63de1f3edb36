"""Pinned host staging across steps (issue 30, smaller items).

- ``.grad`` must not view a host staging block: Lightning's ``zero_grad`` (``set_to_none``) runs after
  ``training_step``, so the next step's gradient download would find the block still referenced and
  pin a second one, every step (up to 4x the fp32 trainable bytes pinned in full fine-tuning). Oracle:
  the staging allocations (each one a pinning call on CUDA, counted on CPU virtual devices where
  pinning is a no-op) stop after the first step, and no ``.grad`` shares a staging block's storage.
- One registration per block, unregistered only by :func:`pinned.collect` (the main thread, at known
  points), never by a finalizer on the thread that happened to drop the last reference (CUDA's
  ``cudaHostRegister``/``cudaHostUnregister`` faked: the registry's logic is what is tested).
"""

from __future__ import annotations

import threading

import lightning as L
import pytest
import torch

import lightning_roundpipe
from _helpers import CausalLMModule, MLPModule, TokenData, VectorData, loader, tiny_hf, trainer
from lightning_roundpipe.runtime.host import pinned


class _Staging(L.Callback):
    """After each training batch: the host staging allocations so far, and whether a ``.grad`` views a
    staging block."""

    def __init__(self) -> None:
        self.allocations: list[int] = []
        self.aliased: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        executor = trainer.strategy.engine.executor
        self.allocations.append(sum(pool.allocations for pool in executor._host_pools))
        blocks = {block.untyped_storage().data_ptr() for pool in executor._host_pools
                  for chain in pool._keyed.values() for block, _ in chain}
        self.aliased.append(sum(p.grad is not None and p.grad.untyped_storage().data_ptr() in blocks
                                for p in pl_module.parameters()))


@pytest.mark.parametrize("kind", ["fused", "mlp"])
def test_grads_do_not_hold_staging_blocks_across_zero_grad(kind):
    """Full fine-tuning, 2 devices, 4 steps, Lightning's automatic optimization (``zero_grad`` after
    ``training_step``): the fused path (gradient buffers handed to ``.grad`` by the loss's backward)
    and the plain one (gradients added into ``.grad`` by the host thread)."""
    watch = _Staging()
    if kind == "fused":
        module, data = CausalLMModule(tiny_hf("llama", layers=3)), loader(TokenData(n=28))
    else:
        module, data = MLPModule(scheduler=False), loader(VectorData(n=28))
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default")
    trainer(strategy, 2, max_steps=4, callbacks=[watch]).fit(module, data)
    assert watch.aliased == [0, 0, 0, 0]
    assert watch.allocations == watch.allocations[:1] * 4, watch.allocations  # none after the first step


class _FakeCudart:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []

    def cudaHostRegister(self, start, size, flags):
        self.calls.append(("register", start, threading.current_thread().name))
        return 0

    def cudaHostUnregister(self, start):
        self.calls.append(("unregister", start, threading.current_thread().name))
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    assert pinned.pinned_stats() == (0, 0)  # no CUDA here: nothing registered before
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    yield cudart
    monkeypatch.undo()
    pinned.collect()
    assert pinned.pinned_stats() == (0, 0)


def test_blocks_are_unregistered_only_by_collect_on_its_thread(fake_cuda):
    page = pinned._PAGE
    kept, dropped = pinned.pinned_bytes(3 * page + 1), pinned.pinned_bytes(100)
    assert pinned.pinned_stats() == (2, 4 * page + page)
    assert pinned.is_pinned(kept) and pinned.is_pinned(dropped[10:])
    holder = [dropped]
    del dropped
    other = threading.Thread(target=holder.clear, name="d2h-issuer")  # the last reference dies on another thread
    other.start()
    other.join()
    assert [call[0] for call in fake_cuda.calls] == ["register", "register"]  # not unregistered there
    assert pinned.collect() == page  # the 100-byte block, one page
    unregisters = [call for call in fake_cuda.calls if call[0] == "unregister"]
    assert [call[2] for call in unregisters] == [threading.current_thread().name]
    assert pinned.pinned_stats() == (1, 4 * page) and pinned.is_pinned(kept)
    view = kept[page:]
    del kept
    assert pinned.collect() == 0 and pinned.pinned_stats() == (1, 4 * page)  # a view still uses it
    del view
    assert pinned.collect() == 4 * page and pinned.pinned_stats() == (0, 0)
    assert sum(call[0] == "register" for call in fake_cuda.calls) == 2 == len(
        [call for call in fake_cuda.calls if call[0] == "unregister"])
