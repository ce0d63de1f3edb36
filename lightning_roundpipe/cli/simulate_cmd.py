"""`roundpipe simulate`: the paper's bubble table (section 5.4) from per-layer timings.

Example (reproduces the paper's ``paper_simulated_bubbles.csv`` within a few points)::

    roundpipe simulate --layer-timings paper --devices 8 --microbatches 16 --format csv

``--layer-timings paper`` is the paper's per-layer timings on an RTX 4090, shipped with the package
(``lightning_roundpipe/simulate/data/paper_layer_timings_4090.csv``; in Python
``lightning_roundpipe.simulate.paper_data_path("layer_timings_4090")``). Any other value is a CSV path
(``./paper`` for a file literally named ``paper``).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from lightning_roundpipe.simulate.table import (
    SCHEDULES,
    bubble_table,
    build_schedule_plan,
    format_table,
    layer_profiles,
    read_layer_timings,
)
from lightning_roundpipe.simulate.paper_data import paper_data_path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``simulate`` subcommand; its ``func`` is :func:`run`."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate pipeline schedules from per-layer timings and print idle %% per schedule and model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--layer-timings", required=True, type=_layer_timings_path, metavar="FILE.csv|paper",
                   help="CSV with model,num_layers,fwd_ms_per_layer,bwd_ms_per_layer,lm_head_fwd_ms,lm_head_bwd_ms"
                        "[,comm_ms_per_hop]; lines starting with # are comments. `paper`: the paper's RTX 4090"
                        " timings shipped with the package (simulate/data/paper_layer_timings_4090.csv)")
    p.add_argument("--devices", type=int, default=8, help="number of devices D (default 8)")
    p.add_argument("--microbatches", type=int, default=16, help="microbatches per iteration M (default 16)")
    p.add_argument("--format", choices=("table", "csv"), default="table", help="output format (default table)")
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES), metavar="NAME",
                   help=f"rows to simulate (default all: {' '.join(SCHEDULES)})")
    p.add_argument("--no-baseline-recompute", action="store_true",
                   help="baselines keep activations instead of recomputing them in the backward"
                        " (the paper's simulation recomputes)")
    p.add_argument("--plot", type=Path, metavar="OUT.png",
                   help="write the timelines of every schedule for one model (see --plot-model) as a PNG")
    p.add_argument("--plot-model", metavar="NAME", help="model to plot or trace (default: the first row of the CSV)")
    p.add_argument("--trace", type=Path, metavar="OUT.json",
                   help="write the simulated iteration of one schedule (see --trace-schedule) for one model (see"
                        " --plot-model) as a Chrome/Perfetto trace (open in ui.perfetto.dev or chrome://tracing);"
                        " the same format the strategy writes for a measured step")
    p.add_argument("--trace-schedule", choices=SCHEDULES, default="roundpipe_one_iteration", metavar="NAME",
                   help="schedule of --trace (default roundpipe_one_iteration)")
    p.set_defaults(func=run)
    return p


def _layer_timings_path(value: str) -> Path:
    """``paper`` -> the packaged paper timings; anything else is a path."""
    if value.strip().lower() == "paper":
        try:
            return paper_data_path("paper_layer_timings_4090.csv")
        except OSError as e:  # a broken install
            raise argparse.ArgumentTypeError(str(e)) from None
    return Path(value)


def run(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status (0 ok, 2 bad input)."""
    if args.devices < 1 or args.microbatches < 1:
        print(f"roundpipe simulate: error: --devices and --microbatches must be >= 1, got {args.devices} and"
              f" {args.microbatches}. HINT: e.g. `--devices 8 --microbatches 16`.", file=sys.stderr)
        return 2
    if not args.layer_timings.is_file():
        print(f"roundpipe simulate: error: --layer-timings: no file {str(args.layer_timings)!r}. HINT: `paper` uses"
              " the paper's measured RTX 4090 layer timings; else a CSV path (columns as in"
              " `lightning_roundpipe/simulate/data/paper_layer_timings_4090.csv`).", file=sys.stderr)
        return 2
    try:
        timings = read_layer_timings(args.layer_timings)
        _check_plot_model(args, timings)  # before the table is simulated or printed
        recompute = not args.no_baseline_recompute
        errors: list[str] = []
        table = bubble_table(timings, args.devices, args.microbatches, args.schedules, recompute_baselines=recompute,
                             errors=errors)
    except (OSError, ValueError) as e:
        print(f"roundpipe simulate: error: {e}", file=sys.stderr)
        return 2
    for msg in errors:
        print(f"roundpipe simulate: warning: n/a for {msg}", file=sys.stderr)
    if args.format == "csv":
        print(f"# Simulated idle fraction (%) of one training iteration, {args.devices} devices,"
              f" {args.microbatches} microbatches, per-layer times of {args.layer_timings.name}"
              f" (lightning_roundpipe.simulate). \"steady\" = RoundPipe with fill/drain hidden by the next iteration.")
    sys.stdout.write(format_table(table, args.format))
    if args.plot is not None:
        code = _plot(args, timings, recompute)
        if code:
            return code
    if args.trace is not None:
        return _trace(args, timings, recompute)
    return 0


def _check_plot_model(args: argparse.Namespace, timings: list) -> None:
    """``--plot-model`` names a model of the timings (the choices are known only once they are read).

    Raises:
        ValueError: listing the models, with the near one when there is one.
    """
    models = [t.model for t in timings]
    name = args.plot_model
    if name is None or name in models:
        return
    near = [m for m in models if m.lower() == name.strip().lower()] or difflib.get_close_matches(name, models, n=1)
    hint = f"did you mean {near[0]!r}?" if near else f"leave it out to use the first row ({models[0]!r})."
    raise ValueError(f"`--plot-model` must be one of the models of {args.layer_timings.name}: {models},"
                     f" got {name!r}. HINT: {hint}")


def _model(args: argparse.Namespace, timings: list):
    """The model of ``--plot-model`` (checked by :func:`_check_plot_model`), else the first row."""
    return next(t for t in timings if args.plot_model in (None, t.model))


def _trace(args: argparse.Namespace, timings: list, recompute: bool) -> int:
    from lightning_roundpipe.metrics.trace import write_trace
    from lightning_roundpipe.simulate.engine import simulate

    t = _model(args, timings)
    prof = layer_profiles(t)
    schedule = args.trace_schedule
    try:
        plan = build_schedule_plan(schedule, prof, args.devices, args.microbatches, recompute_baselines=recompute)
    except ValueError as e:
        print(f"roundpipe simulate: error: --trace-schedule {schedule}: {e}", file=sys.stderr)
        return 2
    res = simulate(plan, prof, comm_s_per_hop=t.comm_s_per_hop, steady_state=schedule == "roundpipe_steady")
    try:
        out = write_trace(res.timeline, args.trace, title=f"simulated {schedule}",
                          metadata={"model": t.model, "schedule": schedule, "devices": args.devices,
                                    "num_microbatches": args.microbatches, "iteration_s": res.iteration_s,
                                    "mean_idle_pct": res.mean_idle_pct})
    except OSError as e:
        print(f"roundpipe simulate: error: cannot write --trace {args.trace}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _plot(args: argparse.Namespace, timings: list, recompute: bool) -> int:
    from lightning_roundpipe.metrics.plot import plot_timelines
    from lightning_roundpipe.simulate.engine import simulate

    t = _model(args, timings)
    prof = layer_profiles(t)
    panels = {}
    for s in args.schedules:
        try:
            plan = build_schedule_plan(s, prof, args.devices, args.microbatches, recompute_baselines=recompute)
        except ValueError:
            continue  # already reported as n/a
        res = simulate(plan, prof, comm_s_per_hop=t.comm_s_per_hop, steady_state=s == "roundpipe_steady")
        timeline, name = res.timeline, f"{t.model} {s}"
        if res.num_iterations > 1:  # like with like: one iteration of the steady state beside one-iteration rows
            timeline, name = _first_iteration(timeline, res.iteration_s), f"{name} (one steady-state iteration)"
        panels[name] = timeline
    out = plot_timelines(panels, args.plot, share_time_axis=True)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _first_iteration(timeline, iteration_s: float):
    """The first ``iteration_s`` seconds of a steady-state window (spans crossing the end are cut)."""
    from dataclasses import replace

    from lightning_roundpipe.metrics.timeline import Timeline

    spans = [replace(iv, end_s=min(iv.end_s, iteration_s)) for iv in timeline.intervals if iv.start_s < iteration_s]
    return Timeline(timeline.num_devices, spans, wall_s=iteration_s)
