"""Iterations as sequences of plans: RoundPipe's microbatch rounds and back-to-back iterations.

Pure data plumbing for :func:`lightning_roundpipe.simulate.simulate` (no torch, no devices).
"""

from __future__ import annotations

from typing import Sequence

from lightning_roundpipe.schedule.ir import Action, ActionKind
from lightning_roundpipe.schedule.plan import ExecutionPlan, StageSpec
from lightning_roundpipe.schedule.roundpipe import build_roundpipe_plan, plan_next_cursor

__all__ = ["roundpipe_rounds"]

_Node = tuple[int, Action]  # (plan index, action)


def roundpipe_rounds(stages: Sequence[StageSpec], num_devices: int, num_microbatches: int, cursor: int = 0,
                     prefetch: bool = True) -> list[ExecutionPlan]:
    """One RoundPipe iteration as microbatch rounds: ``ceil(M / D)`` plans of at most ``D``
    microbatches each, every round starting where the previous one's rotation stopped (paper
    section 3: the next round is dispatched from the first device to become free).

    Raises:
        ValueError: from :func:`build_roundpipe_plan` (bad ``num_devices``, ``num_microbatches``).
    """
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"`num_microbatches` must be a positive int, got {num_microbatches!r}.")
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"`num_devices` must be a positive int, got {num_devices!r}.")
    out: list[ExecutionPlan] = []
    built: dict[int, ExecutionPlan] = {}
    left = num_microbatches
    while left > 0:
        m = min(num_devices, left)
        if m not in built:
            built[m] = build_roundpipe_plan(stages, num_devices, m, cursor=0, prefetch=prefetch)
            built[m]._meta["cursor"] = 0
        out.append(_rotated(built[m], cursor))
        cursor = plan_next_cursor(out[-1])
        left -= m
    return out


def _iteration_plans(rounds: list[ExecutionPlan], n: int) -> list[ExecutionPlan]:
    """``n`` consecutive iterations of ``rounds``: RoundPipe plans continue their rotation (cursor
    carried over); bound plans repeat."""
    cursor = rounds[-1]._meta.get("next_cursor")
    if n == 1 or cursor is None or any(p._meta.get("weight_binding") for p in rounds):
        return rounds * n
    for p in rounds:
        if "cursor" not in p._meta:  # a plan straight from build_roundpipe_plan: recover its cursor
            p._meta["cursor"] = (p._meta["next_cursor"] - len(p.stages)) % p.num_devices
    plans = list(rounds)
    for _ in range(n - 1):
        for p in rounds:
            plans.append(_rotated(p, cursor))
            cursor = plans[-1]._meta["next_cursor"]
    return plans


def _rotated(plan: ExecutionPlan, cursor: int) -> ExecutionPlan:
    """``plan`` (from ``build_roundpipe_plan``) as if built with ``cursor``: the round robin puts stage
    ``k`` on device ``(cursor + k) mod D``, so the device lists just rotate (and stay valid)."""
    n_dev = plan.num_devices
    shift = (cursor - plan._meta["cursor"]) % n_dev
    acts = tuple(plan.actions[(d - shift) % n_dev] for d in range(n_dev))
    out = ExecutionPlan(plan.stages, acts, plan.num_microbatches, plan.max_resident_stages)
    out._meta.update(cursor=cursor, next_cursor=(cursor + len(plan.stages)) % n_dev)
    return out


def _concatenate(plans: list[ExecutionPlan]) -> list[list[_Node]]:
    """Per-device lists of all rounds/iterations back to back. With prefetch (double buffering), the
    first ``LOAD`` of a plan moves up to just before the previous plan's last stage on that device,
    so it is prefetched while that stage computes."""
    n_dev = plans[0].num_devices
    out: list[list[_Node]] = [[] for _ in range(n_dev)]
    for it, p in enumerate(plans):
        hoist = p.max_resident_stages >= 2 and not p._meta.get("weight_binding")
        for d in range(n_dev):
            acts = [(it, a) for a in p.actions[d]]
            cur = out[d]
            computes = [k for k, (_, a) in enumerate(cur) if a.kind.is_compute]
            if hoist and computes and acts and acts[0][1].kind is ActionKind.LOAD:
                last_it, last = cur[computes[-1]]
                first = min(k for k in computes if cur[k][0] == last_it and cur[k][1].stage_index == last.stage_index)
                cur.insert(first, acts.pop(0))
            cur.extend(acts)
    return out
