"""Timeline pictures: one row per device, busy spans coloured by kind (DESIGN.md section 7).

Works for any :class:`Timeline` (measured by the runtime or modelled by the simulator). Compute
spans (``F``/``X``/``B``/``W``) fill the upper part of a device's row; transfers (``H2D``/``D2H``)
are thin bars under them. Rendering uses matplotlib's Agg canvas directly (no pyplot, no global
backend change), so it works headless and inside training processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from lightning_roundpipe.metrics.timeline import Timeline

__all__ = ["KIND_COLORS", "plot_timeline", "plot_timelines"]

#: Colour of each interval kind.
KIND_COLORS: dict[str, str] = {
    "F": "#4F81BD",  # forward
    "X": "#8064A2",  # fused tail: forward + loss + backward
    "R": "#E6B9B8",  # recompute: a backward stage's forward from its saved input
    "B": "#C0504D",  # backward
    "W": "#F79646",  # weight-gradient backward (ZB-H1)
    "H2D": "#9BBB59",  # uploads: weights, activations
    "D2H": "#7F7F7F",  # downloads: activations, gradients
    "wait": "#D9D9D9",
    "host": "#4BACC6",  # host spans: the optimizer step, the main thread's phases
}
_LABELS = {"F": "forward", "X": "fused tail", "R": "recompute", "B": "backward", "W": "weight grad", "H2D": "H2D", "D2H": "D2H",
           "wait": "wait", "host": "host (optimizer)"}


def _draw(ax, timeline: Timeline, title: str | None, time_unit: str, host_spans: Sequence = (),
          span_limit_s: float | None = None) -> set[str]:
    scale = {"s": 1.0, "ms": 1e3}[time_unit]
    kinds: set[str] = set()
    for iv in timeline.intervals:
        width = (iv.end_s - iv.start_s) * scale
        if width <= 0:
            continue
        row = iv.device_index
        if iv.is_compute:
            y, h = row + 0.08, 0.6
        elif iv.kind == "H2D":
            y, h = row + 0.70, 0.11
        else:
            y, h = row + 0.82, 0.11
        ax.broken_barh([(iv.start_s * scale, width)], (y, h), facecolors=KIND_COLORS.get(iv.kind, "#000000"),
                       edgecolors="black" if iv.is_compute else "none", linewidth=0.2)
        kinds.add(iv.kind)
    n = timeline.num_devices
    labels = [f"dev{d} ({timeline.bubble_pct(d):.0f}% idle)" for d in range(n)]
    host_rows = sorted({s.thread for s in host_spans})
    for span in host_spans:
        row = n + host_rows.index(span.thread)
        ax.broken_barh([(span.start_s * scale, (span.end_s - span.start_s) * scale)], (row + 0.08, 0.6),
                       facecolors=KIND_COLORS["host"], edgecolors="black", linewidth=0.2)
        kinds.add("host")
    labels += [f"host {thread}" for thread in host_rows]
    span = timeline.span_s() * scale
    limit = span if span_limit_s is None else span_limit_s * scale
    ax.set_xlim(0, limit * 1.01 if limit > 0 else 1.0)
    ax.set_ylim(len(labels), 0)
    ax.set_yticks([d + 0.45 for d in range(len(labels))])
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel(f"time ({time_unit})")
    ax.grid(axis="x", linestyle="--", linewidth=0.4, alpha=0.5)
    head = f"{title}: " if title else ""
    ax.set_title(f"{head}{span:.1f} {time_unit}, mean idle {timeline.mean_bubble_pct():.1f}%", fontsize=9)
    return kinds


def _save(fig, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(out, dpi=150)
    return out


def _legend(fig, kinds: set[str]) -> None:
    from matplotlib.patches import Patch

    order = [k for k in KIND_COLORS if k in kinds]
    fig.legend(handles=[Patch(facecolor=KIND_COLORS[k], label=_LABELS[k]) for k in order], loc="upper right",
               ncol=len(order), fontsize=7, frameon=False)


def plot_timeline(timeline: Timeline, path: str | Path, *, title: str | None = None, time_unit: str = "ms") -> Path:
    """Draw ``timeline`` and save it as a PNG.

    Args:
        timeline: the intervals (seconds) of ``timeline.num_devices`` devices.
        path: output file (``.png``); parent folders are created.
        title: caption prefix (e.g. the schedule's name).
        time_unit: ``"ms"`` or ``"s"`` on the x axis.

    Returns:
        The written path.

    Raises:
        ValueError: an unknown ``time_unit``.
        TypeError: ``timeline`` is not a :class:`Timeline`.
    """
    return plot_timelines({title or "": timeline}, path, time_unit=time_unit)


def plot_timelines(timelines: Mapping[str, Timeline], path: str | Path, *, time_unit: str = "ms",
                   share_time_axis: bool = False, host_spans: Mapping[str, Sequence] | None = None) -> Path:
    """Draw several timelines (e.g. one per schedule) stacked in one PNG, one panel each.

    Args:
        timelines: panel title -> timeline, drawn top to bottom in order.
        path: output file (``.png``); parent folders are created.
        time_unit: ``"ms"`` or ``"s"``.
        share_time_axis: every panel gets the same time axis (the longest timeline's), so a
            measured step and its prediction compare at a glance.
        host_spans: panel title -> :class:`~lightning_roundpipe.metrics.trace.HostSpan` s drawn on
            extra rows under that panel's devices (one row per host thread).

    Returns:
        The written path.

    Raises:
        ValueError: no timelines, or an unknown ``time_unit``.
        TypeError: a value is not a :class:`Timeline`.
    """
    if not timelines:
        raise ValueError("`timelines` is empty: nothing to draw.")
    if time_unit not in ("ms", "s"):
        raise ValueError(f"`time_unit` must be 'ms' or 's', got {time_unit!r}.")
    for name, tl in timelines.items():
        if not isinstance(tl, Timeline):
            raise TypeError(f"Timeline {name!r} is a {type(tl).__name__}, expected lightning_roundpipe.metrics.Timeline.")
    from matplotlib.figure import Figure

    host_spans = host_spans or {}
    rows = {name: tl.num_devices + len({s.thread for s in host_spans.get(name, ())}) for name, tl in timelines.items()}
    heights = [max(1.2, 0.32 * rows[name] + 0.8) for name in timelines]
    longest = max(tl.span_s() for tl in timelines.values()) if share_time_axis else None
    fig = Figure(figsize=(13, sum(heights) + 0.4))
    axes = fig.subplots(len(timelines), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    kinds: set[str] = set()
    for ax, (name, tl) in zip(axes, timelines.items()):
        kinds |= _draw(ax, tl, name or None, time_unit, host_spans.get(name, ()), longest)
    _legend(fig, kinds)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (sum(heights) + 0.4)))
    return _save(fig, path)
