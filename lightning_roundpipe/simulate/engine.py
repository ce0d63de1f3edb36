"""Discrete-event simulator of a :class:`~lightning_roundpipe.schedule.program.StreamProgram`.

One program, two consumers (DESIGN.md sections 3 and 9): the runtime's backends walk the stream
lists of :func:`~lightning_roundpipe.schedule.lower.lower`; this module times exactly the same
lists with a cost model (RoundPipe paper, arXiv 2604.27085, section 3.3 for the streams and section
5.4 for the simulation) and returns the same :class:`~lightning_roundpipe.metrics.Timeline` type.
It never models what the program does not contain: no reordering, no preemption, no hoisting.

- **Streams**: every ``(device, stream)`` is a queue walked strictly in order. An op starts when its
  stream predecessor has finished, every op of ``program.deps[op]`` has finished, and its resource
  is free.
- **Resources** per device: one compute unit (the ``compute`` stream); one H2D link shared by the
  ``weights`` and ``h2d`` streams, one transfer at a time, the ``h2d`` head first when both heads
  are ready (activations before weights), never preempted inside a ``LOAD`` chunk (chunking is the
  granularity); one D2H link (the ``d2h`` stream).
- **Compute** (seconds, from :class:`LayerProfile` s of the stage's layers): ``F`` = sum of
  ``forward_s``; ``X`` (fused tail) = sum of ``forward_s + backward_s``; ``R`` (recompute) = sum of
  ``forward_s`` over every layer of the stage (the runtime recomputes all of them), except that a
  bound baseline (``_meta["weight_binding"]``, simulated only) keeps the LM head's activations
  (the sequence's last layer is not recomputed, as in Megatron-LM and the paper's artifact); ``B``
  = sum of ``backward_s``, times ``1 - weight_grad_fraction`` when the stage has ``W`` ops (ZB-H1),
  whose ``W`` = ``weight_grad_fraction`` x sum of ``backward_s``. Profiles are times on a device of
  speed 1; a compute op on device ``d`` takes its time over ``plan._meta["device_speeds"][d]``
  (the relative speeds the builder's dispatch policy names, DESIGN.md section 12; 1 without). The first
  compute op of each residency (a run of one stage's ops on a device's compute stream) also takes the
  stage's ``bind_s``: the runtime dequantises packed frozen weights (fp8, ``frozen_weights="nf4"``) when a
  layer first binds them there.
- **Transfers** (bytes / (bytes/s)): ``LOAD`` chunk = ``op.nbytes`` / ``h2d_bytes_per_s``, and
  ``WD2H`` = ``op.nbytes`` / ``d2h_bytes_per_s``; free without ``hardware``. Activations
  (``H2D``, ``GH2D``, ``D2H``) move the ``activation_bytes`` of the layer boundary they cross over
  the link's rate; with ``comm_s_per_hop`` (seconds per GPU -> host -> GPU hop) each end of a hop
  (a ``D2H`` some upload waits for, an upload that waits for a ``D2H``) costs half of it and a
  transfer with the host alone (the batch, the loss seed, the last input gradient) costs nothing;
  with neither, activations are free. A transfer on the H2D link that starts while the D2H link is
  busy runs at ``duplex_h2d_bytes_per_s`` (for its whole length). ``DROP`` costs nothing.

Pure Python: no torch, no Lightning, no devices.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from lightning_roundpipe.metrics.timeline import Interval, Timeline
from lightning_roundpipe.partition.profile import HardwareModel, LayerProfile
from lightning_roundpipe.schedule.lower import DEFAULT_CHUNK_BYTES, RECOMPUTE_MODES, lower, plan_dispatches
from lightning_roundpipe.schedule.plan import ExecutionPlan
from lightning_roundpipe.schedule.program import STREAMS, Op, OpKind, StreamProgram
from lightning_roundpipe.schedule.roundpipe import build_steady_state_plan
from lightning_roundpipe.simulate.costs import OpCostModel

__all__ = ["SimulationResult", "simulate", "simulate_program"]

_WEIGHTS, _H2D, _COMPUTE, _D2H = (STREAMS.index(name) for name in ("weights", "h2d", "compute", "d2h"))


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` and :func:`simulate_program` return.

    Attributes:
        timeline: one interval per op of nonzero duration (compute ``F``/``X``/``R``/``B``/``W``,
            transfers ``H2D``/``D2H``; ``stream`` and ``label`` name the op), seconds from the
            measured window's start; ``timeline.wall_s`` is the window length.
        iteration_s: wall time of one iteration (training step), seconds. In steady state, the
            mean period between the starts of consecutive iterations.
        idle_pct: per device, percent (0..100) of the measured window it did not compute (bubble).
        mean_idle_pct: mean of ``idle_pct`` over devices (total idle / (devices x window)).
        compute_s: per device, seconds of computation inside the measured window.
        num_iterations: iterations inside the measured window (1 unless ``steady_state``).
    """

    timeline: Timeline
    iteration_s: float
    idle_pct: tuple[float, ...]
    mean_idle_pct: float
    compute_s: tuple[float, ...] = ()
    num_iterations: int = 1


# ---------------------------------------------------------------------------------------- engine
@dataclass
class _Run:
    """Raw result of one run: per op (by position in ``ops``) device, stream, start and end (s), bytes."""

    ops: list[Op]
    devices: list[int]
    streams: list[int]
    start_s: list[float]
    end_s: list[float]
    nbytes: list[int]


#: Resources of a device, by index, and the streams each serves in priority order.
_LINK_IN, _UNIT, _LINK_OUT = 0, 1, 2
_SERVES = ((_UNIT, (_COMPUTE,)), (_LINK_OUT, (_D2H,)), (_LINK_IN, (_H2D, _WEIGHTS)))
_RESOURCE_OF = {_WEIGHTS: _LINK_IN, _H2D: _LINK_IN, _COMPUTE: _UNIT, _D2H: _LINK_OUT}


class _Engine:
    """The event loop: every stream walked in order against its device's resources.

    At each instant the engine first settles every op of zero duration that can start (they take no
    time, so their order does not matter), then starts the ops of nonzero duration, per device the
    compute unit, the D2H link, then the H2D link (so an upload starting at this instant sees the
    D2H link's state), the ``h2d`` head before the ``weights`` head.
    """

    def __init__(self, program: StreamProgram, costs: OpCostModel) -> None:
        self.program, self.costs = program, costs
        self.ops: list[Op] = []
        self.devices: list[int] = []
        self.streams: list[int] = []
        self.index: dict[Op, int] = {}
        self.queues: list[list[list[int]]] = []
        for device_index, per_stream in enumerate(program.streams):
            self.queues.append([])
            for stream_index, stream in enumerate(STREAMS):
                queue = []
                for op in per_stream[stream]:
                    self.index[op] = len(self.ops)
                    queue.append(len(self.ops))
                    self.ops.append(op)
                    self.devices.append(device_index)
                    self.streams.append(stream_index)
                self.queues[-1].append(queue)
        count = len(self.ops)
        self.waiting = [0] * count
        self.consumers: list[list[int]] = [[] for _ in range(count)]
        index = self.index
        for consumer, producers in program.deps.items():
            at = index.get(consumer)
            if at is None:
                continue
            for producer in producers:
                source = index.get(producer)
                if source is None:
                    raise ValueError(f"`{consumer}` waits for `{producer}`, which no stream runs."
                                     " HINT: run `program.validate()`.")
                self.consumers[source].append(at)
            self.waiting[at] += len(producers)
        self.fixed_s: list[float | None] = []
        self.nbytes: list[int] = []
        for op, device_index in zip(self.ops, self.devices):
            if op.kind.is_compute:
                self.fixed_s.append(costs.compute_s(op) / costs.device_speeds[device_index])
                self.nbytes.append(0)
            else:
                self.fixed_s.append(costs.fixed_transfer_s(op))
                self.nbytes.append(costs.transfer_bytes(op))
        self.start_s = [0.0] * count
        self.end_s = [0.0] * count
        self.done = [False] * count
        self.heads = [[0] * len(STREAMS) for _ in self.queues]
        self.running = [[-1, -1, -1] for _ in self.queues]
        self.events: list[tuple[float, int]] = []
        self.now = 0.0

    def _zero(self, at: int) -> bool:
        fixed = self.fixed_s[at]
        return fixed == 0.0 if fixed is not None else self.nbytes[at] == 0

    def _head(self, device_index: int, stream_index: int) -> int:
        queue = self.queues[device_index][stream_index]
        position = self.heads[device_index][stream_index]
        if position < len(queue) and not self.waiting[queue[position]]:
            return queue[position]
        return -1

    def _finish(self, at: int, dirty: set[int]) -> None:
        self.end_s[at] = self.now
        self.done[at] = True
        dirty.add(self.devices[at])
        for other in self.consumers[at]:
            self.waiting[other] -= 1
            if not self.waiting[other]:
                dirty.add(self.devices[other])

    def _settle_zero(self, dirty: set[int], touched: set[int]) -> None:
        while dirty:
            device_index = dirty.pop()
            touched.add(device_index)
            for resource, streams in _SERVES:
                if self.running[device_index][resource] >= 0:
                    continue
                for stream_index in streams:
                    head = self._head(device_index, stream_index)
                    while head >= 0 and self._zero(head):
                        self.heads[device_index][stream_index] += 1
                        self.start_s[head] = self.now
                        self._finish(head, dirty)
                        head = self._head(device_index, stream_index)

    def _start_timed(self, device_index: int) -> None:
        hardware = self.costs.hardware
        busy = self.running[device_index]
        for resource, streams in _SERVES:
            if busy[resource] >= 0:
                continue
            for stream_index in streams:
                head = self._head(device_index, stream_index)
                if head < 0:
                    continue
                duration = self.fixed_s[head]
                if duration is None:
                    if stream_index == _D2H:
                        rate = hardware.d2h_bytes_per_s
                    elif busy[_LINK_OUT] >= 0:
                        rate = hardware.duplex_h2d_bytes_per_s
                    else:
                        rate = hardware.h2d_bytes_per_s
                    duration = self.nbytes[head] / rate
                self.heads[device_index][stream_index] += 1
                self.start_s[head] = self.now
                busy[resource] = head
                heapq.heappush(self.events, (self.now + duration, head))
                break

    def run(self) -> _Run:
        """Simulate to the end.

        Raises:
            ValueError: the program deadlocks (naming the blocked stream heads).
        """
        dirty = set(range(len(self.queues)))
        while True:
            touched: set[int] = set()
            self._settle_zero(dirty, touched)
            for device_index in sorted(touched):
                self._start_timed(device_index)
            if not self.events:
                break
            self.now = self.events[0][0]
            while self.events and self.events[0][0] == self.now:
                _, at = heapq.heappop(self.events)
                self.running[self.devices[at]][_RESOURCE_OF[self.streams[at]]] = -1
                self._finish(at, dirty)
        if not all(self.done):
            blocked = []
            for device_index, per_stream in enumerate(self.queues):
                for stream_index, queue in enumerate(per_stream):
                    position = self.heads[device_index][stream_index]
                    if position < len(queue):
                        op = self.ops[queue[position]]
                        missing = [str(dep) for dep in self.program.deps.get(op, ()) if not self.done[self.index[dep]]]
                        blocked.append(f"dev{device_index}/{STREAMS[stream_index]}: `{op}` waits for {missing}")
            raise ValueError("Simulation deadlocked: " + "; ".join(blocked[:8]) + ". HINT: run `program.validate()`.")
        return _Run(self.ops, self.devices, self.streams, self.start_s, self.end_s, self.nbytes)


def _intervals(run: _Run, offset_s: float = 0.0, window: tuple[float, float] | None = None) -> list[Interval]:
    """One interval per op of nonzero duration, shifted by ``-offset_s`` and clipped to ``window``
    (bytes prorated to the clipped share)."""
    out = []
    for at, op in enumerate(run.ops):
        start, end = run.start_s[at], run.end_s[at]
        if end <= start:
            continue
        moved = run.nbytes[at]
        if window is not None:
            clipped_start, clipped_end = max(start, window[0]), min(end, window[1])
            if clipped_end <= clipped_start:
                continue
            moved = int(round(moved * (clipped_end - clipped_start) / (end - start)))
            start, end = clipped_start, clipped_end
        stream = STREAMS[run.streams[at]]
        kind = op.kind.value if op.kind.is_compute else "D2H" if stream == "d2h" else "H2D"
        out.append(Interval(run.devices[at], kind, op.stage_index, op.microbatch_index, start - offset_s,
                            end - offset_s, moved, stream=stream, label=str(op)))
    out.sort(key=lambda iv: (iv.start_s, iv.device_index))
    return out


def _result(timeline: Timeline, iteration_s: float, num_iterations: int) -> SimulationResult:
    idle = tuple(timeline.bubble_pct(d) for d in range(timeline.num_devices))
    return SimulationResult(
        timeline=timeline,
        iteration_s=iteration_s,
        idle_pct=idle,
        mean_idle_pct=sum(idle) / len(idle) if idle else 0.0,
        compute_s=tuple(timeline.compute_s(d) for d in range(timeline.num_devices)),
        num_iterations=num_iterations,
    )


def _check_inputs(plan: ExecutionPlan, profiles: Sequence[LayerProfile], comm_s_per_hop: float | None,
                  weight_grad_fraction: float) -> list[LayerProfile]:
    profiles = list(profiles)
    if not all(isinstance(p, LayerProfile) for p in profiles):
        raise TypeError("`profiles` must be a sequence of LayerProfile.")
    need = max((s.layers.stop for s in plan.stages), default=0)
    if len(profiles) < need:
        raise ValueError(
            f"`profiles` has {len(profiles)} layers but the plan's stages reach layer {need - 1}."
            " HINT: pass one LayerProfile per layer of the layer sequence (LM head last)."
        )
    if comm_s_per_hop is not None and not comm_s_per_hop >= 0:
        raise ValueError(f"`comm_s_per_hop` must be >= 0 (seconds), got {comm_s_per_hop!r}.")
    if not 0.0 <= weight_grad_fraction <= 1.0:
        raise ValueError(f"`weight_grad_fraction` must be in 0..1, got {weight_grad_fraction!r}.")
    return profiles


def _run_program(program: StreamProgram, profiles: list[LayerProfile], hardware: HardwareModel | None,
                 comm_s_per_hop: float | None, weight_grad_fraction: float,
                 microbatch_weights: Sequence[float] | None = None) -> _Run:
    costs = OpCostModel(program, profiles, hardware, comm_s_per_hop, weight_grad_fraction, microbatch_weights)
    return _Engine(program, costs).run()


# ---------------------------------------------------------------------------------------- public
def simulate_program(
    program: StreamProgram,
    profiles: Sequence[LayerProfile],
    hardware: HardwareModel | None = None,
    *,
    comm_s_per_hop: float | None = None,
    weight_grad_fraction: float = 0.5,
    microbatch_weights: Sequence[float] | None = None,
) -> SimulationResult:
    """Time a stream program with per-layer costs (see the module docstring for the cost model).

    Args:
        program: from :func:`~lightning_roundpipe.schedule.lower.lower` (possibly edited, e.g. with
            :meth:`StreamProgram.without_edge`).
        profiles: one :class:`LayerProfile` per layer of the layer sequence (seconds and bytes for
            one microbatch), indexed by ``plan.stages[i].layers``.
        hardware: link rates (bytes/s) for weight chunks, weight gradients and activations;
            ``None``: weights and gradients move for free.
        comm_s_per_hop: seconds of one activation hop GPU -> host -> GPU, half on each end;
            overrides the bytes-based activation times.
        weight_grad_fraction: share (0..1) of ``backward_s`` that is the ``W`` op, for stages that
            have ``W`` ops (ZB-H1).
        microbatch_weights: per microbatch, its size relative to the one ``profiles`` were measured
            on (e.g. ``[3/(8/3), 3/(8/3), 2/(8/3)]`` for a batch of 8 cut into 3, mean 1): its
            compute ops and activation transfers scale by it. ``None``: every microbatch weighs 1.

    Returns:
        A :class:`SimulationResult` of the whole program (``iteration_s``: the last op's end, s).

    Raises:
        TypeError: ``program`` is not a :class:`StreamProgram`, or ``profiles`` holds something else.
        ValueError: ``profiles`` does not cover the plan's layers, a bad ``comm_s_per_hop``,
            ``weight_grad_fraction`` or ``microbatch_weights`` (one finite number >= 0 per
            microbatch), or a program that deadlocks.
    """
    if not isinstance(program, StreamProgram):
        raise TypeError(f"`program` must be a StreamProgram (from `lower(plan)`), got {type(program).__name__}.")
    profiles = _check_inputs(program.plan, profiles, comm_s_per_hop, weight_grad_fraction)
    if microbatch_weights is not None:
        weights = list(microbatch_weights)
        if len(weights) != program.plan.num_microbatches or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < math.inf for w in weights):
            raise ValueError(f"`microbatch_weights` must hold one finite number >= 0 per microbatch"
                             f" ({program.plan.num_microbatches}), got {microbatch_weights!r}.")
    run = _run_program(program, profiles, hardware, comm_s_per_hop, weight_grad_fraction, microbatch_weights)
    intervals = _intervals(run)
    wall = max((iv.end_s for iv in intervals), default=0.0)
    return _result(Timeline(program.num_devices, intervals, wall_s=wall), wall, 1)


def _recompute_mode(plan: ExecutionPlan, recompute: bool | str | None) -> str | None:
    """``simulate``'s ``recompute`` as a mode of :func:`lower` (``None``: lower's default)."""
    if recompute is None or recompute in RECOMPUTE_MODES:
        return recompute
    if recompute is True:
        return "late" if plan._meta.get("weight_binding") else "early"
    if recompute is False:
        return "none"
    raise ValueError(f"`recompute` must be None, True, False or one of {list(RECOMPUTE_MODES)}, got {recompute!r}.")


def _lower(plan: ExecutionPlan, profiles: list[LayerProfile], recompute: str | None, chunk_bytes: int,
           validate: bool) -> StreamProgram:
    """Lower ``plan`` with byte sizes from ``profiles`` (bound plans keep their weights resident)."""
    bound = bool(plan._meta.get("weight_binding", False))
    weights = [0 if bound else sum(profiles[i].param_bytes for i in spec.layers) for spec in plan.stages]
    grads = [0 if bound or spec.kind == "forward" else sum(profiles[i].grad_bytes for i in spec.layers)
             for spec in plan.stages]
    return lower(plan, stage_weight_bytes=weights, stage_grad_bytes=grads, chunk_bytes=chunk_bytes,
                 recompute=recompute, validate=validate)


def _with_optimizer_edges(program: StreamProgram, per_iteration: int, lag: int) -> StreamProgram:
    """``program`` (several iterations of one plan back to back) with the optimizer's dependency
    added: every ``LOAD`` of a dispatch whose first microbatch is in iteration ``i`` waits for
    every ``WD2H`` of the dispatches of iteration ``i - lag`` (the weights it uploads were updated
    with those gradients)."""
    iteration_of = {(d.stage_index, d.round_index): min(a.microbatch_index for a in d.computes) // per_iteration
                    for d in plan_dispatches(program.plan) if d.computes}
    downloads: dict[int, list[Op]] = {}
    loads: list[Op] = []
    for _, _, _, op in program.ops():
        iteration = iteration_of.get((op.stage_index, op.round_index))
        if iteration is None:
            continue
        if op.kind is OpKind.WD2H:
            downloads.setdefault(iteration, []).append(op)
        elif op.kind is OpKind.LOAD:
            loads.append(op)
    deps = dict(program.deps)
    for op in loads:
        before = downloads.get(iteration_of[(op.stage_index, op.round_index)] - lag, ())
        if before:
            deps[op] = tuple(deps.get(op, ())) + tuple(before)
    return StreamProgram(program.plan, program.streams, deps, program.chunk_bytes, program.recompute)


def simulate(
    plan: ExecutionPlan,
    profiles: Sequence[LayerProfile],
    hardware: HardwareModel | None = None,
    *,
    steady_state: bool = False,
    comm_s_per_hop: float | None = None,
    recompute: bool | str | None = None,
    weight_grad_fraction: float = 0.5,
    steady_iterations: int = 4,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    weight_staleness: int = 1,
) -> SimulationResult:
    """Lower ``plan`` to its stream program and time it: one training iteration, or the steady state.

    Source: RoundPipe paper (arXiv 2604.27085) sections 3 (round-robin dispatch, fused tail,
    priority-aware transfers, section 3.3 streams) and 5.4 (bubble simulation).

    Args:
        plan: a valid plan: RoundPipe (:func:`build_roundpipe_plan`), a bound baseline
            (:mod:`lightning_roundpipe.schedule.baselines`), or any plan that passes ``validate()``.
        profiles: one :class:`LayerProfile` per layer of the layer sequence: ``param_bytes`` sized
            each stage's ``LOAD``, ``grad_bytes`` each backward stage's ``WD2H`` (both 0 for bound
            plans, whose weights stay resident), ``activation_bytes`` the activation transfers.
        hardware: link rates (bytes/s); ``None``: weights and gradients move for free.
        steady_state: for a RoundPipe plan, simulate ``steady_iterations`` iterations back to back
            (the same plan with ``steady_iterations x M`` microbatches in the same rounds, so the
            rotation continues and no optimizer barrier separates them) and measure from the start
            of iteration 1 to the start of the last (an iteration starts with the first compute op
            on its first microbatch): fill and drain are hidden by the neighbours, as far as the
            optimizer allows (``weight_staleness``).
        comm_s_per_hop: seconds of one activation hop GPU -> host -> GPU (half on each end).
        recompute: ``None``: :func:`lower`'s default (``"early"`` for RoundPipe, the plan's
            ``_meta["recompute"]`` for baselines, ``"late"`` when recomputing); ``True``: recompute
            (``"early"`` for RoundPipe, ``"late"`` for bound plans); ``False``: ``"none"``; or a mode.
        weight_grad_fraction: share (0..1) of ``backward_s`` in ``W`` ops (ZB-H1).
        steady_iterations: iterations simulated in steady state (>= 3).
        chunk_bytes: largest ``LOAD`` chunk, bytes (the no-preemption granularity of weight uploads).
        weight_staleness: steady state: how many optimizer steps old the weights an iteration
            uploads may be. Iteration ``i``'s weight uploads (every ``LOAD``) wait for every
            gradient download (``WD2H``) of iteration ``i - 1 - weight_staleness``: ``1`` is the
            paper's asynchronous optimizer (section 4: step ``i`` runs on weights one step stale,
            so its fill overlaps the previous iteration's drain), ``0`` the synchronous optimizer
            (an iteration's uploads wait for all of the previous iteration's gradients; the
            optimizer step itself costs no time here). Without this bound, with more devices
            than work, iterations would run side by side and the period tend to 0.

    Returns:
        A :class:`SimulationResult`; times in seconds, idle in percent.

    Raises:
        TypeError: ``plan`` is not an :class:`ExecutionPlan`, or ``profiles`` holds something else.
        ValueError: ``profiles`` does not cover the plan's layers, a bad argument value (also
            ``weight_staleness`` not an int >= 0), steady state for a plan that is not from :func:`build_roundpipe_plan` (a bound baseline), or
            a plan whose program deadlocks.
    """
    if not isinstance(plan, ExecutionPlan):
        raise TypeError(f"`plan` must be an ExecutionPlan, got {type(plan).__name__}."
                        " HINT: microbatch rounds are one plan: `build_roundpipe_plan(..., microbatches_per_round=D)`.")
    profiles = _check_inputs(plan, profiles, comm_s_per_hop, weight_grad_fraction)
    mode = _recompute_mode(plan, recompute)
    if not steady_state:
        program = _lower(plan, profiles, mode, chunk_bytes, validate=True)
        return simulate_program(program, profiles, hardware, comm_s_per_hop=comm_s_per_hop,
                                weight_grad_fraction=weight_grad_fraction)
    if isinstance(steady_iterations, bool) or not isinstance(steady_iterations, int) or steady_iterations < 3:
        raise ValueError(f"`steady_iterations` must be an int >= 3 in steady state, got {steady_iterations!r}.")
    builder = plan._meta.get("builder")
    if plan._meta.get("weight_binding") or builder is None:
        what = f"the bound baseline `{plan._meta.get('schedule', 'plan')}`" if plan._meta.get("weight_binding") \
            else "a plan not built by `build_roundpipe_plan`"
        raise ValueError(
            f"`steady_state=True` needs a RoundPipe plan; got {what}. HINT: steady state continues the round-robin"
            " rotation over `steady_iterations` iterations, which only `build_roundpipe_plan` plans have; simulate"
            " one iteration (`steady_state=False`)."
        )
    per_iteration = builder["num_microbatches"]
    long_plan = build_steady_state_plan(  # the runtime's builder; rounds never span two iterations
        builder["stages"], builder["num_devices"], per_iteration, steady_iterations, cursor=builder["cursor"],
        prefetch=builder["prefetch"], microbatches_per_round=builder["microbatches_per_round"],
        dispatch=builder.get("dispatch"))
    if isinstance(weight_staleness, bool) or not isinstance(weight_staleness, int) or weight_staleness < 0:
        raise ValueError(f"`weight_staleness` must be an int >= 0 (optimizer steps), got {weight_staleness!r}."
                         " HINT: 1 for the paper's asynchronous optimizer, 0 for the synchronous one.")
    program = _with_optimizer_edges(_lower(long_plan, profiles, mode, chunk_bytes, validate=False),
                                    per_iteration, 1 + weight_staleness)
    run = _run_program(program, profiles, hardware, comm_s_per_hop, weight_grad_fraction)
    first_compute: dict[int, float] = {}
    for at, op in enumerate(run.ops):
        if op.kind.is_compute and op.microbatch_index % per_iteration == 0:
            iteration = op.microbatch_index // per_iteration
            first_compute[iteration] = min(first_compute.get(iteration, run.start_s[at]), run.start_s[at])
    window = (first_compute[1], first_compute[steady_iterations - 1])
    intervals = _intervals(run, offset_s=window[0], window=window)
    timeline = Timeline(plan.num_devices, intervals, wall_s=window[1] - window[0])
    return _result(timeline, (window[1] - window[0]) / (steady_iterations - 2), steady_iterations - 2)
