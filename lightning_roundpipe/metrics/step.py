"""Per-device step metrics from the phase timelines of one training step (DESIGN.md section 7).

Keys carry their unit: ``roundpipe/device0/bubble(%)``, ``roundpipe/device0/compute(s)``,
``roundpipe/device0/h2d(bytes)``, ``roundpipe/device0/h2d(GiB/s)``...
"""

from __future__ import annotations

from typing import Any, Sequence

from lightning_roundpipe.metrics.timeline import Timeline

GIB = float(2**30)


def boundary_hop_bytes(timelines: Sequence[Timeline], programs: Sequence[Any]) -> list[int]:
    """Bytes of each stage-boundary carry the devices uploaded: one entry per hop and microbatch.

    A hop is the ``H2D`` of a compute op's input whose stage does not start at layer 0 (layer 0's
    input is the microbatch itself): the carry a stage sent device -> host, or the one the host
    saved for a backward stage's recomputation, copied host -> device. Its bytes are what the
    runtime copied (every tensor of the carry).

    Args:
        timelines: measured timelines (their intervals' ``label`` is the op, ``"3H2D1"``).
        programs: the stream program of each timeline, in the same order (their ``plan.stages[i].layers``).
    """
    from lightning_roundpipe.schedule.program import Op, OpKind

    out = []
    for timeline, program in zip(timelines, programs):
        stages = program.plan.stages
        for interval in timeline.intervals:
            if interval.kind != "H2D" or interval.stream != "h2d" or not interval.label:
                continue
            op = Op.parse(interval.label)
            if op.kind is OpKind.H2D and stages[op.stage_index].layers.start > 0:
                out.append(interval.nbytes)
    return out


def step_metrics(timelines: Sequence[Timeline], prefix: str = "roundpipe", *, step_s: float | None = None,
                 optimizer_s: float | None = None, predicted_step_s: float | None = None,
                 host_memory_bytes: int | None = None, programs: Sequence[Any] | None = None) -> dict[str, float]:
    """Metrics of one training step made of ``timelines`` (its programs, run one after another).

    Per device ``d``: ``compute(s)``, ``idle(s)`` (step wall time minus compute), ``bubble(%)``
    (idle / step wall time, the step including the optimizer), ``h2d(bytes)``, ``d2h(bytes)``,
    ``h2d_weights(bytes)`` (the part of ``h2d(bytes)`` that is weight chunks: ``LOAD`` s on the
    ``weights`` stream; also summed over devices as ``h2d_weights(bytes)``),
    ``h2d(GiB/s)`` and ``d2h(GiB/s)`` (bytes / seconds spent in those transfers; 0 when nothing
    moved), ``peak_weights(bytes)`` (most weight bytes resident at once, when recorded). Step-wide:
    ``step(s)`` (``step_s`` when given: the whole step, phases, the gaps between them and the
    optimizer; else the programs' wall times summed), ``pipeline(s)`` (the programs' wall times),
    ``optimizer(s)`` and ``predicted_step(s)`` when given, ``host_memory(GiB)`` (``host_memory_bytes``
    when given: the model's host bytes, masters, shadows, gradients and optimizer state),
    ``boundary_bytes_per_microbatch(bytes)`` (with the timelines' ``programs``: the mean bytes of
    one stage-boundary carry of one microbatch, :func:`boundary_hop_bytes`; what each hop moves
    device -> host -> device and what the host saves there) and ``bubble(%)`` (mean over devices).

    Returns:
        ``{}`` when ``timelines`` is empty.
    """
    if not timelines:
        return {}
    n = max(t.num_devices for t in timelines)
    pipeline = sum(t.span_s() for t in timelines)
    wall = step_s if step_s is not None and step_s > 0 else pipeline
    out: dict[str, float] = {f"{prefix}/step(s)": wall, f"{prefix}/pipeline(s)": pipeline}
    if optimizer_s is not None:
        out[f"{prefix}/optimizer(s)"] = optimizer_s
    if predicted_step_s is not None:
        out[f"{prefix}/predicted_step(s)"] = predicted_step_s
    if host_memory_bytes is not None:
        out[f"{prefix}/host_memory(GiB)"] = host_memory_bytes / GIB
    hops = boundary_hop_bytes(timelines, programs) if programs is not None else []
    if hops:
        out[f"{prefix}/boundary_bytes_per_microbatch(bytes)"] = sum(hops) / len(hops)
    bubbles = []
    weight_bytes = 0
    for d in range(n):
        compute = sum(t.compute_s(d) for t in timelines)
        idle = max(0.0, wall - compute)
        bubble = 100.0 * idle / wall if wall > 0 else 0.0
        bubbles.append(bubble)
        key = f"{prefix}/device{d}"
        out[f"{key}/compute(s)"] = compute
        out[f"{key}/idle(s)"] = idle
        out[f"{key}/bubble(%)"] = bubble
        for kind in ("H2D", "D2H"):
            nbytes = sum(t.transfer_bytes(d, kind) for t in timelines)
            secs = sum(t.transfer_s(d, kind) for t in timelines)
            out[f"{key}/{kind.lower()}(bytes)"] = float(nbytes)
            out[f"{key}/{kind.lower()}(GiB/s)"] = nbytes / GIB / secs if secs > 0 else 0.0
        weights = sum(i.nbytes for t in timelines for i in t.intervals
                      if i.device_index == d and i.kind == "H2D" and i.stream == "weights")
        out[f"{key}/h2d_weights(bytes)"] = float(weights)
        weight_bytes += weights
        peaks = [t.peak_resident_bytes[d] for t in timelines if t.peak_resident_bytes is not None]
        if peaks:
            out[f"{key}/peak_weights(bytes)"] = float(max(peaks))
    out[f"{prefix}/bubble(%)"] = sum(bubbles) / n
    out[f"{prefix}/h2d_weights(bytes)"] = float(weight_bytes)
    return out
