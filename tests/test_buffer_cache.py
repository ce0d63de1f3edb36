"""CPU virtual devices reuse stage weight buffers as a GPU's caching allocator does, never one that
something still references.

Oracles: storage identity (``data_ptr``) and contents, Lightning's default strategy (parity after
buffers were reused across steps), and the debug poison (a reused buffer is poisoned like a new one).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_roundpipe
from lightning_roundpipe.runtime.backends import CpuBackend, make_backends
from lightning_roundpipe.runtime.backends.buffer_cache import BufferCache, storage_uses
from _helpers import CausalLMModule, TokenData, loader, max_diff, params, tiny_hf, trainer

pytestmark = pytest.mark.skipif(storage_uses(torch.empty(1)) is None,
                                reason="this torch has no storage use count: nothing is reused")


class Hits(L.Callback):
    """Per device, the weight buffers its LOADs took from the cache over the fit."""

    def on_train_end(self, trainer, pl_module) -> None:
        self.per_device = [b.buffers.hits for b in trainer.strategy.engine.executor.backends]


def _registered(cache: BufferCache, nbytes: int) -> torch.Tensor:
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    cache.register(buffer)
    return buffer


def test_a_buffer_is_not_handed_out_while_a_view_of_it_lives():
    cache = BufferCache()
    buffer = _registered(cache, 4096)
    address = buffer.data_ptr()
    view = buffer[128:256].view(torch.float32)  # as a replica's parameter would be
    cache.give(buffer)
    del buffer
    assert cache.take(4096) is None
    del view
    again = cache.take(4096)
    assert again is not None and again.data_ptr() == address
    assert (cache.hits, cache.misses) == (1, 1)


def test_only_a_buffer_of_the_same_size_is_reused_and_the_oldest_idle_one_is_freed_first():
    cache = BufferCache(max_idle=2)
    first, second, third = (_registered(cache, n) for n in (1024, 2048, 4096))
    addresses = [b.data_ptr() for b in (first, second, third)]
    for buffer in (first, second, third):
        cache.give(buffer)
    del first, second, third, buffer
    assert cache.idle_bytes == 2048 + 4096  # the 1 KiB buffer went first
    assert cache.take(1024) is None and cache.take(3000) is None
    assert cache.take(2048).data_ptr() == addresses[1]
    cache.clear()
    assert cache.idle_bytes == 0 and cache.take(4096) is None


def test_an_unregistered_buffer_is_never_kept():
    cache = BufferCache()
    cache.give(torch.empty(64, dtype=torch.uint8))
    assert cache.idle_bytes == 0


@pytest.mark.parametrize("max_idle", [-1, 1.5, True, "2"])
def test_bad_max_idle(max_idle):
    with pytest.raises(ValueError, match="max_idle"):
        BufferCache(max_idle=max_idle)


def test_a_reused_buffer_is_poisoned_under_delayed_copies():
    backend = CpuBackend(0, copy_delay_s=1e-3)
    try:
        buffer = backend.empty_bytes(256)
        address = buffer.data_ptr()
        buffer.zero_()
        backend.release_bytes(buffer)
        del buffer
        again = backend.empty_bytes(256)
        assert again.data_ptr() == address
        assert bool((again == 255).all())  # NaN in every float format, as a fresh buffer
    finally:
        backend.close()


def test_a_memory_budget_allocates_every_buffer_anew():
    """Under `device_memory_bytes` an idle buffer would count against the budget: none is kept."""
    (backend,) = make_backends([torch.device("cpu")], device_memory_bytes=2**20)
    try:
        buffer = backend.empty_bytes(4096)
        assert backend.memory.in_use_bytes == 4096
        backend.release_bytes(buffer)
        del buffer
        assert backend.memory.in_use_bytes == 0
        again = backend.empty_bytes(4096)
        assert backend.memory.in_use_bytes == 4096 and again.numel() == 4096
    finally:
        backend.close()


def test_training_reuses_the_weight_buffers_across_steps_and_keeps_parity():
    ref = CausalLMModule(tiny_hf("llama"))
    trainer(max_steps=3).fit(ref, loader(TokenData()))
    module = CausalLMModule(tiny_hf("llama"))
    hits = Hits()
    run = trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default"), devices=2,
                  max_steps=3, callbacks=[hits])
    run.fit(module, loader(TokenData()))
    assert max_diff(params(ref), params(module)) <= 1e-5
    assert len(hits.per_device) == 2 and all(h > 0 for h in hits.per_device)  # LOADs wrote into buffers a DROP freed

