"""A small private RoundPipe partition helper for the simulator (no memory model).

The real partitioner lives in :mod:`lightning_roundpipe.partition.partitioner`; this helper only
needs per-layer times, so that ``roundpipe simulate`` works from a timings table alone.

Asymmetric partition (paper section 3.2), for one candidate stage budget ``W`` (seconds):

- the **fused tail** (first backward stage) = the LM head (the sequence's last layer) plus as many
  last layers as fit in ``W`` (cost: forward + backward, no recomputation);
- **backward stages**: the remaining layers, packed from the end into the fewest stages of
  recompute + backward cost ``<= W``, then re-cut to the most even split with that stage count;
- **forward stages**: the layers before the tail, packed the same way by forward cost.

The budget is searched as in the paper's partitioner: every contiguous-run cost between the
heaviest single unit (one layer's recompute + backward, or the LM head's forward + backward) and
``1.1x`` it, minimising ``max(S, D) x largest stage cost`` (``S`` stages on ``D`` devices; DESIGN.md
section 6). Ties go to fewer stages. Small budgets mean many small stages, which keeps the
round robin's fill and drain short (about ``(D - 1)`` stage costs each).
"""

from __future__ import annotations

from typing import Sequence

from lightning_roundpipe.partition.profile import LayerProfile
from lightning_roundpipe.schedule.baselines import balanced_stage_layers

_TOL = 1e-9
_BUDGET_RANGE = 1.1  # paper: candidate budgets from the heaviest single layer up to 1.1x it


def _pack_count(costs: Sequence[float], limit: float) -> int | None:
    """Fewest consecutive groups with sum <= limit (greedy is optimal); None if one item exceeds it."""
    count, acc = 0, None
    for c in costs:
        if c > limit * (1 + _TOL):
            return None
        if acc is None or acc + c > limit * (1 + _TOL):
            count, acc = count + 1, c
        else:
            acc += c
    return count


def roundpipe_partition(
    profiles: Sequence[LayerProfile], num_devices: int
) -> tuple[tuple[range, ...], tuple[range, ...]]:
    """Forward and backward stage ranges for ``build_stages(fwd, bwd, fused_tail=True)``.

    Args:
        profiles: one per layer (seconds per microbatch), the LM head (+ loss) last.
        num_devices: ``D`` (>= 1).

    Returns:
        ``(forward_stages, backward_stages)``: ascending ranges that stop where the tail starts, and
        ranges in execution order, the fused tail first.

    Raises:
        ValueError: fewer than one layer, or ``num_devices`` < 1.
    """
    n = len(profiles)
    if n < 1:
        raise ValueError("`profiles` is empty: a partition needs at least one layer.")
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"`num_devices` must be a positive int, got {num_devices!r}.")
    fwd = [p.forward_s for p in profiles]
    rb = [p.forward_s + p.backward_s for p in profiles]  # recompute + backward (or the tail's F + B)
    candidates: set[float] = set()
    for costs in (fwd, rb):
        for i in range(n):
            acc = 0.0
            for j in range(i, n):
                acc += costs[j]
                candidates.add(round(acc, 12))
    lower = max(rb)
    upper = lower * _BUDGET_RANGE
    best: tuple[tuple[float, int, float], tuple[tuple[range, ...], tuple[range, ...]]] | None = None
    seen: set[tuple[int, int, int]] = set()
    for limit in sorted(c for c in candidates if lower * (1 - _TOL) <= c <= upper * (1 + _TOL)):
        tail_start, acc = n - 1, rb[-1]
        while tail_start > 0 and acc + rb[tail_start - 1] <= limit * (1 + _TOL):
            tail_start -= 1
            acc += rb[tail_start]
        nf = _pack_count(fwd[:tail_start], limit) if tail_start else 0
        nb = _pack_count(rb[:tail_start], limit) if tail_start else 0
        if nf is None or nb is None or (tail_start, nf, nb) in seen:
            continue
        seen.add((tail_start, nf, nb))
        stages = nf + nb + 1
        fr = balanced_stage_layers(fwd[:tail_start], nf) if nf else ()
        br = balanced_stage_layers(rb[:tail_start], nb) if nb else ()
        worst = max([acc] + [sum(fwd[i] for i in r) for r in fr] + [sum(rb[i] for i in r) for r in br])
        key = (max(stages, num_devices) * worst, stages, worst)
        if best is None or key < best[0]:
            best = (key, (tuple(fr), (range(tail_start, n),) + tuple(reversed(br))))
    assert best is not None  # the heaviest unit's cost is a candidate and always fits
    return best[1]
