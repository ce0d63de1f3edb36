"""Chrome / Perfetto trace files of a :class:`~lightning_roundpipe.metrics.Timeline` (DESIGN.md section 7).

The JSON object format of the Trace Event Format (the one ``chrome://tracing`` and
``ui.perfetto.dev`` open): ``{"traceEvents": [...], "displayTimeUnit": "ms"}``, timestamps and
durations in microseconds.

- one **process** row per device (``pid`` = device index, ``M`` events ``process_name`` and
  ``process_sort_index``), and one for the host (``pid`` = number of devices) when host spans are
  given;
- one **thread** row per stream of the stream program (``weights``, ``h2d``, ``compute``, ``d2h``:
  ``tid`` 0..3, ``M`` events ``thread_name`` and ``thread_sort_index``); the host's rows are
  ``main`` (the main thread: the pipeline phases it waits for) and ``optimizer``;
- one complete **span** (``ph: "X"``) per interval, named by the op's string form (``"3F1"``: stage
  3, forward, microbatch 1; ``"0LOAD.c2"``: chunk 2 of stage 0's weights), ``cat`` = the interval's
  kind (``F``/``X``/``R``/``B``/``W``/``H2D``/``D2H``), ``args`` = stage, microbatch and bytes;
- **counters** (``ph: "C"``) per device: ``resident weights`` (bytes of stage weights on the device:
  a stage's uploaded bytes count from its first chunk's start until the last op of that stage on
  the device ends, where the stream program drops it) and ``link`` (``h2d(GiB/s)`` and
  ``d2h(GiB/s)``: the bytes/s of the transfers running at each instant, summed).

Spans in one thread row never overlap: an interval that starts before the previous one of its row
ended (only possible when a timeline holds concurrent spans of one stream) goes to an extra row
``<stream> #2``. Pure Python (``json``): no torch, no Lightning.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from lightning_roundpipe.metrics.timeline import Interval, Timeline

__all__ = ["HOST_THREADS", "STREAM_ROWS", "HostSpan", "join_timelines", "trace_events", "write_trace"]

#: Thread rows of a device process, by ``tid``.
STREAM_ROWS: tuple[str, ...] = ("weights", "h2d", "compute", "d2h")
#: Thread rows of the host process, by ``tid``.
HOST_THREADS: tuple[str, ...] = ("main", "optimizer")
_GIB = float(2**30)
_US = 1e6


@dataclass(frozen=True)
class HostSpan:
    """A span of host work beside the devices' timelines.

    Attributes:
        thread: ``"main"`` (the main thread, e.g. waiting for a pipeline phase) or ``"optimizer"``.
        name: what it did (``"forward phase"``, ``"optimizer step"``).
        start_s: start, seconds since the timeline's origin.
        end_s: end, seconds since the timeline's origin (``>= start_s``).
    """

    thread: str
    name: str
    start_s: float
    end_s: float


def join_timelines(timelines: Sequence[Timeline], offsets_s: Sequence[float] | None = None,
                   wall_s: float | None = None) -> Timeline:
    """One timeline made of ``timelines`` (e.g. one step's forward and backward phases).

    Args:
        timelines: the parts; their devices are the same devices.
        offsets_s: where each part's origin lies on the joined time axis, seconds; default: the
            parts back to back (each starts where the previous one's ``span_s()`` ends).
        wall_s: the joined timeline's wall time, seconds; default: the last part's end.

    Returns:
        A :class:`Timeline` with every part's intervals shifted by its offset and, per device, the
        largest ``peak_resident_bytes`` of the parts (``None`` when no part recorded it).

    Raises:
        ValueError: ``offsets_s`` of another length than ``timelines``.
    """
    if offsets_s is None:
        offsets, at = [], 0.0
        for tl in timelines:
            offsets.append(at)
            at += tl.span_s()
    else:
        offsets = list(offsets_s)
        if len(offsets) != len(timelines):
            raise ValueError(f"`offsets_s` has {len(offsets)} entries for {len(timelines)} timelines.")
    num_devices = max((tl.num_devices for tl in timelines), default=0)
    intervals: list[Interval] = []
    peaks: list[int] | None = None
    end = 0.0
    for tl, offset in zip(timelines, offsets):
        intervals.extend(tl.shifted(offset).intervals)
        end = max(end, offset + tl.span_s())
        if tl.peak_resident_bytes is not None:
            peaks = peaks or [0] * num_devices
            for d, nbytes in enumerate(tl.peak_resident_bytes):
                peaks[d] = max(peaks[d], nbytes)
    return Timeline(num_devices, intervals, wall_s=end if wall_s is None else wall_s, peak_resident_bytes=peaks)


def _us(seconds: float) -> float:
    return round(seconds * _US, 3)


def _dur(start_s: float, end_s: float) -> float:
    """Duration in µs such that ``ts + dur`` is the end's rounded timestamp (no overlap from rounding)."""
    return max(0.0, round(_us(end_s) - _us(start_s), 3))


def _stream_of(interval: Interval) -> str:
    if interval.stream in STREAM_ROWS:
        return interval.stream
    if interval.is_compute:
        return "compute"
    return "d2h" if interval.kind == "D2H" else "h2d"


def _stage_key(interval: Interval) -> tuple[int, str]:
    """(stage, round) of a per-stage op's label (``"0LOAD.c2@1"`` -> (0, "1")); compute ops carry no round."""
    return interval.stage_index, interval.label.partition("@")[2] if "@" in interval.label else ""


def _resident_counter(intervals: list[Interval]) -> list[tuple[float, int]]:
    """(time s, resident weight bytes) steps of one device, derived from its ``LOAD`` spans (see module doc)."""
    loads: dict[tuple[int, str], list[Interval]] = defaultdict(list)
    for iv in intervals:
        if "LOAD" in iv.label:
            loads[_stage_key(iv)].append(iv)
    starts: dict[int, list[float]] = defaultdict(list)  # per stage, the starts of its residencies
    for (stage, _), chunks in loads.items():
        starts[stage].append(min(c.start_s for c in chunks))
    changes: list[tuple[float, int]] = []
    for (stage, _), chunks in loads.items():
        start = min(c.start_s for c in chunks)
        # released after the stage's last op on this device before its next upload there
        limit = min((s for s in starts[stage] if s > start), default=math.inf)
        release = max((iv.end_s for iv in intervals if iv.stage_index == stage and start <= iv.start_s < limit),
                      default=start)
        nbytes = sum(c.nbytes for c in chunks)
        changes += [(start, nbytes), (release, -nbytes)]
    out: list[tuple[float, int]] = []
    level = 0
    for t, delta in sorted(changes, key=lambda c: (c[0], c[1] > 0)):  # releases before uploads at one instant
        level += delta
        if out and out[-1][0] == t:
            out[-1] = (t, level)
        else:
            out.append((t, level))
    return out


def _rate_counter(intervals: list[Interval], kind: str) -> list[tuple[float, float]]:
    """(time s, GiB/s) steps: the summed rates of the ``kind`` transfers running at each instant."""
    changes = []
    for iv in intervals:
        if iv.kind == kind and iv.nbytes > 0 and iv.end_s > iv.start_s:
            rate = iv.nbytes / (iv.end_s - iv.start_s) / _GIB
            changes += [(iv.start_s, rate), (iv.end_s, -rate)]
    out: list[tuple[float, float]] = []
    level = 0.0
    for t, delta in sorted(changes):
        level += delta
        value = max(0.0, level) if abs(level) > 1e-9 else 0.0
        if out and out[-1][0] == t:
            out[-1] = (t, value)
        else:
            out.append((t, value))
    return out


def _rows(spans: Iterable[tuple[float, float, Any]]) -> list[list[tuple[float, float, Any]]]:
    """Greedy lanes: spans sorted by start, each in the first lane whose last span has ended."""
    lanes: list[list[tuple[float, float, Any]]] = []
    for span in sorted(spans, key=lambda s: (s[0], s[1])):
        for lane in lanes:
            if lane[-1][1] <= span[0]:
                lane.append(span)
                break
        else:
            lanes.append([span])
    return lanes


def _meta(name: str, pid: int, tid: int, value: Any) -> dict[str, Any]:
    """A metadata event: ``process_name``/``thread_name`` (``value``: the label) or ``*_sort_index``."""
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {key: value}}


def trace_events(timeline: Timeline, *, host_spans: Sequence[HostSpan] = (), device_names: Sequence[str] | None = None,
                 title: str | None = None, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The trace of ``timeline`` as a Trace Event Format object (see the module docstring).

    Args:
        timeline: intervals in seconds from its origin (measured or simulated).
        host_spans: main-thread and optimizer spans on the same time axis.
        device_names: a label per device (``"cuda:0"``); default ``"device <d>"``.
        title: prefixed to every process name (``"simulated"``).
        metadata: JSON-serialisable values stored under the object's ``"otherData"`` key (the
            format's field for free-form data; ``chrome://tracing`` shows it, Perfetto ignores it).

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``; every event has
        ``name``, ``ph``, ``ts`` (µs), ``pid`` and ``tid``; ``X`` events also ``dur`` (µs).

    Raises:
        ValueError: a host span on a thread other than ``"main"``/``"optimizer"``, or a
            ``device_names`` of another length than the timeline's devices.
        TypeError: ``timeline`` is not a :class:`Timeline`.
    """
    if not isinstance(timeline, Timeline):
        raise TypeError(f"`timeline` is a {type(timeline).__name__}, expected lightning_roundpipe.metrics.Timeline.")
    if device_names is not None and len(device_names) != timeline.num_devices:
        raise ValueError(f"`device_names` has {len(device_names)} names for {timeline.num_devices} devices.")
    for span in host_spans:
        if span.thread not in HOST_THREADS:
            raise ValueError(f"Host span {span.name!r} is on thread {span.thread!r}; expected one of {list(HOST_THREADS)}.")
    head = f"{title}: " if title else ""
    events: list[dict[str, Any]] = []
    per_device: dict[int, list[Interval]] = defaultdict(list)
    for iv in timeline.intervals:
        per_device[iv.device_index].append(iv)
    for device in range(timeline.num_devices):
        name = device_names[device] if device_names is not None else f"device {device}"
        events += [_meta("process_name", device, 0, f"{head}{name}"), _meta("process_sort_index", device, 0, device)]
        by_stream: dict[str, list[Interval]] = defaultdict(list)
        for iv in per_device[device]:
            by_stream[_stream_of(iv)].append(iv)
        tid_base = len(STREAM_ROWS)
        for stream_index, stream in enumerate(STREAM_ROWS):
            lanes = _rows((iv.start_s, iv.end_s, iv) for iv in by_stream.get(stream, ()))
            for lane_index, lane in enumerate(lanes or [[]]):
                tid = stream_index if lane_index == 0 else tid_base
                if lane_index:
                    tid_base += 1
                label = stream if lane_index == 0 else f"{stream} #{lane_index + 1}"
                events += [_meta("thread_name", device, tid, label), _meta("thread_sort_index", device, tid, tid)]
                for start, end, iv in lane:
                    args: dict[str, Any] = {"stage": iv.stage_index}
                    if iv.microbatch_index is not None:
                        args["microbatch"] = iv.microbatch_index
                    if iv.nbytes:
                        args["bytes"] = iv.nbytes
                    events.append({"name": iv.label or f"{iv.stage_index}{iv.kind}{iv.microbatch_index or ''}",
                                   "cat": iv.kind, "ph": "X", "ts": _us(start), "dur": _dur(start, end),
                                   "pid": device, "tid": tid, "args": args})
        counter_tid = 0
        for t, nbytes in _resident_counter(per_device[device]):
            events.append({"name": "resident weights", "ph": "C", "ts": _us(t), "pid": device, "tid": counter_tid,
                           "args": {"bytes": nbytes}})
        link: dict[float, dict[str, float]] = defaultdict(dict)
        for kind in ("H2D", "D2H"):
            for t, rate in _rate_counter(per_device[device], kind):
                link[t][f"{kind.lower()}(GiB/s)"] = rate
        level = {"h2d(GiB/s)": 0.0, "d2h(GiB/s)": 0.0}
        for t in sorted(link):
            level.update(link[t])
            events.append({"name": "link", "ph": "C", "ts": _us(t), "pid": device, "tid": counter_tid, "args": dict(level)})
    if host_spans:
        host = timeline.num_devices
        events += [_meta("process_name", host, 0, f"{head}host"), _meta("process_sort_index", host, 0, host)]
        for tid, thread in enumerate(HOST_THREADS):
            events += [_meta("thread_name", host, tid, thread), _meta("thread_sort_index", host, tid, tid)]
            lanes = _rows((s.start_s, s.end_s, s) for s in host_spans if s.thread == thread)
            for lane_index, lane in enumerate(lanes):
                lane_tid = tid if lane_index == 0 else len(HOST_THREADS) + tid * 8 + lane_index
                if lane_index:
                    events += [_meta("thread_name", host, lane_tid, f"{thread} #{lane_index + 1}")]
                for start, end, span in lane:
                    events.append({"name": span.name, "cat": thread, "ph": "X", "ts": _us(start),
                                   "dur": _dur(start, end), "pid": host, "tid": lane_tid, "args": {}})
    out: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if metadata:
        out["otherData"] = dict(metadata)
    return out


def write_trace(timeline: Timeline, path: str | Path, **kwargs: Any) -> Path:
    """Write :func:`trace_events` of ``timeline`` as JSON to ``path`` (parent folders created).

    Args:
        timeline: see :func:`trace_events`.
        path: output file, conventionally ``*.json`` (``*.trace.json`` opens in Perfetto by drag and drop).
        **kwargs: ``host_spans``, ``device_names``, ``title``, ``metadata`` of :func:`trace_events`.

    Returns:
        The written path.

    Raises:
        As :func:`trace_events`; ``OSError`` when the file cannot be written.
    """
    doc = trace_events(timeline, **kwargs)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, separators=(",", ":")))
    return out
