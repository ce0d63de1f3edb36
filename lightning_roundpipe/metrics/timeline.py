"""The timeline both consumers of a plan produce: the runtime (measured) and the simulator (modelled).

`metrics/` reads only this type, so bubble %, transfer rates, the timeline picture and the trace file
are computed the same way for a real step and a simulated one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

IntervalKind = Literal["F", "X", "R", "B", "W", "H2D", "D2H", "wait"]
COMPUTE_KINDS = frozenset({"F", "X", "R", "B", "W"})


@dataclass(frozen=True)
class Interval:
    """One busy span of one device.

    Attributes:
        device_index: the device.
        kind: ``F``/``X``/``R``/``B``/``W`` for compute (``R``: a backward stage's recompute),
            ``H2D`` for uploads (weights or activations), ``D2H`` for downloads (activations or
            gradients).
        stage_index: the stage the span belongs to (``-1`` if none).
        microbatch_index: the microbatch (``None`` for weight transfers).
        start_s: start, seconds since the timeline's origin.
        end_s: end, seconds since the timeline's origin (``>= start_s``).
        nbytes: bytes moved, for transfers (0 for compute).
        stream: the stream of the stream program the span ran on (``weights``, ``h2d``,
            ``compute``, ``d2h``), ``None`` if unknown.
        label: the op's string form (``"3F1"``, ``"0LOAD.c2"``), ``""`` if unknown.
    """

    device_index: int
    kind: str
    stage_index: int
    microbatch_index: int | None
    start_s: float
    end_s: float
    nbytes: int = 0
    stream: str | None = None
    label: str = ""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


@dataclass
class Timeline:
    """Busy intervals of ``num_devices`` devices over one step (or one simulated iteration).

    Attributes:
        num_devices: number of devices.
        intervals: the spans, any order.
        wall_s: the step's wall time, seconds; defaults to the last interval's end.
        peak_resident_bytes: per device, the most weight bytes resident at once (``None`` if
            not recorded).
        origin_s: measured timelines: the ``time.perf_counter()`` reading (seconds) of the
            timeline's origin, so the phases of one step can be put on one time axis
            (:func:`~lightning_roundpipe.metrics.trace.join_timelines`); ``None`` if unknown.
    """

    num_devices: int
    intervals: list[Interval] = field(default_factory=list)
    wall_s: float | None = None
    peak_resident_bytes: list[int] | None = None
    origin_s: float | None = None

    def span_s(self) -> float:
        """Wall time of the step, seconds."""
        if self.wall_s is not None:
            return self.wall_s
        return max((i.end_s for i in self.intervals), default=0.0)

    def compute_s(self, device_index: int) -> float:
        """Seconds ``device_index`` spent computing (F/X/R/B/W)."""
        return _union_length([(i.start_s, i.end_s) for i in self.intervals if i.device_index == device_index and i.is_compute])

    def idle_s(self, device_index: int) -> float:
        """Seconds ``device_index`` did not compute: ``span_s() - compute_s()``."""
        return max(0.0, self.span_s() - self.compute_s(device_index))

    def bubble_pct(self, device_index: int) -> float:
        """Idle share of the step on ``device_index``, percent (0..100)."""
        span = self.span_s()
        return 100.0 * self.idle_s(device_index) / span if span > 0 else 0.0

    def mean_bubble_pct(self) -> float:
        """Idle share over all devices, percent: total idle / (devices x wall time)."""
        if self.num_devices == 0:
            return 0.0
        return sum(self.bubble_pct(d) for d in range(self.num_devices)) / self.num_devices

    def transfer_bytes(self, device_index: int, kind: str) -> int:
        """Bytes moved by ``device_index`` in ``kind`` (``"H2D"`` or ``"D2H"``) spans."""
        return sum(i.nbytes for i in self.intervals if i.device_index == device_index and i.kind == kind)

    def transfer_s(self, device_index: int, kind: str) -> float:
        """Seconds ``device_index`` spent in ``kind`` transfers (union of spans)."""
        return _union_length([(i.start_s, i.end_s) for i in self.intervals if i.device_index == device_index and i.kind == kind])

    def shifted(self, offset_s: float) -> "Timeline":
        """A copy with every interval moved by ``offset_s`` seconds."""
        ivs = [dataclasses.replace(i, start_s=i.start_s + offset_s, end_s=i.end_s + offset_s) for i in self.intervals]
        return Timeline(self.num_devices, ivs, None if self.wall_s is None else self.wall_s,
                        None if self.peak_resident_bytes is None else list(self.peak_resident_bytes),
                        None if self.origin_s is None else self.origin_s - offset_s)


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(spans):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total
