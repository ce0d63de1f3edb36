"""`roundpipe plan`'s frozen weights (issue 33 item 3): the host memory and weight uploads of the plan, and with
``--lora --frozen-weights`` the formats bf16, fp8 and nf4 side by side, each re-planned by the same
partitioner, memory model and simulator (:func:`compare_formats`). Formatting and re-planning only; the
bytes come from :mod:`lightning_roundpipe.partition.frozen` through the cost model.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

from lightning_roundpipe.partition.frozen import COMPARED_FORMATS

GB = 1e9


@dataclasses.dataclass(frozen=True)
class FormatRow:
    """One frozen weight format's plan, re-planned for it (``None`` fields: no partition fits at all).

    Attributes:
        name: the format (``bf16``, ``fp8``, ``nf4``).
        host_bytes: host bytes of the weights and training state (frozen + trainable), bytes.
        frozen_bytes: of it, the frozen parameters', bytes.
        converted_params: frozen parameters held in the format (0 for bf16), elements.
        converted_bytes_per_param: their host bytes per parameter (the compute dtype's for bf16).
        weight_h2d_bytes: weight bytes one step uploads, all devices, bytes.
        peak_device_bytes: the memory model's peak on any device, bytes.
        step_s: predicted step, seconds (the report's optimizer mode); tokens_per_s: tokens over it.
        max_seq_len: longest sequence a stage can hold at the plan's microbatch size, tokens.
        fits: whether the peak fits the device.
    """

    name: str
    host_bytes: int | None = None
    frozen_bytes: int | None = None
    converted_params: int = 0
    converted_bytes_per_param: float | None = None
    weight_h2d_bytes: int | None = None
    peak_device_bytes: int | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    max_seq_len: int | None = None
    fits: bool = False


def format_row(report: Any) -> FormatRow:
    """The :class:`FormatRow` of a :class:`~lightning_roundpipe.cli.plan_cmd.PlanReport`."""
    mp = report.modelled
    frozen, trainable = report.host_weight_bytes
    numel, packed = mp.converted_bytes()
    if not numel:  # bf16: the matmul weights the other formats convert, in the compute dtype
        numel = sum(count * rows * cols for c in mp.costs for count, rows, cols in c.frozen_matmul_shapes)
        packed = numel * mp.compute_dtype_bytes
    return FormatRow(name=mp.frozen.name, host_bytes=frozen + trainable, frozen_bytes=frozen,
                     converted_params=numel, converted_bytes_per_param=packed / numel if numel else None,
                     weight_h2d_bytes=report.weight_h2d_bytes, peak_device_bytes=report.peak_device_memory_bytes,
                     step_s=report.step_s, tokens_per_s=report.tokens_per_s, max_seq_len=report.max_seq_len,
                     fits=report.fits)


def compare_formats(args: argparse.Namespace, report: Any, make_report: Callable[..., Any]) -> tuple[FormatRow, ...]:
    """Each format of :data:`~lightning_roundpipe.partition.frozen.COMPARED_FORMATS` (and the report's own,
    if another) re-planned with the same arguments: ``report`` for its own format, ``make_report(args with
    --frozen-weights changed, compare=False)`` for the others (a format where a single layer exceeds the
    per-stage budget gets a row of ``None``)."""
    rows = []
    for name in dict.fromkeys((*COMPARED_FORMATS, report.modelled.frozen.name)):
        if name == report.modelled.frozen.name:
            rows.append(format_row(report))
            continue
        try:
            other = make_report(argparse.Namespace(**{**vars(args), "frozen_weights": name}), compare=False)
        except ValueError:
            rows.append(FormatRow(name=name))
            continue
        rows.append(format_row(other))
    return tuple(rows)


def dequant_step_s(r: Any) -> float:
    """Seconds of dequantisation per device and step in report ``r``'s plan, as the simulator counts them:
    each stage's converted weights once per residency (fp8, ``frozen_weights="nf4"``; one residency per
    stage and round), or per microbatch in every matmul pass (a model loaded in 4 or 8 bits: a forward
    stage's forward, a backward stage's recompute and backward, the fused tail's forward and backward)."""
    mp = r.modelled
    if not mp.dequant_s:
        return 0.0
    fmt = mp.frozen
    rounds = 1 if r.microbatches_per_round is None else -(-r.num_microbatches // r.microbatches_per_round)
    total = 0.0
    for stage in r.stages:
        once = sum(mp.dequant_s[i] for i in stage.layers)
        if fmt.dequantises == "bind":
            total += rounds * once
        else:
            passes = fmt.dequant_passes(False) + (fmt.dequant_passes(True) if stage.kind != "forward" else 0)
            total += r.num_microbatches * passes * once
    return total / r.num_devices


def frozen_lines(r: Any) -> list[str]:
    """The report's host memory and weight-upload lines, and the formats side by side when compared."""
    mp, hw = r.modelled, r.hardware
    frozen, trainable = r.host_weight_bytes
    per_device = r.weight_h2d_bytes / r.num_devices
    fmt = mp.frozen.name
    what = f"frozen {frozen / GB:,.1f} GB" + (f" (base matmul weights in {fmt})" if mp.lora is not None else "")
    lines = [f"host memory for weights and training state: {(frozen + trainable) / GB:,.1f} GB = {what} + trainable"
             f" {trainable / GB:,.2f} GB ({20 if mp.compute_dtype_bytes < 4 else 16} bytes per trainable parameter:"
             " master, gradient, Adam moments, compute copy)",
             f"weights uploaded per step: {r.weight_h2d_bytes / GB:,.1f} GB, {per_device / GB:,.1f} GB per device ="
             f" {per_device / hw.h2d_bytes_per_s:.2f} s of its H2D link at {hw.h2d_bytes_per_s / GB:g} GB/s"
             + (f"; dequantisation on the devices {dequant_step_s(r) * 1e3:,.1f} ms per device and step"
                f" ({'once per stage residency' if mp.frozen.dequantises == 'bind' else 'in every matmul'})"
                if any(mp.dequant_s) else "")]
    experts = mp.frozen_expert_param_count
    if experts:
        total = sum(c.param_count for c in mp.costs)
        lines.append(f"note: the fused 3-D expert weights of the MoE layers ({experts / 1e9:.1f}B of {total / 1e9:.1f}B"
                     " parameters) stay in the compute dtype in every format: `frozen_weights` and transformers'"
                     " bitsandbytes loading convert `nn.Linear` weights only")
    if not r.formats:
        return lines
    lines += ["", f"frozen weights side by side (each re-planned; `*` the plan above; optimizer {r.optimizer}):",
              f"{'format':<8} {'host GB':>9} {'B/param':>8} {'H2D GB/step':>12} {'peak GiB':>9} {'step s':>8}"
              f" {'tokens/s':>10} {'longest seq':>12}"]
    for row in r.formats:
        mark = "*" if row.name == fmt else " "
        if row.host_bytes is None:
            lines.append(f"{row.name + mark:<8} (no partition: a single layer exceeds the per-stage budget)")
            continue
        per_param = f"{row.converted_bytes_per_param:.3f}" if row.converted_bytes_per_param is not None else "-"
        lines.append(f"{row.name + mark:<8} {row.host_bytes / GB:>9,.1f} {per_param:>8} {row.weight_h2d_bytes / GB:>12,.1f}"
                     f" {row.peak_device_bytes / 2**30:>9.1f} {row.step_s:>8.3f} {row.tokens_per_s:>10,.0f}"
                     f" {row.max_seq_len:>12,}" + ("" if row.fits else "  (does not fit the device)"))
    lines.append("  (B/param: host bytes per converted frozen matmul parameter, what"
                 " `roundpipe/frozen_matmul_host_bytes_per_param(bytes)` measures in a run; nf4: bitsandbytes'"
                 " blockwise layout with double quantisation)")
    return lines
