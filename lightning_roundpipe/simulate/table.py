"""Bubble tables from per-layer timings: the paper's simulated comparison (section 5.4, figure 16).

Input: a CSV shaped like ``paper_layer_timings_4090.csv`` (``#`` comment lines; one row per model
with per-layer forward/backward ms, LM head forward/backward ms and ms per activation hop). For
each model the layer sequence is ``[embedding, L decoder layers, LM head + loss]`` (the embedding
costs nothing; the table gives no time for it), and every schedule is simulated on ``D`` devices
with ``M`` microbatches. Cells are the mean idle share of the devices, percent.

Modelling choices (docs/simulator.md explains and calibrates them):

- baselines bind stages to devices; the layer sequence is cut Megatron-style
  (:func:`megatron_stage_layers`: even decoder-layer counts when they divide, else the balanced
  layout): ``D`` stages for GPipe/1F1B/ZB-H1, and ``floor(len(sequence) / D)`` chunks per device
  for interleaved 1F1B and looped BFS;
- baselines recompute activations in ``B`` (activation checkpointing), like the paper's artifact;
- RoundPipe uses the asymmetric partition of ``auto_partition(..., method="paper")`` with a fused tail,
  recomputes every non-tail backward stage, and dispatches microbatches in rounds of ``D``
  (``build_roundpipe_plan(..., microbatches_per_round=D)``, as the paper's artifact);
- an activation hop between devices costs the table's ``comm_ms_per_hop``; weights and gradients
  move for free (no byte sizes in the table), as in the paper's simulation.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from lightning_roundpipe.partition.partitioner import auto_partition, schedule_ranges
from lightning_roundpipe.partition.profile import LayerProfile
from lightning_roundpipe.schedule.baselines import (
    BASELINE_BUILDERS,
    MULTI_CHUNK_BASELINES,
    build_baseline_plan,
    megatron_stage_layers,
)
from lightning_roundpipe.schedule.plan import ExecutionPlan
from lightning_roundpipe.schedule.roundpipe import build_roundpipe_plan, build_stages
from lightning_roundpipe.simulate.engine import SimulationResult, simulate

__all__ = [
    "ModelTimings",
    "SCHEDULES",
    "build_schedule_plan",
    "bubble_table",
    "format_table",
    "layer_profiles",
    "read_layer_timings",
    "simulate_schedule",
]

#: Rows of the table, in order (the paper's rows plus ``zb_h1``).
SCHEDULES: tuple[str, ...] = (
    "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "roundpipe_one_iteration", "roundpipe_steady",
)
_REQUIRED = ("model", "num_layers", "fwd_ms_per_layer", "bwd_ms_per_layer", "lm_head_fwd_ms", "lm_head_bwd_ms")


@dataclass(frozen=True, kw_only=True)
class ModelTimings:
    """One row of a layer-timings table (times for one microbatch on one device).

    Attributes:
        model: model name (the table's column header).
        num_layers: decoder layers ``L``.
        forward_s_per_layer: forward of one decoder layer, seconds.
        backward_s_per_layer: its backward without recomputation, seconds.
        lm_head_forward_s: LM head (+ final norm and loss) forward, seconds.
        lm_head_backward_s: its backward, seconds.
        comm_s_per_hop: one activation hop GPU -> CPU -> GPU, seconds (``None`` if not given).
    """

    model: str
    num_layers: int
    forward_s_per_layer: float
    backward_s_per_layer: float
    lm_head_forward_s: float
    lm_head_backward_s: float
    comm_s_per_hop: float | None = None


def read_layer_timings(source: str | Path | io.TextIOBase) -> list[ModelTimings]:
    """Read a layer-timings CSV (milliseconds in, seconds out).

    Columns: ``model, num_layers, fwd_ms_per_layer, bwd_ms_per_layer, lm_head_fwd_ms,
    lm_head_bwd_ms`` and optionally ``comm_ms_per_hop``; others are ignored; lines starting with
    ``#`` are comments. ``model`` must be non-empty and unique, ``num_layers`` an integer ``>= 1``,
    every time a finite number ``>= 0`` (``comm_ms_per_hop`` may be empty: no hop cost), and a row
    needs some compute time.

    Raises:
        ValueError: a missing column, an empty table, a duplicate model name, or a bad value; the
            message names the file, the line, the model and the column.
        FileNotFoundError: ``source`` is a path that does not exist.
    """
    if isinstance(source, io.TextIOBase):
        text, where = source.read(), str(getattr(source, "name", "<stream>"))
    else:
        text, where = Path(source).read_text(), str(source)
    numbered = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if ln.strip() and not ln.lstrip().startswith("#")]
    reader = csv.DictReader([ln for _, ln in numbered])
    missing = [c for c in _REQUIRED if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(
            f"Layer-timings table {where} lacks columns {missing}; got {reader.fieldnames}. HINT: the header must be"
            " like `model,num_layers,fwd_ms_per_layer,bwd_ms_per_layer,lm_head_fwd_ms,lm_head_bwd_ms,comm_ms_per_hop`."
        )
    out: list[ModelTimings] = []
    first_line: dict[str, int] = {}
    for row in reader:
        line = numbered[reader.line_num - 1][0] if reader.line_num - 1 < len(numbered) else reader.line_num
        model = (row.get("model") or "").strip()
        at = f"{where}, line {line}" + (f" (model {model!r})" if model else "")
        if not model:
            raise ValueError(f"Empty `model` in {at}. HINT: every row needs a model name.")
        if model in first_line:
            raise ValueError(
                f"Duplicate model {model!r} in {where}, lines {first_line[model]} and {line}."
                " HINT: give each row its own `model` name."
            )
        first_line[model] = line
        num_layers = _parse_num_layers(row.get("num_layers"), at)
        ms = {c: _parse_ms(row.get(c), at, c) for c in _REQUIRED[2:]}
        comm = row.get("comm_ms_per_hop")
        comm_ms = None if comm is None or not comm.strip() else _parse_ms(comm, at, "comm_ms_per_hop")
        if num_layers * (ms["fwd_ms_per_layer"] + ms["bwd_ms_per_layer"]) + ms["lm_head_fwd_ms"] \
                + ms["lm_head_bwd_ms"] <= 0:
            raise ValueError(
                f"No compute time in {at}: every time column is 0. HINT: give per-layer or LM head times in ms."
            )
        out.append(ModelTimings(
            model=model,
            num_layers=num_layers,
            forward_s_per_layer=ms["fwd_ms_per_layer"] / 1e3,
            backward_s_per_layer=ms["bwd_ms_per_layer"] / 1e3,
            lm_head_forward_s=ms["lm_head_fwd_ms"] / 1e3,
            lm_head_backward_s=ms["lm_head_bwd_ms"] / 1e3,
            comm_s_per_hop=None if comm_ms is None else comm_ms / 1e3,
        ))
    if not out:
        raise ValueError(f"The layer-timings table {where} has no rows. HINT: add one row per model under the header.")
    return out


def _missing(value: str | None, at: str, column: str) -> None:
    if value is None:
        raise ValueError(
            f"Column `{column}` in {at} is missing: the row has fewer values than the header."
            " HINT: one value per column."
        )


def _parse_num_layers(value: str | None, at: str) -> int:
    _missing(value, at, "num_layers")
    text = (value or "").strip()
    try:
        n = int(text)
    except ValueError:
        raise ValueError(
            f"Column `num_layers` in {at} must be an integer >= 1, got {value!r}."
            " HINT: the number of decoder layers, e.g. 28."
        ) from None
    if n < 1:
        raise ValueError(
            f"Column `num_layers` in {at} must be >= 1, got {n}. HINT: the number of decoder layers, e.g. 28."
        )
    return n


def _parse_ms(value: str | None, at: str, column: str) -> float:
    _missing(value, at, column)
    text = (value or "").strip()
    try:
        v = float(text)
    except ValueError:
        raise ValueError(
            f"Column `{column}` in {at} must be a number of milliseconds, got {value!r}."
            " HINT: a finite number >= 0, e.g. 7.43."
        ) from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(
            f"Column `{column}` in {at} must be a finite number >= 0, got {text!r}. HINT: milliseconds, e.g. 7.43."
        )
    return v


def layer_profiles(t: ModelTimings) -> list[LayerProfile]:
    """The layer sequence ``[embedding, L decoder layers, LM head]`` with the table's times.

    The embedding is free (a lookup; the table has no time for it); byte sizes are 0 (the table has
    none), so only compute and ``comm_s_per_hop`` cost time.
    """
    prof = [LayerProfile(forward_s=0.0, backward_s=0.0, param_bytes=0, activation_bytes=0, name="embedding")]
    prof += [
        LayerProfile(forward_s=t.forward_s_per_layer, backward_s=t.backward_s_per_layer, param_bytes=0,
                     activation_bytes=0, name=f"layer{i}")
        for i in range(t.num_layers)
    ]
    prof.append(LayerProfile(forward_s=t.lm_head_forward_s, backward_s=t.lm_head_backward_s, param_bytes=0,
                             activation_bytes=0, name="lm_head"))
    return prof


def build_schedule_plan(
    schedule: str, profiles: Sequence[LayerProfile], num_devices: int, num_microbatches: int,
    *, recompute_baselines: bool = True,
) -> ExecutionPlan:
    """The plan of one iteration a table row simulates.

    ``roundpipe_*`` rows: one RoundPipe plan dispatching microbatches in rounds of ``D`` over the stages of
    ``auto_partition(profiles, num_devices, method="paper")`` (fused tail). Baselines: one bound plan over
    :func:`megatron_stage_layers` stages (``D``, or ``floor(L_seq / D) x D`` for the multi-chunk ones).

    Raises:
        ValueError: an unknown ``schedule`` (the valid ones listed) or one that cannot be built.
    """
    if schedule in ("roundpipe", "roundpipe_one_iteration", "roundpipe_steady"):
        fwd, bwd = schedule_ranges(auto_partition(profiles, num_devices, method="paper"))
        return build_roundpipe_plan(build_stages(fwd, bwd, fused_tail=True), num_devices, num_microbatches,
                                    microbatches_per_round=num_devices)
    if schedule not in BASELINE_BUILDERS:
        raise ValueError(f"Unknown schedule `{schedule}`; expected one of {list(SCHEDULES)}.")
    last = len(profiles) - 1
    costs = [p.forward_s + p.backward_s + (p.forward_s if recompute_baselines and i != last else 0.0)
             for i, p in enumerate(profiles)]
    chunks = max(1, len(profiles) // num_devices) if schedule in MULTI_CHUNK_BASELINES else 1
    if chunks * num_devices > len(profiles):
        raise ValueError(
            f"`{schedule}` needs at least {num_devices} layers for {num_devices} bound stages, the sequence has"
            f" {len(profiles)}. HINT: use fewer devices."
        )
    stage_layers = megatron_stage_layers(costs, chunks * num_devices)
    return build_baseline_plan(schedule, stage_layers, num_devices, num_microbatches, recompute=recompute_baselines)


def simulate_schedule(
    schedule: str, profiles: Sequence[LayerProfile], num_devices: int, num_microbatches: int,
    *, comm_s_per_hop: float | None = None, recompute_baselines: bool = True,
) -> SimulationResult:
    """Simulate one table row for one model (see :func:`build_schedule_plan`)."""
    plan = build_schedule_plan(schedule, profiles, num_devices, num_microbatches, recompute_baselines=recompute_baselines)
    return simulate(plan, profiles, comm_s_per_hop=comm_s_per_hop, steady_state=schedule == "roundpipe_steady")


def bubble_table(
    timings: Iterable[ModelTimings], num_devices: int, num_microbatches: int,
    schedules: Sequence[str] = SCHEDULES, *, recompute_baselines: bool = True,
    errors: list[str] | None = None,
) -> dict[str, dict[str, float]]:
    """``table[schedule][model]`` = mean idle percent of the devices.

    Args:
        errors: when given, a schedule that cannot be built for a model (e.g. interleaved 1F1B with
            a microbatch count its rounds do not divide) gets ``nan`` and its message is appended
            here; when ``None`` the error propagates.

    Raises:
        ValueError: an unknown schedule, or (without ``errors``) a schedule that cannot be built.
    """
    unknown = [s for s in schedules if s not in SCHEDULES and s != "roundpipe"]
    if unknown:
        raise ValueError(f"Unknown schedule(s) {unknown}; expected names from {list(SCHEDULES)}.")
    table: dict[str, dict[str, float]] = {s: {} for s in schedules}
    for t in timings:
        prof = layer_profiles(t)
        for s in schedules:
            try:
                res = simulate_schedule(s, prof, num_devices, num_microbatches, comm_s_per_hop=t.comm_s_per_hop,
                                        recompute_baselines=recompute_baselines)
            except ValueError as e:
                if errors is None:
                    raise
                errors.append(f"{s} / {t.model}: {e}")
                table[s][t.model] = float("nan")
                continue
            table[s][t.model] = res.mean_idle_pct
    return table


def _cell(v: float) -> str:
    return "n/a" if v != v else f"{v:.1f}"


def format_table(table: dict[str, dict[str, float]], fmt: str = "table") -> str:
    """``fmt="csv"``: ``schedule,<model>,...`` rows with one decimal (like paper_simulated_bubbles.csv);
    ``fmt="table"``: aligned columns for a terminal. A ``nan`` cell prints as ``n/a``.

    Raises:
        ValueError: an unknown ``fmt``.
    """
    models = list(dict.fromkeys(m for row in table.values() for m in row))
    rows = [["schedule"] + models] + [[s] + [_cell(table[s].get(m, float("nan"))) for m in models] for s in table]
    if fmt == "csv":
        return "\n".join(",".join(r) for r in rows) + "\n"
    if fmt != "table":
        raise ValueError(f"Unknown `fmt` {fmt!r}; expected 'table' or 'csv'.")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines) + "\n"
