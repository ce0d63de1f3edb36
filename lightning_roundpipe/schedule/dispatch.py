"""Which device runs each dispatch of a plan: plain round robin, or weighted by device speed and memory.

A *dispatch* is one stage run on one round of microbatches; a plan dispatches every stage once per
round, in plan order (forward stages, the fused tail, backward stages), rounds in order
(:func:`~lightning_roundpipe.schedule.roundpipe.build_roundpipe_plan`). Two rules place them
(DESIGN.md section 12):

- ``"round_robin"`` (RoundPipe paper, arXiv 2604.27085, section 3): dispatch ``i`` (counted from
  the plan's first) runs on device ``(cursor + i) mod D``. Every device gets the same share of the
  work, so on devices of unequal speed the slowest sets the pace.
- ``"weighted"``: list scheduling by earliest finish. Device ``d`` has a relative speed ``s_d`` (the
  fastest device 1.0) and a load ``L_d``, the seconds of compute assigned to it so far in this plan
  at its speed (0 at the start). The next dispatch, stage ``k`` on ``P`` microbatches, takes
  ``c_k x P / s_d`` seconds on device ``d`` (``c_k``: the stage's compute seconds per microbatch
  on a device of speed 1) and goes to the device that would finish it first, ``argmin_d L_d +
  c_k x P / s_d``, among the devices whose memory holds the stage (``stage_devices[k]``); ties
  (within a relative 1e-9) go to the first device in rotation order after the previous
  dispatch's device (after ``cursor - 1`` for the first dispatch). A device twice as fast thus
  takes about twice the stages, and over a run each device's compute is proportional to its
  speed. With equal speeds and dispatches of equal cost this is the round robin itself.

The rule sees compute only (no transfers, no data dependencies between stages): the simulator
times the plan it makes, with the same speeds, and the automatic choice keeps the round robin where
that is faster. Pure: no torch, no devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from lightning_roundpipe.schedule.plan import StageSpec

__all__ = ["DISPATCH_RULES", "DispatchPolicy", "assign_devices", "default_stage_costs"]

#: Valid values of :attr:`DispatchPolicy.rule`.
DISPATCH_RULES = ("round_robin", "weighted")
#: Backward-stage (recompute + backward) to forward-stage cost ratio per layer used when no costs are
#: known (paper section 3.2: a backward with full recomputation costs about 3x a forward).
BACKWARD_COST_RATIO = 3.0
_TIE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class DispatchPolicy:
    """How a builder places dispatches on devices, and what the simulator needs to time them.

    Attributes:
        rule: ``"round_robin"`` or ``"weighted"`` (see the module docstring).
        device_speeds: per device, its relative compute speed (finite, > 0; the fastest device 1.0),
            or ``None`` for equal devices. Kept on the plan (``plan._meta["device_speeds"]``) for
            either rule: the simulator divides each compute op's time by its device's speed.
        stage_costs: per stage (by ``stage_index``), compute seconds of one microbatch on a device of
            speed 1 (forward; or recompute + backward; or the fused tail's forward + backward);
            ``None``: :func:`default_stage_costs`. Weighted rule only.
        stage_devices: per stage (by ``stage_index``), the devices whose memory holds it (non-empty
            tuples of device indices, from
            :func:`~lightning_roundpipe.partition.devices.stage_devices`); ``None``: every device.
            Weighted rule only (the round robin places every stage on every device in turn).

    Raises:
        ValueError: an unknown ``rule`` (valid ones listed), a speed or cost that is not a finite
            number (speeds > 0, costs >= 0), an empty or out-of-range ``stage_devices`` entry, or
            ``stage_devices`` with the round robin.
    """

    rule: str = "round_robin"
    device_speeds: tuple[float, ...] | None = None
    stage_costs: tuple[float, ...] | None = None
    stage_devices: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.rule not in DISPATCH_RULES:
            raise ValueError(f"`rule` must be one of {list(DISPATCH_RULES)}, got {self.rule!r}. HINT: 'weighted'"
                             " gives faster devices more stages; 'round_robin' is the paper's dispatch.")
        if self.device_speeds is not None:
            speeds = tuple(self.device_speeds)
            if not speeds or not all(_number(v) and 0 < v < math.inf for v in speeds):
                raise ValueError(f"`device_speeds` must hold one finite number > 0 per device, got {self.device_speeds!r}."
                                 " HINT: relative speeds, the fastest device 1.0, e.g. (1.0, 0.5).")
            object.__setattr__(self, "device_speeds", tuple(float(v) for v in speeds))
        if self.stage_costs is not None:
            costs = tuple(self.stage_costs)
            if not all(_number(v) and 0 <= v < math.inf for v in costs):
                raise ValueError(f"`stage_costs` must hold finite numbers >= 0 (seconds per microbatch), got {costs!r}.")
            object.__setattr__(self, "stage_costs", tuple(float(v) for v in costs))
        if self.stage_devices is not None:
            if self.rule == "round_robin":
                raise ValueError("`stage_devices` restricts where a stage may run, which the round robin cannot honour"
                                 " (it places every stage on every device in turn). HINT: use `rule='weighted'`.")
            allowed = tuple(tuple(int(d) for d in entry) for entry in self.stage_devices)
            if any(not entry or min(entry) < 0 for entry in allowed):
                raise ValueError(f"`stage_devices` must name at least one device (index >= 0) per stage, got"
                                 f" {self.stage_devices!r}. HINT: a stage that fits no device's memory needs a finer"
                                 " partition or devices with more memory.")
            object.__setattr__(self, "stage_devices", allowed)

    def check(self, stages: Sequence[StageSpec], num_devices: int) -> None:
        """Raise ``ValueError`` when the policy does not match ``num_devices`` devices and ``stages``
        (speeds per device, costs and allowed devices per stage, device indices in range)."""
        if self.device_speeds is not None and len(self.device_speeds) != num_devices:
            raise ValueError(f"`device_speeds` has {len(self.device_speeds)} entries for {num_devices} devices."
                             " HINT: one relative speed per device.")
        need = max(s.stage_index for s in stages) + 1
        for name in ("stage_costs", "stage_devices"):
            value = getattr(self, name)
            if value is not None and len(value) < need:
                raise ValueError(f"`{name}` has {len(value)} entries but the plan has stages up to index {need - 1}."
                                 " HINT: one entry per stage, by `stage_index`.")
        if self.stage_devices is not None:
            for spec in stages:
                bad = [d for d in self.stage_devices[spec.stage_index] if d >= num_devices]
                if bad:
                    raise ValueError(f"`stage_devices` names device(s) {bad} for {spec.describe()}, but there are"
                                     f" {num_devices} devices (indices 0..{num_devices - 1}).")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def default_stage_costs(stages: Sequence[StageSpec]) -> tuple[float, ...]:
    """Per stage (by ``stage_index``), a cost when none is measured: 1 per layer of a forward stage,
    :data:`BACKWARD_COST_RATIO` per layer of a backward stage or the fused tail."""
    out = [0.0] * (max(s.stage_index for s in stages) + 1)
    for spec in stages:
        out[spec.stage_index] = len(spec.layers) * (1.0 if spec.kind == "forward" else BACKWARD_COST_RATIO)
    return tuple(out)


def assign_devices(stages: Sequence[StageSpec], num_devices: int, rounds: Sequence[range], cursor: int,
                   policy: DispatchPolicy | None = None) -> tuple[list[int], int]:
    """The device of every dispatch: each round of ``rounds`` (its microbatches) runs every stage of
    ``stages``, in plan order.

    Args:
        stages: the plan's stages, in plan order.
        num_devices: devices ``D``.
        rounds: the microbatches of each round, in order.
        cursor: round robin: device of the first dispatch; weighted: where the tie-breaking rotation
            starts (see the module docstring).
        policy: the rule (``None``: the round robin on equal devices).

    Returns:
        ``(devices, next_cursor)``: one device index per dispatch in dispatch order, and the device
        after the last dispatch's (the cursor a following plan continues from).

    Raises:
        ValueError: when ``policy`` does not match the stages and devices (:meth:`DispatchPolicy.check`).
    """
    count = len(rounds) * len(stages)
    if policy is None or policy.rule == "round_robin":
        if policy is not None:
            policy.check(stages, num_devices)
        return [(cursor + i) % num_devices for i in range(count)], (cursor + count) % num_devices
    policy.check(stages, num_devices)
    speeds = policy.device_speeds or (1.0,) * num_devices
    costs = policy.stage_costs or default_stage_costs(stages)
    everywhere = tuple(range(num_devices))
    load = [0.0] * num_devices
    previous = cursor - 1
    devices: list[int] = []
    for microbatches in rounds:
        for spec in stages:
            allowed = everywhere if policy.stage_devices is None else policy.stage_devices[spec.stage_index]
            work = costs[spec.stage_index] * len(microbatches)
            best, best_finish = -1, math.inf
            for step in range(1, num_devices + 1):  # rotation order after the previous dispatch's device
                device_index = (previous + step) % num_devices
                if device_index not in allowed:
                    continue
                finish = load[device_index] + work / speeds[device_index]
                if best < 0 or finish < best_finish - _TIE_TOLERANCE * max(abs(best_finish), 1e-300):
                    best, best_finish = device_index, finish
            load[best] = best_finish
            devices.append(best)
            previous = best
    return devices, (previous + 1) % num_devices
