"""Measurements taken with nothing in flight, and the CUDA driver's held tensors (issue 30, smaller items;
issue 31 item 6).

- The per-device speed probe and the link measurement time the devices: beside an overlapped run's
  kernels they time the run, and their ``synchronize`` meets a d2h thread appending copies. They run
  only after the engine's overlapped runs are drained (oracle: ``executor.in_flight`` and the overlap's
  pending calls are empty when they start).
- The probe is repeated while a device's spans spread more than the tolerance (oracle: the number of
  probes a scripted device answers with).
- On CPU virtual devices the configured ``cpu_device_speeds`` are the speeds: no probe.
- ``CudaBackend.synchronize`` drops only the held tensors whose copies completed (a fake event
  stream: the logic is the driver's own, CUDA is not needed to run it).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from types import SimpleNamespace

import lightning as L
import pytest
import torch

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, loader, tiny_hf, trainer
from lightning_roundpipe.runtime.tuning import autopartition, mixed


class _Engine(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.engine = trainer.strategy.engine


def _busy(engine) -> list[str]:
    """What the engine still has in flight (empty: nothing)."""
    return ([f"run {id(run)}" for run in engine.executor.in_flight]
            + [f"pending {id(p)}" for p in engine.overlap.pending])


@pytest.mark.parametrize("optimizer", ["sync", "async"])
def test_speed_probe_runs_with_nothing_in_flight(monkeypatch, optimizer):
    """Overlapped runs (accumulation 2 in sync, the async steady state): the probe is due after the
    warm-up step, whose run is still draining; it must start only once nothing is in flight."""
    watch, seen = _Engine(), []

    def probe(backends):
        seen.append(_busy(watch.engine))
        return [1.0] * len(backends)

    monkeypatch.setattr(mixed, "_may_differ", lambda engine: True)  # as on two distinct GPUs
    monkeypatch.setattr(mixed, "measure_device_speeds", probe)
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, profile_steps=2, optimizer=optimizer)
    accumulate = 2 if optimizer == "sync" else 1
    trainer(strategy, 2, max_steps=3, accumulate_grad_batches=accumulate, callbacks=[watch]).fit(
        CausalLMModule(tiny_hf("llama", layers=3)), loader(TokenData(n=56)))
    assert seen == [[]]


def test_link_measurement_drains_first(monkeypatch):
    """``hardware_model`` on CUDA measures the links once, after draining the engine (order checked)."""
    from lightning_roundpipe.runtime.backends import cuda

    order = []
    engine = SimpleNamespace(backends=[SimpleNamespace(is_cuda=True)], drain=lambda: order.append("drain"))
    monkeypatch.setattr(cuda, "measure_links", lambda backends: order.append("measure") or (2e10, 1e10))
    model = autopartition.hardware_model(engine)
    assert order == ["drain", "measure"] and (model.h2d_bytes_per_s, model.d2h_bytes_per_s) == (2e10, 1e10)
    autopartition.hardware_model(engine)
    assert order == ["drain", "measure"]  # cached: no second drain or measurement


class _ScriptedDevice:
    """A device for the probe whose spans last what the script says (one list of spans per probe)."""

    is_cuda = False
    device = torch.device("cpu")

    def __init__(self, script: list[list[float]]) -> None:
        self.script = [list(spans) for spans in script]
        self.probes = 0

    def stream_context(self, stream):
        return contextlib.nullcontext()

    def launch(self, stream, work, label=""):
        work()

    def synchronize(self):
        pass

    def mark(self):
        return None

    def _current(self):
        return self.script[min(self.probes, len(self.script) - 1)]

    def elapsed_s(self, start, end):
        spans = self._current()
        value = spans.pop(0)
        if not spans:
            self.probes += 1
        return value


def _script(*probes):
    return [list(spans) for spans in probes]


def test_probe_is_repeated_while_spans_spread():
    """Device 1's first probe spreads 50 % (something ran beside it): probed again; the second is
    tight, so two probes, and each device's shortest span over both counts."""
    spans = mixed._PROBE_SPANS
    fast = _ScriptedDevice(_script([1.0] * spans, [1.0] * spans))
    slow = _ScriptedDevice(_script([2.0] + [3.0] * (spans - 1), [2.0] * spans))
    speeds = mixed.measure_device_speeds([fast, slow])
    assert (fast.probes, slow.probes) == (2, 2)
    assert speeds == pytest.approx([1.0, 0.5])


def test_probe_stops_at_its_attempts():
    spans = mixed._PROBE_SPANS
    noisy = [[1.0] + [2.0] * (spans - 1)] * (mixed._PROBE_ATTEMPTS + 2)
    devices = [_ScriptedDevice(_script(*noisy)), _ScriptedDevice(_script(*noisy))]
    assert mixed.measure_device_speeds(devices) == pytest.approx([1.0, 1.0])
    assert [d.probes for d in devices] == [mixed._PROBE_ATTEMPTS] * 2


def test_configured_cpu_speeds_are_not_probed(monkeypatch):
    """CPU virtual devices with ``cpu_device_speeds``: no probe; the profiler scales samples by the
    configured speeds from the first step."""
    monkeypatch.setattr(mixed, "measure_device_speeds", lambda backends: pytest.fail("probed CPU virtual devices"))
    watch = _Engine()
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, profile_steps=2, cpu_device_speeds=[1.0, 0.5])
    trainer(strategy, 2, max_steps=3, callbacks=[watch]).fit(CausalLMModule(tiny_hf("llama", layers=3)),
                                                             loader(TokenData(n=21)))
    engine = watch.engine
    assert engine.device_speeds == (1.0, 0.5) and engine.device_speeds_source == "configured"
    assert engine.executor.profiler.device_speeds == [1.0, 0.5]
    assert not hasattr(engine, "measured_device_speeds")


# ---------------------------------------------------------------------------------------- CUDA driver
class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_cuda_synchronize_keeps_tensors_a_d2h_thread_holds_meanwhile(monkeypatch):
    """While the main thread waits in ``synchronize``, a d2h issuing thread holds the source of a copy
    it just enqueued (its event not complete). The sync must drop only the completed copies' sources:
    clearing everything frees a tensor a copy still reads."""
    from lightning_roundpipe.runtime.backends.cuda import CudaBackend

    backend = object.__new__(CudaBackend)  # the held-tensor logic only (no GPU)
    backend.device = torch.device("cuda", 0)
    backend._held, backend._held_lock = collections.deque(), threading.Lock()
    done_before = torch.zeros(4)
    backend._held.append((_Event(False), [done_before]))
    appended = torch.ones(4)

    def synchronize(device=None):
        backend._held[0][0].done = True  # what was enqueued before the sync completes...
        appender = threading.Thread(target=lambda: backend._held.append((_Event(False), [appended])))
        appender.start()  # ...and a d2h thread enqueues another copy meanwhile
        appender.join()

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    backend.synchronize()
    assert [tensors for _, tensors in backend._held] == [[appended]]
