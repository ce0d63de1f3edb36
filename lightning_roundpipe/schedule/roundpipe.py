"""The RoundPipe round-robin plan (paper section 3, "round-robin dispatch").

Stages are ordered forward stages first (in layer order), then backward stages (last layers first,
the tail first). Stage ``k`` of that order runs on device ``(cursor + k) mod D``; a device runs its
stage for every microbatch before it takes its next stage. No stage is bound to a device (no weight
binding), so the cursor carries over between calls: the next plan starts where this one stopped.
:func:`build_steady_state_plan` builds K consecutive iterations as one plan (the steady state,
DESIGN.md section 11), with the rotation continuing from one iteration to the next. On devices of
unequal speed or memory both builders take a weighted dispatch instead of the rotation
(:mod:`~lightning_roundpipe.schedule.dispatch`, DESIGN.md section 12): the same plan shape, each
stage on the device that would finish it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_roundpipe.schedule.dispatch import DispatchPolicy, assign_devices
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
    dispatch: DispatchPolicy | None = None,
) -> ExecutionPlan:
    """Build and validate the round-robin plan (or, with a weighted ``dispatch``, its weighted variant).

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
            ``M`` (every stage is loaded once per step). ``K`` training steps back to back are
            :func:`build_steady_state_plan`.
        dispatch: which device runs each dispatch (stage and round) and the devices' relative
            speeds (:class:`~lightning_roundpipe.schedule.dispatch.DispatchPolicy`): ``None`` or the
            ``"round_robin"`` rule place stage ``k`` of round ``r`` as above; the ``"weighted"`` rule
            by earliest finish given each device's speed and load, only on devices whose memory
            holds the stage, ``cursor`` breaking ties. ``plan._meta["device_speeds"]`` (the
            simulator's per-device speeds) and ``plan._meta["stage_devices"]`` come from it.

    Returns:
        A validated :class:`ExecutionPlan`; ``plan_next_cursor(plan)`` gives the cursor for the next call.

    Raises:
        ValueError: for ``num_devices``, ``num_microbatches`` or ``microbatches_per_round`` below 1,
            an empty ``stages``, or a ``dispatch`` that does not match the stages and devices.
    """
    _check_builder_args(stages, num_devices, num_microbatches, microbatches_per_round)
    per_round = microbatches_per_round or num_microbatches
    rounds = [range(first, min(first + per_round, num_microbatches)) for first in range(0, num_microbatches, per_round)]
    actions, next_cursor = _dispatch(stages, num_devices, rounds, cursor, prefetch, dispatch)
    plan = ExecutionPlan(tuple(stages), actions, num_microbatches, max_resident_stages=2 if prefetch else 1)
    plan._meta.update(_policy_meta(dispatch), next_cursor=next_cursor, cursor=cursor % num_devices)
    plan._meta["builder"] = dict(stages=tuple(stages), num_devices=num_devices, num_microbatches=num_microbatches,
                                 cursor=cursor, prefetch=prefetch, microbatches_per_round=microbatches_per_round,
                                 dispatch=dispatch)
    return plan.validate()


#: Optimizer modes of a steady-state plan (``RoundPipeStrategy(optimizer=...)``).
OPTIMIZER_MODES = ("sync", "async")


@dataclass(frozen=True)
class SteadyState:
    """How the iterations of a steady-state plan (:func:`build_steady_state_plan`) relate: pure data,
    in ``plan._meta["steady_state"]``.

    An *iteration* is one training batch (one forward call of ``M`` microbatches); an optimizer
    *step* applies the gradients of ``accumulate_grad_batches`` consecutive iterations (a window).
    Iteration ``k``'s local microbatch ``m`` is the plan's microbatch ``k * M + m``.

    Attributes:
        num_iterations: iterations ``K`` in the plan (>= 1).
        microbatches_per_iteration: ``M`` (>= 1).
        optimizer: ``"sync"`` (Lightning's exact semantics: the iterations of window ``w + 1``
            upload weights, and start at all, only after optimizer step ``w``) or ``"async"`` (the
            paper's one-step-stale weights, section 4: window ``w + 1`` needs only optimizer step
            ``w - 1``, so its forward stages run while window ``w`` drains and step ``w`` runs on
            the host).
        accumulate_grad_batches: iterations per optimizer step (>= 1); inside a window the
            weights do not change, so iteration ``i + 1``'s forward stages may run during
            iteration ``i``'s backward stages in either mode.
    """

    num_iterations: int
    microbatches_per_iteration: int
    optimizer: str = "async"
    accumulate_grad_batches: int = 1

    def __post_init__(self) -> None:
        for name in ("num_iterations", "microbatches_per_iteration", "accumulate_grad_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
        if self.optimizer not in OPTIMIZER_MODES:
            raise ValueError(f"`optimizer` must be one of {list(OPTIMIZER_MODES)}, got {self.optimizer!r}. HINT: 'sync'"
                             " drains before every optimizer step; 'async' uses one-step-stale weights.")

    @property
    def weight_staleness(self) -> int:
        """Optimizer steps the weights a window uploads may lag behind: 0 (sync) or 1 (async)."""
        return 1 if self.optimizer == "async" else 0

    @property
    def num_steps(self) -> int:
        """Optimizer steps in the plan: one per complete window."""
        return self.num_iterations // self.accumulate_grad_batches

    def iteration_of(self, microbatch_index: int) -> int:
        """The iteration a plan microbatch belongs to."""
        return microbatch_index // self.microbatches_per_iteration

    def local_microbatch(self, microbatch_index: int) -> int:
        """The microbatch's index inside its iteration (``0..M-1``)."""
        return microbatch_index % self.microbatches_per_iteration

    def step_of(self, iteration: int) -> int:
        """The optimizer step (window) whose gradients ``iteration`` contributes to."""
        return iteration // self.accumulate_grad_batches

    def iterations_of_step(self, step_index: int) -> range:
        """The iterations whose gradients optimizer step ``step_index`` applies."""
        return range(step_index * self.accumulate_grad_batches, (step_index + 1) * self.accumulate_grad_batches)

    def weights_after_step(self, iteration: int) -> int | None:
        """The optimizer step whose result ``iteration`` uploads (its weight uploads wait for that
        step): ``step_of(iteration) - 1 - weight_staleness``; ``None`` for the first windows."""
        step = self.step_of(iteration) - 1 - self.weight_staleness
        return step if step >= 0 else None


def build_steady_state_plan(
    stages: Sequence[StageSpec],
    num_devices: int,
    num_microbatches: int,
    num_iterations: int,
    *,
    optimizer: str = "async",
    accumulate_grad_batches: int = 1,
    cursor: int = 0,
    prefetch: bool = True,
    microbatches_per_round: int | None = None,
    validate: bool = True,
    dispatch: DispatchPolicy | None = None,
) -> ExecutionPlan:
    """``num_iterations`` consecutive training iterations as one round-robin plan (DESIGN.md
    section 11; paper section 4).

    The same stages run every iteration (one stage spec each, shared). Iteration ``k`` runs the
    plan's microbatches ``k * M .. k * M + M - 1`` (:meth:`SteadyState.iteration_of`) in its own
    rounds of ``microbatches_per_round`` (a round never holds two iterations), and the rotation
    continues: iteration ``k + 1``'s first forward stage goes to the device after iteration
    ``k``'s last dispatch, so on each device's list it follows that device's last stage of
    iteration ``k``; its forward stages fill the devices iteration ``k``'s drain leaves idle as far
    as the weights allow. The plan itself holds only data dependencies (per microbatch); which
    optimizer step an iteration's weight uploads wait for is the mode's rule
    (:class:`SteadyState`, in ``plan._meta["steady_state"]``), which
    :func:`~lightning_roundpipe.schedule.steady.lower_steady_state` turns into ``OPT`` ops and edges.

    Args:
        stages: from :func:`build_stages`, in plan order.
        num_devices: devices ``D`` (>= 1).
        num_microbatches: microbatches ``M`` per iteration (>= 1).
        num_iterations: iterations ``K`` (>= 1).
        optimizer: ``"sync"`` or ``"async"`` (see :class:`SteadyState`).
        accumulate_grad_batches: iterations per optimizer step (>= 1).
        cursor: device of iteration 0's stage 0.
        prefetch: as :func:`build_roundpipe_plan`.
        microbatches_per_round: rounds of at most this many microbatches inside each iteration
            (``None``: one round per iteration).
        validate: run :meth:`ExecutionPlan.validate` (the simulator's hot path skips it; the
            builder's plans are validated by the tests for every shape it builds).
        dispatch: as :func:`build_roundpipe_plan` (the weighted rule's device loads carry on from
            one iteration to the next).

    Returns:
        An :class:`ExecutionPlan` of ``K * M`` microbatches (validated unless ``validate=False``);
        ``plan._meta["steady_state"]``
        is its :class:`SteadyState`, ``plan_next_cursor(plan)`` the cursor after iteration ``K - 1``.

    Raises:
        ValueError: as :func:`build_roundpipe_plan`, or a bad ``num_iterations``, ``optimizer`` or
            ``accumulate_grad_batches``.
    """
    spec = SteadyState(num_iterations, num_microbatches, optimizer, accumulate_grad_batches)
    _check_builder_args(stages, num_devices, num_microbatches, microbatches_per_round)
    per_round = microbatches_per_round or num_microbatches
    rounds = [range(k * num_microbatches + first, k * num_microbatches + min(first + per_round, num_microbatches))
              for k in range(num_iterations) for first in range(0, num_microbatches, per_round)]
    actions, next_cursor = _dispatch(stages, num_devices, rounds, cursor, prefetch, dispatch)
    plan = ExecutionPlan(tuple(stages), actions, num_iterations * num_microbatches, max_resident_stages=2 if prefetch else 1)
    plan._meta.update(_policy_meta(dispatch), next_cursor=next_cursor, cursor=cursor % num_devices, steady_state=spec,
                      builder=dict(stages=tuple(stages), num_devices=num_devices, num_microbatches=num_microbatches,
                                   cursor=cursor, prefetch=prefetch, microbatches_per_round=microbatches_per_round,
                                   num_iterations=num_iterations, dispatch=dispatch))
    return plan.validate() if validate else plan


def _check_builder_args(stages: Sequence[StageSpec], num_devices: int, num_microbatches: int,
                        microbatches_per_round: int | None) -> None:
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"`num_devices` must be a positive int, got {num_devices!r}.")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"`num_microbatches` must be a positive int, got {num_microbatches!r}.")
    if microbatches_per_round is not None and (not isinstance(microbatches_per_round, int)
                                               or isinstance(microbatches_per_round, bool) or microbatches_per_round < 1):
        raise ValueError(f"`microbatches_per_round` must be a positive int or None (one round), got {microbatches_per_round!r}.")
    if not stages:
        raise ValueError("`stages` is empty: a plan needs at least one stage.")


def _policy_meta(dispatch: DispatchPolicy | None) -> dict:
    """What a plan keeps of its dispatch policy: the devices' speeds (the simulator's) and where each
    stage may run (the weight pools' sizes)."""
    if dispatch is None:
        return {"dispatch_rule": "round_robin"}
    return {"dispatch_rule": dispatch.rule, "device_speeds": dispatch.device_speeds,
            "stage_devices": dispatch.stage_devices}


def _dispatch(stages: Sequence[StageSpec], num_devices: int, rounds: Sequence[range], cursor: int, prefetch: bool,
              dispatch: DispatchPolicy | None) -> tuple[tuple[tuple[Action, ...], ...], int]:
    """Per-device action lists over ``rounds`` (each: every stage on those microbatches), the devices
    placed by ``dispatch`` (:func:`~lightning_roundpipe.schedule.dispatch.assign_devices`), and the
    next cursor."""
    # dispatches in execution order: (stage, microbatches of its round), device of each
    placed, next_cursor = assign_devices(stages, num_devices, rounds, cursor, dispatch)
    per_device: list[list[tuple[StageSpec, range]]] = [[] for _ in range(num_devices)]
    order = iter(placed)
    for mbs in rounds:
        for spec in stages:
            per_device[next(order)].append((spec, mbs))
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
    return tuple(actions), next_cursor


def plan_next_cursor(plan: ExecutionPlan) -> int:
    """Device on which the stage after ``plan``'s last stage would run (the carried-over cursor)."""
    return plan._meta["next_cursor"]
