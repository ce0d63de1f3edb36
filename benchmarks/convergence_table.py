"""The pure part of ``benchmarks/convergence.py``: seeds summarised, the loss at a share of the steps,
the share of the sync-async gap a staleness correction closes, the steps and the time to a target
validation loss, and the printed table. No torch, no Lightning (tests/test_convergence_benchmark.py
checks each function against hand-computed figures).

A *run* is one training run: a ``dict`` with ``setup``, ``optimizer``, ``lr``, ``mode`` (``"sync"``,
``"async"`` or ``"async+<correction>"``), ``seed``, ``total_steps`` and the validation curve ``steps``
(optimizer steps, ints, ascending) / ``val_loss`` (mean token cross-entropy, nats/token). A *group* is
the runs of one setup, optimizer and learning rate; within it, each mode's runs differ by seed only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

FRACTIONS = (0.25, 0.5, 1.0)
"""Shares of the run's steps the table reports the loss at."""
TARGET_RULES = ("all-reach", "sync-final")
"""How the target validation loss of a group is chosen (:func:`target_loss`)."""


@dataclass(frozen=True)
class Spread:
    """Mean, minimum and maximum of a value over seeds; a seed whose loss is not finite (NaN or inf: the run
    diverged) counts as ``inf``, so the mean of a mode with a diverged seed is ``inf``."""

    mean: float
    low: float
    high: float
    count: int
    diverged: int = 0

    def __str__(self) -> str:
        if self.diverged:
            return f"diverged {self.diverged}/{self.count}"
        if self.count < 2:
            return f"{self.mean:.3f}"
        return f"{self.mean:.3f} [{self.low:.3f},{self.high:.3f}]"


def spread(values: Iterable[float]) -> Spread:
    """Mean, min and max of ``values`` (one per seed; NaN and inf count as ``inf``, a diverged run).

    Raises:
        ValueError: if ``values`` is empty.
    """
    values = [float(v) if math.isfinite(float(v)) else math.inf for v in values]
    if not values:
        raise ValueError("`values` is empty. HINT: a mode needs at least one finished run (seed).")
    diverged = sum(1 for v in values if v == math.inf)
    mean = math.inf if diverged else statistics.fmean(values)
    return Spread(mean, min(values), max(values), len(values), diverged)


def interpolate(steps: Sequence[int], losses: Sequence[float], step: float) -> float:
    """The validation curve at ``step`` (optimizer steps): linear between the evaluated steps, exact
    at them.

    Raises:
        ValueError: if the curve is empty, its lengths differ, or ``step`` lies outside it.
    """
    if not steps or len(steps) != len(losses):
        raise ValueError(f"a curve needs as many `steps` as `losses` (got {len(steps)} and {len(losses)}).")
    if not steps[0] <= step <= steps[-1]:
        raise ValueError(f"step {step} is outside the evaluated steps {steps[0]}..{steps[-1]}."
                         " HINT: evaluate at step 0 and at the last step.")
    for (s0, l0), (s1, l1) in zip(zip(steps, losses), zip(steps[1:], losses[1:])):
        if s0 <= step <= s1:
            return l0 if s1 == s0 else l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return float(losses[-1])


def _or_diverged(run: Mapping, loss: float) -> float:
    """``loss``, or ``inf`` (diverged) when it is above the run's initial validation loss (its first
    evaluation, before any step): training that ends worse than the untrained model diverged even
    where the loss stayed finite (e.g. 8626 nats from 10.8)."""
    initial = run["val_loss"][0] if run["steps"] and run["steps"][0] == 0 else math.inf
    return math.inf if loss > initial else loss


def loss_at_fraction(run: Mapping, fraction: float) -> float:
    """The run's validation loss after ``fraction`` of its ``total_steps`` (rounded to a step); ``inf``
    when it diverged (not finite, or above the loss before the first step)."""
    return _or_diverged(run, interpolate(run["steps"], run["val_loss"], round(fraction * run["total_steps"])))


def mean_curve(runs: Sequence[Mapping]) -> tuple[list[int], list[float]]:
    """The seeds' mean validation curve, on the steps every run evaluated.

    Raises:
        ValueError: if ``runs`` is empty or they share no evaluated step.
    """
    if not runs:
        raise ValueError("`runs` is empty.")
    common = sorted(set.intersection(*(set(run["steps"]) for run in runs)))
    if not common:
        raise ValueError("the runs share no evaluated step. HINT: run them with the same `--eval-every`.")
    means = [spread(_or_diverged(run, run["val_loss"][list(run["steps"]).index(step)]) for run in runs).mean
             for step in common]
    return common, means


def gap_closed(loss_sync: float, loss_async: float, loss_corrected: float, min_gap: float = 0.0) -> float | None:
    """The share of the sync-async loss gap a correction closes at equal steps:
    ``(loss_async - loss_corrected) / (loss_async - loss_sync)``; 1 is sync's loss, 0 plain async's,
    negative worse than plain async. ``None`` when async is not worse than sync by more than
    ``min_gap`` (no gap to close: the ratio would be noise), or when sync or async diverged (``inf``)."""
    gap = loss_async - loss_sync
    if not math.isfinite(gap) or not gap > max(min_gap, 0.0):  # also: a mode diverged (inf)
        return None
    return (loss_async - loss_corrected) / gap


def steps_to_target(steps: Sequence[int], losses: Sequence[float], target: float) -> float | None:
    """The first step at which the curve reaches ``target`` (linear between evaluated steps); ``None`` if
    it never does."""
    for index, (step, loss) in enumerate(zip(steps, losses)):
        if loss <= target:
            if index == 0:
                return float(step)
            s0, l0 = steps[index - 1], losses[index - 1]
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
    return None


def target_loss(final_means: Mapping[str, float], rule: str = "all-reach") -> float:
    """The target validation loss of a group from each mode's final mean loss.

    ``"all-reach"``: the highest finite final mean loss among the modes, so every mode that did not diverge
    reaches it within the run; ``"sync-final"``: sync's final mean loss (a mode worse than sync may not reach it).

    Raises:
        ValueError: for an unknown ``rule``, ``"sync-final"`` without a sync run, or no finite final loss.
    """
    if rule == "all-reach":
        finite = [value for value in final_means.values() if math.isfinite(value)]
        if not finite:
            raise ValueError("every mode diverged: no target loss. HINT: a lower learning rate.")
        return max(finite)
    if rule == "sync-final":
        if "sync" not in final_means:
            raise ValueError("the target rule `sync-final` needs the `sync` mode. HINT: `--target-rule all-reach`.")
        return final_means["sync"]
    raise ValueError(f"`target_rule` must be one of {list(TARGET_RULES)}, got {rule!r}.")


def base_mode(mode: str) -> str:
    """The planner's mode for a benchmark mode: ``"async+error_feedback"`` steps as ``"async"``."""
    return "sync" if mode == "sync" else "async"


def group_runs(runs: Iterable[Mapping]) -> dict[tuple, dict[str, list[Mapping]]]:
    """``{(setup, optimizer, lr): {mode: [runs]}}``, groups and modes in first-seen order."""
    groups: dict[tuple, dict[str, list[Mapping]]] = {}
    for run in runs:
        groups.setdefault((run["setup"], run["optimizer"], run["lr"]), {}).setdefault(run["mode"], []).append(run)
    return groups


@dataclass(frozen=True)
class ModeRow:
    """One mode of one group in the table."""

    mode: str
    seeds: int
    losses: tuple[Spread, ...]
    """Loss at each of :data:`FRACTIONS` of the steps, over seeds."""
    gaps: tuple[float | None, ...]
    """For a corrected async mode: :func:`gap_closed` of the mean losses at each fraction over the seeds that
    sync, async and the mode all ran; else ``None``s."""
    steps_to_target: float | None
    step_s: float | None
    """The planner's predicted seconds per step for the mode on the target hardware (``None``: not given)."""

    @property
    def time_to_target_s(self) -> float | None:
        if self.steps_to_target is None or self.step_s is None:
            return None
        return self.steps_to_target * self.step_s


def mode_rows(modes: Mapping[str, Sequence[Mapping]], step_s: Mapping[str, float] | None = None,
              rule: str = "all-reach", min_gap: float = 0.0) -> tuple[float, list[ModeRow]]:
    """The target loss of one group and a :class:`ModeRow` per mode.

    Args:
        modes: ``{mode: runs}`` of one group (one setup, optimizer and learning rate).
        step_s: predicted seconds per step per mode; a corrected mode missing from it is timed as its planner mode
            (:func:`base_mode`: plain async).
        rule: the target rule (:func:`target_loss`).
        min_gap: the smallest sync-async gap (nats) :func:`gap_closed` reports a share of.
    """
    finals = {mode: spread(loss_at_fraction(run, 1.0) for run in runs).mean for mode, runs in modes.items()}
    target = target_loss(finals, rule)
    rows = []
    for mode, runs in modes.items():
        losses = tuple(spread(loss_at_fraction(run, f) for run in runs) for f in FRACTIONS)
        seeds = set.intersection(*({run["seed"] for run in modes.get(m, ())} for m in ("sync", "async", mode)))
        if mode.startswith("async+") and seeds:  # on the seeds all three modes ran
            sync, plain, corrected = ([spread(loss_at_fraction(run, f) for run in modes[m] if run["seed"] in seeds).mean
                                       for f in FRACTIONS] for m in ("sync", "async", mode))
            gaps = tuple(gap_closed(s, a, c, min_gap) for s, a, c in zip(sync, plain, corrected))
        else:
            gaps = (None,) * len(FRACTIONS)
        curve_steps, curve = mean_curve(runs)
        # a mode with a seed diverged at the end does not count as reaching the target, even where its mean
        # curve passed it before blowing up
        reached = None if losses[-1].diverged else steps_to_target(curve_steps, curve, target)
        rows.append(ModeRow(mode, len(runs), losses, gaps, reached,
                            None if step_s is None else step_s.get(mode, step_s.get(base_mode(mode)))))
    return target, rows


def _fmt_optional(value: float | None, fmt: str, missing: str = "-") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def format_table(runs: Sequence[Mapping], step_s: Mapping[str, Mapping[str, float]] | None = None,
                 rule: str = "all-reach", min_gap: float = 0.0) -> str:
    """The benchmark's table: per group and mode, the loss at 25/50/100 % of the steps (mean [min,max] over
    seeds), the gap a correction closes at each, the steps to the group's target loss and those steps
    times the planner's predicted step time (``step_s[setup][planner mode]``), and which mode is first.
    """
    lines = []
    header = (f"{'mode':<30} {'seeds':>5} " + " ".join(f"{f'loss@{int(f * 100)}%':>21}" for f in FRACTIONS)
              + f" {'gap closed 25/50/100%':>22} {'steps->target':>13} {'s/step':>8} {'time->target s':>14}")
    for (setup, optimizer, lr), modes in group_runs(runs).items():
        group_step_s = None if step_s is None else step_s.get(setup)
        target, rows = mode_rows(modes, group_step_s, rule, min_gap)
        total = max(run["total_steps"] for mode_runs in modes.values() for run in mode_runs)
        lines += ["", f"setup {setup}, {optimizer} lr={lr:g}, {total} steps; target val loss {target:.3f} ({rule})",
                  header]
        for row in rows:
            gaps = "/".join(_fmt_optional(g if g is None else 100 * g, ".0f", "-") for g in row.gaps)
            lines.append(f"{row.mode:<30} {row.seeds:>5} " + " ".join(f"{str(s):>21}" for s in row.losses)
                         + f" {gaps:>22} {_fmt_optional(row.steps_to_target, '.1f', 'never'):>13}"
                         + f" {_fmt_optional(row.step_s, '.4f'):>8} {_fmt_optional(row.time_to_target_s, '.3f'):>14}")
        timed = [row for row in rows if row.time_to_target_s is not None]
        if timed:
            first = min(timed, key=lambda row: row.time_to_target_s)
            lines.append(f"  first to the target on the planner's hardware: {first.mode}"
                         f" ({first.time_to_target_s:.3f} s)")
    return "\n".join(lines)
