"""The RoundPipe round-robin plan (paper section 3, "round-robin dispatch").

Stages are ordered forward stages first (in layer order), then backward stages (last layers first,
the tail first). Stage ``k`` of that order runs on device ``(cursor + k) mod D``; a device runs its
stage for every microbatch before it takes its next stage. No stage is bound to a device (no weight
binding), so the cursor carries over between calls: the next plan starts where this one stopped.
"""

from __future__ import annotations

from typing import Sequence

from lightning_roundpipe.schedule.ir import Action, ActionKind
from lightning_roundpipe.schedule.plan import ExecutionPlan, StageSpec


def default_stage_ranges(
    num_layers: int, forward_layers_per_stage: int = 3, backward_layers_per_stage: int = 1
) -> tuple[tuple[range, ...], tuple[range, ...]]:
    """The simple asymmetric partition: forward stages of ``forward_layers_per_stage`` layers,
    backward stages of ``backward_layers_per_stage`` layers (the tail, the last layer, first).

    A backward stage with recomputation costs about 3x a forward (paper section 3.2), hence 3:1.

    Returns:
        ``(forward_stages, backward_stages)``: ascending ranges, and ranges in execution order.

    Raises:
        ValueError: for a non-positive ``num_layers`` or stage size.
    """
    for name, v in (("num_layers", num_layers), ("forward_layers_per_stage", forward_layers_per_stage),
                    ("backward_layers_per_stage", backward_layers_per_stage)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"`{name}` must be a positive int, got {v!r}.")
    fwd = tuple(range(i, min(i + forward_layers_per_stage, num_layers)) for i in range(0, num_layers, forward_layers_per_stage))
    bwd = []
    stop = num_layers
    while stop > 0:
        start = max(0, stop - backward_layers_per_stage)
        bwd.append(range(start, stop))
        stop = start
    return fwd, tuple(bwd)


def build_stages(
    forward_stages: Sequence[range], backward_stages: Sequence[range], fused_tail: bool = False
) -> tuple[StageSpec, ...]:
    """Stage specs in plan order: forward stages (ascending), then backward stages (execution order).

    With ``fused_tail`` the first backward stage is the fused tail and the forward stages stop
    before it (its layers are never run by a forward stage).
    """
    specs = [StageSpec(i, "forward", r) for i, r in enumerate(forward_stages)]
    for j, r in enumerate(backward_stages):
        specs.append(StageSpec(len(specs), "backward", r, fused=fused_tail and j == 0))
    return tuple(specs)


def build_roundpipe_plan(
    stages: Sequence[StageSpec],
    num_devices: int,
    num_microbatches: int,
    cursor: int = 0,
    prefetch: bool = True,
    microbatches_per_round: int | None = None,
) -> ExecutionPlan:
    """Build and validate the round-robin plan.

    Args:
        stages: from :func:`build_stages`, in plan order.
        num_devices: number of devices ``D`` (>= 1).
        num_microbatches: microbatches ``M`` per step (>= 1); each device runs its stage's
            microbatches in ascending order.
        cursor: device of stage 0; pass the previous plan's ``next_cursor`` to continue the rotation.
        prefetch: issue ``LOAD`` of a device's next stage before computing its current one (double
            buffering: at most two stages resident per device).
        microbatches_per_round: dispatch the microbatches in rounds of at most this many (paper
            section 3 and its artifact: rounds of ``D``): round ``r`` runs every stage on
            microbatches ``r * P .. r * P + P - 1``, stage ``k`` of round ``r`` on device
            ``(cursor + r * S + k) mod D`` (``S`` stages), so the rotation simply continues and the
            next round starts on the first device to become free. ``None``: one round of all
            ``M`` (every stage is loaded once per step). ``K`` training steps back to back without
            an optimizer barrier are the same plan with ``K * M`` microbatches in rounds of ``M``
            (or fewer).

    Returns:
        A validated :class:`ExecutionPlan`; ``plan_next_cursor(plan)`` gives the cursor for the next call.

    Raises:
        ValueError: for ``num_devices``, ``num_microbatches`` or ``microbatches_per_round`` below 1,
            or an empty ``stages``.
    """
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"`num_devices` must be a positive int, got {num_devices!r}.")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"`num_microbatches` must be a positive int, got {num_microbatches!r}.")
    if microbatches_per_round is not None and (not isinstance(microbatches_per_round, int)
                                               or isinstance(microbatches_per_round, bool) or microbatches_per_round < 1):
        raise ValueError(f"`microbatches_per_round` must be a positive int or None (one round), got {microbatches_per_round!r}.")
    if not stages:
        raise ValueError("`stages` is empty: a plan needs at least one stage.")
    per_round = microbatches_per_round or num_microbatches
    # dispatches in execution order: (stage, microbatches of its round), device of each
    per_device: list[list[tuple[StageSpec, range]]] = [[] for _ in range(num_devices)]
    slot = cursor
    for first in range(0, num_microbatches, per_round):
        mbs = range(first, min(first + per_round, num_microbatches))
        for spec in stages:
            per_device[slot % num_devices].append((spec, mbs))
            slot += 1
    actions: list[tuple[Action, ...]] = []
    for dispatches in per_device:
        acts: list[Action] = []
        loaded = False  # whether the current dispatch's LOAD is already listed (prefetched)
        for i, (spec, mbs) in enumerate(dispatches):
            if not loaded:
                acts.append(Action(spec.stage_index, ActionKind.LOAD))
            nxt = dispatches[i + 1][0] if i + 1 < len(dispatches) else None
            # prefetch the next dispatch, unless it is the same stage again (a later round on this device)
            loaded = prefetch and nxt is not None and nxt.stage_index != spec.stage_index
            if loaded:
                acts.append(Action(nxt.stage_index, ActionKind.LOAD))
            acts.extend(Action(spec.stage_index, spec.compute_kind, m) for m in mbs)
            acts.append(Action(spec.stage_index, ActionKind.DROP))
        actions.append(tuple(acts))
    plan = ExecutionPlan(tuple(stages), tuple(actions), num_microbatches, max_resident_stages=2 if prefetch else 1)
    plan._meta["next_cursor"] = slot % num_devices
    plan._meta["cursor"] = cursor % num_devices
    plan._meta["builder"] = dict(stages=tuple(stages), num_devices=num_devices, num_microbatches=num_microbatches,
                                 cursor=cursor, prefetch=prefetch, microbatches_per_round=microbatches_per_round)
    return plan.validate()


def plan_next_cursor(plan: ExecutionPlan) -> int:
    """Device on which the stage after ``plan``'s last stage would run (the carried-over cursor)."""
    return plan._meta["next_cursor"]
