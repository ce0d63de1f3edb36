"""Measured layer profiles: per-layer forward, recompute and backward times from real steps.

The executor reports, per layer and microbatch, the forward seconds (``F`` actions), the recompute
seconds and the backward seconds (``B`` actions; a backward stage's backward time is split over its
layers in proportion to their recompute times, exact for one-layer backward stages). On CPU virtual
devices times are ``time.perf_counter`` spans; on CUDA the worker synchronises its compute stream
around each layer while profiling (profiling steps only).

Each step's per-layer means enter an exponential moving average; the first step is dropped (it
includes one-off allocation and warm-up costs). Source: DESIGN.md section 6, issue 3.

Devices of unequal speed (DESIGN.md section 12): after the warm-up step the profiler calls its
:attr:`LayerProfiler.speed_probe` once (the same workload timed on every device:
:func:`~lightning_roundpipe.runtime.tuning.mixed.measure_device_speeds`) and from then on records
each sample times its device's relative speed, so the profiles are times on a device of speed 1
(the fastest) wherever a layer ran, as the simulator expects.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable, Sequence

from lightning_roundpipe.partition.profile import LayerProfile


class LayerProfiler:
    """Collects per-layer timings during profiling steps.

    Args:
        num_layers: length of the layer sequence.
        momentum: weight of the newest step in the moving average (0 < momentum <= 1).
        skip_steps: leading steps left out of the average (1: the warm-up step).
    """

    def __init__(self, num_layers: int, momentum: float = 0.5, skip_steps: int = 1) -> None:
        if not 0 < momentum <= 1:
            raise ValueError(f"`momentum` must be in (0, 1], got {momentum}.")
        self.num_layers = num_layers
        self.momentum = momentum
        self.skip_steps = skip_steps
        self.steps_seen = 0
        self.enabled = True
        self._lock = threading.Lock()
        self._step: dict[str, dict[int, list[float]]] = {k: defaultdict(list) for k in ("forward", "recompute", "backward")}
        self._activation_bytes: dict[int, int] = {}
        self.avg: dict[str, list[float] | None] = {"forward": None, "recompute": None, "backward": None}
        self.device_speeds: Sequence[float] | None = None
        """Per device, its relative speed (the fastest 1.0): samples are scaled by it (``None``: equal devices)."""
        self.speed_probe: Callable[[], Sequence[float]] | None = None
        """Called once, after the warm-up step: returns the measured :attr:`device_speeds`."""

    def record(self, kind: str, layer_index: int, seconds: float, device_index: int | None = None) -> None:
        """Add one sample: ``kind`` in ``forward``/``recompute``/``backward``, seconds for one microbatch
        on device ``device_index`` (scaled to a device of speed 1 when :attr:`device_speeds` are known)."""
        speeds = self.device_speeds
        if speeds is not None and device_index is not None:
            seconds *= speeds[device_index]
        with self._lock:
            self._step[kind][layer_index].append(seconds)

    def record_activation(self, layer_index: int, nbytes: int) -> None:
        """Bytes of the input of ``layer_index`` for one microbatch (largest seen)."""
        with self._lock:
            self._activation_bytes[layer_index] = max(nbytes, self._activation_bytes.get(layer_index, 0))

    def end_step(self) -> None:
        """Fold this step's samples into the moving average (after the skipped warm-up steps)."""
        with self._lock:
            self.steps_seen += 1
            step, self._step = self._step, {k: defaultdict(list) for k in self._step}
            probe = self.speed_probe if self.steps_seen == self.skip_steps else None
        if probe is not None:  # after the warm-up step, before the first sample that counts
            self.device_speeds = list(probe())
        with self._lock:
            if self.steps_seen <= self.skip_steps:
                return
            for kind, per_layer in step.items():
                if len(per_layer) < self.num_layers and kind != "recompute":
                    continue
                means = [sum(v) / len(v) if v else 0.0 for v in (per_layer.get(i, []) for i in range(self.num_layers))]
                old = self.avg[kind]
                self.avg[kind] = means if old is None else [
                    (1 - self.momentum) * o + self.momentum * n for o, n in zip(old, means)]

    @property
    def ready(self) -> bool:
        """Whether forward and backward averages exist for every layer."""
        return self.avg["forward"] is not None and self.avg["backward"] is not None

    def profiles(self, param_bytes: list[int], grad_bytes: list[int] | None = None,
                 names: list[str] | None = None) -> list[LayerProfile]:
        """The measured :class:`LayerProfile` s, named by ``names`` (the layer sequence's ``layer_names``, as
        the stage table prints them; default ``layer<i>``).

        Raises:
            RuntimeError: before :attr:`ready`.
        """
        if not self.ready:
            raise RuntimeError("No measured profile yet: run at least `skip_steps + 1` training steps first.")
        fwd, bwd = self.avg["forward"], self.avg["backward"]
        return [
            LayerProfile(forward_s=fwd[i], backward_s=bwd[i], param_bytes=param_bytes[i],
                         activation_bytes=self._activation_bytes.get(i, 0),
                         trainable_param_bytes=None if grad_bytes is None else grad_bytes[i],
                         name=f"layer{i}" if names is None else names[i])
            for i in range(self.num_layers)
        ]
