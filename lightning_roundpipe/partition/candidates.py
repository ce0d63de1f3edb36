"""Candidate partitions for the simulator to judge (DESIGN.md sections 6 and 11).

The partitioner's objective, ``max(S, D) x W``, assumes a steady state in which every device is busy;
a run that drains every step (``optimizer="sync"``), or a stage count that leaves some devices with
one stage more per step than others, does not have it. So the choice among partitions is made by
the simulator in the run's own mode (:func:`lightning_roundpipe.simulate.steady.simulate_training`)
over :func:`candidate_partitions`: what each method of
:func:`~lightning_roundpipe.partition.partitioner.auto_partition` proposes, plus, on several devices,
the best partitions whose stage count (the fused tail counted) is the multiple of the devices just
below or just above the partitioner's (:func:`filling_stage_counts`, :func:`partition_with_stage_count`),
so that every device runs as many stages per step.

Pure: no torch, no Lightning, no devices.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from lightning_roundpipe.partition.partitioner import (
    _REL_TOL,
    METHODS,
    _check_single_layers,
    _contiguous_sums,
    _cut_exactly,
    _pack,
    _stage_counts,
    _Tables,
    auto_partition,
)
from lightning_roundpipe.partition.profile import LayerProfile
from lightning_roundpipe.partition.types import PartitionPlan

__all__ = ["candidate_partitions", "filling_stage_counts", "partition_with_stage_count", "stage_count"]


def stage_count(partition: PartitionPlan) -> int:
    """Stages the round robin runs per microbatch round: forward stages other than the fused tail,
    plus the backward stages (the tail counted once)."""
    return len(partition.forward_stages) + len(partition.backward_stages) - 1


def filling_stage_counts(num_stages: int, num_devices: int) -> list[int]:
    """The multiples of ``num_devices`` next to ``num_stages`` (the partitioner's count), below (when
    at least ``D``) and above: ``floor(S / D) x D`` and ``ceil(S / D) x D``; none when ``S`` is one
    already, or on one device (every count fills it)."""
    if num_devices < 2 or num_stages % num_devices == 0:
        return []
    low, high = num_stages // num_devices, -(-num_stages // num_devices)
    return [k * num_devices for k in range(max(1, low), high + 1)]


def candidate_partitions(
    profiles: Sequence[LayerProfile],
    num_devices: int,
    stage_memory_bytes: int | None = None,
    *,
    saved_activation_bytes: Sequence[int] | None = None,
) -> list[tuple[str, PartitionPlan]]:
    """The partitions the simulator judges, labelled, distinct, in preference order (ties go to the
    earlier): ``"optimal"`` and ``"paper"`` (:func:`auto_partition`'s methods), then ``"<S> stages"``
    for each count of :func:`filling_stage_counts` around the optimal partition's that has a partition.

    Raises:
        ValueError: as :func:`auto_partition`.
    """
    out: list[tuple[str, PartitionPlan]] = []
    seen: set = set()

    def add(label: str, plan: PartitionPlan | None) -> None:
        key = None if plan is None else (plan.forward_stages, plan.backward_stages)
        if plan is not None and key not in seen:
            seen.add(key)
            out.append((label, plan))

    for method in METHODS:
        add(method, auto_partition(profiles, num_devices, stage_memory_bytes, method,
                                   saved_activation_bytes=saved_activation_bytes))
    for count in filling_stage_counts(stage_count(out[0][1]), num_devices):
        add(f"{count} stages", partition_with_stage_count(profiles, count, stage_memory_bytes,
                                                          saved_activation_bytes=saved_activation_bytes))
    return out


def partition_with_stage_count(
    profiles: Sequence[LayerProfile],
    num_stages: int,
    stage_memory_bytes: int | None = None,
    *,
    saved_activation_bytes: Sequence[int] | None = None,
) -> PartitionPlan | None:
    """The partition with exactly ``num_stages`` stages (forward stages other than the tail, plus the
    fused tail, plus the backward stages) whose largest stage cost is smallest.

    Used for candidates whose stage count is a multiple of the devices, so every device runs as
    many stages per step (DESIGN.md section 6). Method: the smallest candidate budget ``W`` (a
    contiguous stage sum) whose fewest stages (:func:`auto_partition`'s dynamic program, any tail)
    are at most ``num_stages``; then, for every tail within ``W`` that leaves enough layers, every
    split of the remaining count into forward and backward stages, each direction re-cut as evenly
    as possible (:func:`balanced_stage_layers`; the packed cut split further where the even cut
    breaks the memory budget); the split with the smallest largest stage cost wins (ties: the
    smaller sum of squared costs). Extra stages never raise the largest cost or the memory of a
    stage, so the result's largest cost is at most ``W``.

    Args:
        profiles: the layer sequence.
        num_stages: stages wanted, ``>= 1``.
        stage_memory_bytes: per-stage memory budget, bytes, or ``None``.
        saved_activation_bytes: as :func:`auto_partition`.

    Returns:
        A validated :class:`PartitionPlan` (``objective_s``: ``max(S, D=num_stages) x`` largest
        cost), or ``None`` when no partition has that many stages (too few layers, or too many
        needed for the memory budget).

    Raises:
        ValueError: a non-positive ``num_stages``, or as :func:`auto_partition`.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"`num_stages` must be a positive int, got {num_stages!r}.")
    profiles = list(profiles)
    if not profiles:
        raise ValueError("`profiles` is empty: the partitioner needs at least one layer.")
    budget = math.inf if stage_memory_bytes is None else stage_memory_bytes
    tab = _Tables(profiles, saved_activation_bytes)
    _check_single_layers(tab, profiles, budget)
    if num_stages > 2 * tab.L - 1:
        return None
    cands = _contiguous_sums(tab, lo=float(tab.b.max()), hi=math.inf)
    counts, _, _ = _stage_counts(tab, cands, budget, maximal_tail=False)
    fits = np.flatnonzero(counts <= num_stages)
    if not len(fits):
        return None
    W = float(cands[int(fits[0])])
    best: tuple[float, float, list[range], list[range], int] | None = None
    for t in range(tab.L - 1, -1, -1):  # tail [t, L)
        if tab.cost(t, tab.L, True) > W * (1 + _REL_TOL) or tab.mem(t, tab.L, True) > budget:
            break
        forward_min = len(_pack(tab, 0, t, W, budget, backward=False))
        backward_min = len(_pack(tab, 0, t, W, budget, backward=True))
        for forward in range(forward_min, num_stages - backward_min):
            backward = num_stages - 1 - forward
            if forward > t or backward > t or (t == 0 and num_stages != 1):
                continue
            fwd = _cut_exactly(tab, t, forward, W, budget, backward=False)
            bwd = _cut_exactly(tab, t, backward, W, budget, backward=True)
            costs = ([tab.cost(t, tab.L, True)] + [tab.cost(r.start, r.stop, False) for r in fwd]
                     + [tab.cost(r.start, r.stop, True) for r in bwd])
            key = (max(costs), sum(x * x for x in costs))
            if best is None or key < best[:2]:
                best = (*key, fwd, bwd, t)
    if best is None:
        return None
    largest, _, fwd, bwd, t = best
    tail = range(t, tab.L)
    plan = PartitionPlan(forward_stages=tuple(fwd) + (tail,), backward_stages=(tail,) + tuple(reversed(bwd)),
                         objective_s=num_stages * largest)
    return plan.validate(tab.L)
