"""The asynchronous steady state's weight snapshot refresh runs off the main thread (DESIGN.md section 4:
"The shadow refresh after an optimizer step runs off the main thread, per layer, in upload order, with
an event per layer"; issue 30, smaller items). Oracles: the thread each snapshot copy runs on (the
optimizer thread, ahead of the step that changes the masters), the copies' order (layer order, the
forward stages' upload order), and the one-step-stale reference of test_async_optimizer (parity)."""

from __future__ import annotations

import copy
import threading

import pytest

import lightning_roundpipe
from _helpers import loader, max_diff, params, trainer
from lightning_roundpipe.runtime.host.store import WeightStore
from test_async_optimizer import STEPS, TOL, Module, _case, reference


def test_snapshot_refresh_copies_run_on_the_optimizer_thread_in_layer_order(monkeypatch):
    copies: list[tuple[str, int]] = []
    stores: list[WeightStore] = []
    snapshots: list[str] = []
    original_copy = getattr(WeightStore, "copy_to_bank", None)
    original_snapshot = WeightStore.refresh_snapshot

    def copy_to_bank(self, key, bank):
        copies.append((threading.current_thread().name, key))
        stores.append(self)
        return original_copy(self, key, bank)

    def refresh_snapshot(self):
        snapshots.append(threading.current_thread().name)
        return original_snapshot(self)

    monkeypatch.setattr(WeightStore, "copy_to_bank", copy_to_bank, raising=False)
    monkeypatch.setattr(WeightStore, "refresh_snapshot", refresh_snapshot)
    model, data = _case("llama")
    batches = list(loader(data))
    module = Module(copy.deepcopy(model), "sgd", 0.05)
    strategy = lightning_roundpipe.RoundPipeStrategy(optimizer="async", num_microbatches=3, partition="default")
    t = trainer(strategy, 2, max_steps=STEPS)
    t.fit(module, loader(data))
    assert snapshots == []  # no whole-model copy in one call, on any thread
    assert copies and {name for name, _ in copies} == {"roundpipe-optimizer"}
    stale = reference(model, batches, "sgd", 0.05, STEPS)[-1][0]
    assert max_diff(params(module.model), stale) <= max(TOL, 1e-6)
    # each refresh copies the trainable tensors in layer order (the forward stages' upload order)
    per_refresh = len({key for _, key in copies})
    keys = [key for _, key in copies]
    assert len(keys) % per_refresh == 0 and len(keys) // per_refresh >= STEPS - 1
    first = keys[:per_refresh]
    assert keys == first * (len(keys) // per_refresh)
    store = stores[0]
    assert first == list(dict.fromkeys(key for entries in store.entries for _, key in entries if key in set(first)))


def test_a_skipped_refresh_releases_its_waiters():
    """After a job raised, the jobs behind it are skipped: a skipped refresh's ``on_skip`` still runs (the
    uploads waiting for its events must not hang), and the first job's error is raised by the wait."""
    from lightning_roundpipe.runtime.host.async_optimizer import BackgroundStepper

    stepper = BackgroundStepper(niceness=None)
    released, ran = threading.Event(), []
    try:
        stepper.submit(lambda: 1 / 0, "optimizer step 1")
        stepper.submit(lambda: ran.append(True), "weight snapshot refresh", on_skip=released.set)
        with pytest.raises(ZeroDivisionError):
            stepper.wait()
        assert released.is_set() and ran == []
    finally:
        stepper.close()
