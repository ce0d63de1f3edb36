"""`ExecutionPlan`: per-device action lists plus the stage specs they refer to.

A plan is pure data. The runtime executes it action by action in list order on each device
(never reordering); the simulator times the same lists with a cost model. ``validate()`` checks
that a plan can run at all, and ``format_grid()`` prints it as a device-by-step grid (used in every
validation error, like ``torch.distributed.pipelining``'s schedule printout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

from lightning_roundpipe.schedule.ir import Action, ActionKind

StageKind = Literal["forward", "backward"]


class PlanValidationError(ValueError):
    """A plan that cannot run as written. The message ends with the plan's grid."""


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: a run of consecutive layers of the layer sequence.

    Attributes:
        stage_index: position in :attr:`ExecutionPlan.stages`; forward stages come first (in layer
            order), then backward stages in execution order (last layers first).
        kind: ``"forward"`` or ``"backward"``.
        layers: indices of the layers the stage covers (ascending ``range``, step 1).
        fused: ``True`` for the fused tail: the first backward stage runs forward, loss and backward
            of its layers in one action (kind ``X``) and is never recomputed (paper section 3).
    """

    stage_index: int
    kind: StageKind
    layers: range
    fused: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("forward", "backward"):
            raise ValueError(f"`kind` must be 'forward' or 'backward', got {self.kind!r}.")
        if len(self.layers) == 0 or self.layers.step != 1:
            raise ValueError(f"Stage {self.stage_index} needs a non-empty step-1 `layers` range, got {self.layers!r}.")
        if self.fused and self.kind != "backward":
            raise ValueError(f"Stage {self.stage_index}: only a backward stage can be `fused`.")

    @property
    def compute_kind(self) -> ActionKind:
        """The compute action kind this stage runs: F, X or B."""
        if self.kind == "forward":
            return ActionKind.F
        return ActionKind.X if self.fused else ActionKind.B

    def describe(self) -> str:
        tag = "fused" if self.fused else self.kind
        return f"stage {self.stage_index} ({tag}, layers {self.layers.start}..{self.layers.stop - 1})"


@dataclass(frozen=True)
class ExecutionPlan:
    """Per-device action lists over a set of stages.

    Attributes:
        stages: the :class:`StageSpec` s, indexed by ``stage_index``.
        actions: ``actions[device_index]`` is that device's ordered action list.
        num_microbatches: microbatches per step; every compute stage runs each one exactly once.
        max_resident_stages: most stages whose weights a device may hold at once (2: double buffering,
            the next stage is prefetched while the current one computes).
    """

    stages: tuple[StageSpec, ...]
    actions: tuple[tuple[Action, ...], ...]
    num_microbatches: int
    max_resident_stages: int = 2
    _meta: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_devices(self) -> int:
        return len(self.actions)

    @property
    def forward_stages(self) -> tuple[StageSpec, ...]:
        return tuple(s for s in self.stages if s.kind == "forward")

    @property
    def backward_stages(self) -> tuple[StageSpec, ...]:
        return tuple(s for s in self.stages if s.kind == "backward")

    def device_of(self, stage_index: int) -> int:
        """The device whose list holds ``stage_index``'s first compute action (its first round).

        Raises:
            KeyError: the stage has no compute action in the plan.
        """
        cache = self._meta.setdefault("device_of", {})
        if not cache:
            for d, acts in enumerate(self.actions):
                for a in acts:
                    if a.kind.is_compute:
                        cache.setdefault(a.stage_index, d)
        return cache[stage_index]

    def phase(self, kind: StageKind) -> "ExecutionPlan":
        """The sub-plan holding only the actions of ``kind`` stages (same stage indices).

        The transparent autograd path runs ``phase("forward")`` inside the model's forward call and
        ``phase("backward")`` when autograd reaches the pipeline's node.
        """
        keep = {s.stage_index for s in self.stages if s.kind == kind}
        acts = tuple(tuple(a for a in dev if a.stage_index in keep) for dev in self.actions)
        out = ExecutionPlan(self.stages, acts, self.num_microbatches, self.max_resident_stages)
        # the devices' speeds (timed by the simulator) and where stages may run (sizes the weight pools)
        out._meta.update({k: self._meta[k] for k in ("dispatch_rule", "device_speeds", "stage_devices") if k in self._meta})
        return out

    # ------------------------------------------------------------------ dependencies
    def dependencies(self, action: Action) -> tuple[Action, ...]:
        """Compute actions on other stages that must finish before ``action`` may start.

        Forward stage ``s`` (``s > 0``) needs ``F(s-1, m)``. The first backward stage needs the last
        forward of the same microbatch (when the plan has forward stages); later backward stages need
        the previous backward stage's gradient for the same microbatch. A ``W`` (weight-gradient
        backward, zero-bubble baselines) needs the ``B`` of its own stage and microbatch.
        ``LOAD``/``DROP`` have no cross-device dependencies (their order on the device list is their
        constraint).
        """
        if not action.kind.is_compute:
            return ()
        spec = self.stages[action.stage_index]
        m = action.microbatch_index
        if action.kind is ActionKind.W:
            return (Action(spec.stage_index, spec.compute_kind, m),)
        fwd, bwd = self.forward_stages, self.backward_stages
        if spec.kind == "forward":
            pos = fwd.index(spec)
            return () if pos == 0 else (Action(fwd[pos - 1].stage_index, ActionKind.F, m),)
        pos = bwd.index(spec)
        if pos == 0:
            return (Action(fwd[-1].stage_index, ActionKind.F, m),) if fwd and self._has_stage(fwd[-1]) else ()
        prev = bwd[pos - 1]
        return (Action(prev.stage_index, prev.compute_kind, m),)

    def _has_stage(self, spec: StageSpec) -> bool:
        return any(a.stage_index == spec.stage_index for dev in self.actions for a in dev)

    # ------------------------------------------------------------------ validation
    def validate(self) -> "ExecutionPlan":
        """Check the plan; return it unchanged when it is valid.

        Checks: stage indices match positions; forward stages tile layers ``0..L-1`` in order and
        backward stages tile the same layers from the end (when both are present); every
        (stage, microbatch) runs exactly once with the stage's compute kind; each stage's compute
        sits between a ``LOAD`` and a ``DROP`` of that stage on its device (a stage may be dispatched
        again, to any device, in a later microbatch round); no device holds more
        than ``max_resident_stages`` stages at once; and the data dependencies can be met (no deadlock
        when every device walks its list in order).

        Raises:
            PlanValidationError: with every problem found and the plan's grid.
        """
        problems = self._structural_problems()
        if not problems:
            try:
                walk_in_order(self, lambda a: 1.0)
            except PlanValidationError as e:
                problems.append(str(e))
        if problems:
            raise PlanValidationError(
                "Invalid execution plan:\n  - " + "\n  - ".join(problems) + "\n" + self.format_grid(aligned=False)
            )
        return self

    def _structural_problems(self) -> list[str]:
        problems: list[str] = []
        for i, s in enumerate(self.stages):
            if s.stage_index != i:
                problems.append(f"stage at position {i} has `stage_index` {s.stage_index}")
        if problems:
            return problems
        fwd, bwd = self.forward_stages, self.backward_stages
        if fwd:
            problems += _tiling_problems([s.layers for s in fwd], "forward")
        if bwd:
            problems += _tiling_problems([s.layers for s in reversed(bwd)], "backward")
            # A fused tail runs its layers' forward itself, so the forward stages may stop before it.
            ends = {bwd[0].layers.stop} | ({bwd[0].layers.start} if bwd[0].fused else set())
            if fwd and fwd[-1].layers.stop not in ends:
                problems.append("backward stages must end at the same last layer as the forward stages"
                                " (or, with a fused tail, the forward stages must stop where the tail starts)")
        if any(s.fused for s in bwd[1:]):
            problems.append("only the first backward stage may be the fused tail")
        if self.num_microbatches < 1:
            problems.append(f"`num_microbatches` must be >= 1, got {self.num_microbatches}")
        seen: dict[tuple[int, int], int] = {}
        for d, acts in enumerate(self.actions):
            resident: list[int] = []
            peak = 0
            for a in acts:
                if a.stage_index >= len(self.stages):
                    problems.append(f"device {d}: `{a}` names unknown stage {a.stage_index}")
                    continue
                spec = self.stages[a.stage_index]
                if a.kind is ActionKind.LOAD:
                    if a.stage_index in resident:
                        problems.append(f"device {d}: stage {a.stage_index} loaded again while it is resident")
                    resident.append(a.stage_index)
                    peak = max(peak, len(resident))
                elif a.kind is ActionKind.DROP:
                    if a.stage_index not in resident:
                        problems.append(f"device {d}: `{a}` releases weights that are not loaded")
                    else:
                        resident.remove(a.stage_index)
                else:
                    if a.kind is not spec.compute_kind and a.kind is not ActionKind.W:
                        problems.append(f"device {d}: `{a}` has kind {a.kind.value}; {spec.describe()} runs {spec.compute_kind.value}")
                    if a.stage_index not in resident:
                        problems.append(f"device {d}: `{a}` runs without its weights loaded (no `{a.stage_index}LOAD` before it)")
                    if a.microbatch_index >= self.num_microbatches:
                        problems.append(f"device {d}: `{a}` microbatch out of range 0..{self.num_microbatches - 1}")
                    key = (a.stage_index, a.microbatch_index)
                    if a.kind is not ActionKind.W:
                        seen[key] = seen.get(key, 0) + 1
            for s in resident:
                problems.append(f"device {d}: stage {s} is loaded but never released (no `{s}DROP`)")
            if peak > self.max_resident_stages:
                problems.append(f"device {d}: holds {peak} stages at once, more than `max_resident_stages`={self.max_resident_stages}")
        present = {a.stage_index for acts in self.actions for a in acts}
        for s in self.stages:
            if s.stage_index not in present:
                continue
            for m in range(self.num_microbatches):
                n = seen.get((s.stage_index, m), 0)
                if n != 1:
                    problems.append(f"{s.describe()} microbatch {m} runs {n} times (expected exactly once)")
        return problems

    # ------------------------------------------------------------------ printing
    def format_grid(self, aligned: bool = True, compute_only: bool | None = None) -> str:
        """The plan as a grid: one row per step, one column per device.

        Args:
            aligned: place each compute action at the unit-time step it would start at when every
                compute takes one step (bubbles show as empty cells); ``False`` lists the raw
                per-device lists side by side (always possible, also for a plan that deadlocks).
            compute_only: hide ``LOAD``/``DROP``; defaults to ``aligned``.
        """
        compute_only = aligned if compute_only is None else compute_only
        columns: list[dict[int, str]] = [dict() for _ in self.actions]
        if aligned:
            timeline = walk_in_order(self, lambda a: 1.0 if a.kind.is_compute else 0.0)
            for d, a, start, _ in timeline:
                if a.kind.is_compute:
                    columns[d][int(round(start))] = str(a)
        else:
            for d, acts in enumerate(self.actions):
                shown = [a for a in acts if a.kind.is_compute or not compute_only]
                columns[d] = {i: str(a) for i, a in enumerate(shown)}
        n_steps = max((max(c) + 1 for c in columns if c), default=0)
        width = max([len(v) for c in columns for v in c.values()] + [len(f"dev{len(columns) - 1}")])
        header = "step | " + " ".join(f"dev{d}".ljust(width) for d in range(len(columns)))
        lines = [header, "-" * len(header)]
        for t in range(n_steps):
            lines.append(f"{t:4d} | " + " ".join(c.get(t, "").ljust(width) for c in columns))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_grid()


def tiling_gap(ranges: Sequence[range]) -> tuple[int, int] | None:
    """Where ``ranges`` stop tiling consecutive layers from layer 0.

    Returns:
        ``(position, expected_start)`` of the first entry that is not a non-empty step-1 ``range``
        starting where the previous one stopped; ``None`` when they tile ``0..ranges[-1].stop - 1``.
    """
    expect = 0
    for i, r in enumerate(ranges):
        if not isinstance(r, range) or r.step != 1 or len(r) == 0 or r.start != expect:
            return i, expect
        expect = r.stop
    return None


def _tiling_problems(ranges: Sequence[range], what: str) -> list[str]:
    gap = tiling_gap(ranges)
    if gap is None:
        return []
    r = ranges[gap[0]]
    return [f"{what} stages do not tile the layers: expected a stage starting at layer {gap[1]}, got {r.start}..{r.stop - 1}"]


def walk_in_order(plan: ExecutionPlan, duration_s) -> list[tuple[int, Action, float, float]]:
    """List-order execution of ``plan`` with ``duration_s(action)`` per action and free transfers.

    Each device runs its actions strictly in list order; an action starts when the device is free
    and its :meth:`ExecutionPlan.dependencies` have finished. Returns ``(device_index, action,
    start_s, end_s)`` tuples in completion order.

    Raises:
        PlanValidationError: when the dependencies can never be met (deadlock), naming the blocked
            actions.
    """
    done_at: dict[Action, float] = {}
    pos = [0] * plan.num_devices
    free_at = [0.0] * plan.num_devices
    out: list[tuple[int, Action, float, float]] = []
    remaining = sum(len(a) for a in plan.actions)
    while remaining:
        progressed = False
        for d, acts in enumerate(plan.actions):
            while pos[d] < len(acts):
                a = acts[pos[d]]
                deps = plan.dependencies(a)
                if any(dep not in done_at for dep in deps):
                    break
                start = max([free_at[d]] + [done_at[dep] for dep in deps])
                end = start + float(duration_s(a))
                done_at[a] = end
                free_at[d] = end
                out.append((d, a, start, end))
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = [f"dev{d}: `{acts[pos[d]]}` waits for {list(map(str, plan.dependencies(acts[pos[d]])))}"
                       for d, acts in enumerate(plan.actions) if pos[d] < len(acts)]
            raise PlanValidationError("deadlock: no device can make progress; " + "; ".join(blocked))
    return out


# The plan's dispatches and producers (read by the lowering passes, `StreamProgram.validate`, the runtime and
# the simulator; re-exported by lower.py).


@dataclass
class Dispatch:
    """One residency of one stage on one device: from its ``LOAD`` to its ``DROP`` in the plan.

    Attributes:
        device_index: the device.
        stage_index: the stage.
        round_index: which dispatch of this stage (microbatch round, by first microbatch).
        load_position: position of the ``LOAD`` in the device's plan list.
        room: ``(stage_index, round_index)`` of the last dispatch the device released before this
            ``LOAD`` (its ``DROP`` frees the room), ``None`` if none.
        computes: the dispatch's compute actions, in the device's order.
    """

    device_index: int
    stage_index: int
    round_index: int
    load_position: int
    room: tuple[int, int] | None
    computes: list[Action] = field(default_factory=list)


def plan_dispatches(plan: ExecutionPlan) -> list[Dispatch]:
    """Every dispatch of ``plan``, device by device in list order (cached on the plan)."""
    cached = plan._meta.get("_dispatches")
    if cached is not None:
        return cached
    out: list[Dispatch] = []
    for device_index, actions in enumerate(plan.actions):
        open_: dict[int, Dispatch] = {}
        last_drop: Dispatch | None = None
        for position, action in enumerate(actions):
            if action.kind is ActionKind.LOAD:
                room = None if last_drop is None else (last_drop.stage_index, id(last_drop))
                open_[action.stage_index] = Dispatch(device_index, action.stage_index, -1, position, room)
                out.append(open_[action.stage_index])
            elif action.kind is ActionKind.DROP:
                last_drop = open_.pop(action.stage_index)
            else:
                open_[action.stage_index].computes.append(action)
    by_stage: dict[int, list[Dispatch]] = {}
    for dispatch in out:
        by_stage.setdefault(dispatch.stage_index, []).append(dispatch)
    for dispatches in by_stage.values():
        dispatches.sort(key=lambda x: min((a.microbatch_index for a in x.computes), default=-1))
        for r, dispatch in enumerate(dispatches):
            dispatch.round_index = r
    rounds = {id(x): x.round_index for x in out}
    for dispatch in out:
        if dispatch.room is not None:
            dispatch.room = (dispatch.room[0], rounds[dispatch.room[1]])
    plan._meta["_dispatches"] = out
    return out


def _present(plan: ExecutionPlan) -> set[int]:
    got = plan._meta.get("_present")
    if got is None:
        got = plan._meta["_present"] = {a.stage_index for acts in plan.actions for a in acts if a.kind.is_compute}
    return got


def input_producer(plan: ExecutionPlan, stage_index: int) -> int | None:
    """The stage whose ``F`` produces the input of ``stage_index``'s ``F``/``X``/``R``; ``None`` when
    the input comes from the host (the batch, or boundaries saved by an earlier program)."""
    table = plan._meta.setdefault("_input_producer", {})
    if stage_index not in table:
        table[stage_index] = _input_producer(plan, stage_index)
    return table[stage_index]


def _input_producer(plan: ExecutionPlan, stage_index: int) -> int | None:
    spec = plan.stages[stage_index]
    present = _present(plan)
    forward = [s for s in plan.forward_stages if s.stage_index in present]
    if spec.kind == "forward":
        earlier = [s for s in forward if s.layers.stop == spec.layers.start]
        return earlier[0].stage_index if earlier else None
    start = spec.layers.start
    if start == 0:
        return None
    holder = [s for s in forward if s.layers.start < start <= s.layers.stop]
    return holder[0].stage_index if holder else None


def gradient_producer(plan: ExecutionPlan, stage_index: int) -> int | None:
    """The stage whose download the gradient upload of ``stage_index``'s ``B`` waits for: the previous
    backward stage (its ``X``/``B``); for the first backward stage, the last forward stage when the
    program runs it too (the host turns that output into the loss gradient), else ``None`` (the
    gradient comes from the host, e.g. the transparent path's backward program)."""
    table = plan._meta.setdefault("_gradient_producer", {})
    if stage_index not in table:
        table[stage_index] = _gradient_producer(plan, stage_index)
    return table[stage_index]


def _gradient_producer(plan: ExecutionPlan, stage_index: int) -> int | None:
    backward = plan.backward_stages
    position = [s.stage_index for s in backward].index(stage_index)
    if position == 0:
        # the host computes the loss gradient from the last forward output: in a program that also
        # runs the forward stages (not fused), the upload waits for that output's download
        present = [s for s in plan.forward_stages if s.stage_index in _present(plan)]
        ends = [s for s in present if s.layers.stop == plan.stages[stage_index].layers.stop]
        return ends[0].stage_index if ends else None
    if backward[position - 1].stage_index not in _present(plan):
        return None
    return backward[position - 1].stage_index
