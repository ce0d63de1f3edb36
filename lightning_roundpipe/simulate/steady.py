"""The training run's own mode, timed: K iterations and the host's optimizer step (DESIGN.md section 11).

:func:`simulate_steady_program` times a
:class:`~lightning_roundpipe.schedule.steady.SteadyStateProgram` with the engine of
:mod:`lightning_roundpipe.simulate.engine` (the same per-device resources, streams and cost model)
plus one more resource, the **host's optimizer**: a queue of ``OPT`` ops run one at a time, each
``optimizer_step_s`` seconds (``optimizer_step_bytes / hardware.optimizer_bytes_per_s``: the
trainable master weights and their optimizer state over the host's measured optimizer rate, or its
documented default), each starting when its window's gradient downloads have ended; the device ops
the mode makes wait for a step (:mod:`lightning_roundpipe.schedule.steady`) start after it.

:func:`simulate_training` builds, lowers and times the run for stages on ``D`` devices:

- ``"sync"``: nothing of the next window starts before the optimizer step ends, so a step costs one
  window's pipeline (fill and drain included) plus the optimizer step; measured over the first
  window (start to the next window's start).
- ``"async"``: the steady state with one-step-stale weights; the optimizer step overlaps the next
  window's pipeline and delays it only when it is longer; measured as the mean over whole
  rotations of the round robin (:func:`rotation_windows`) from window 2 on (start to start), so
  the first windows' fill is not counted. Consecutive periods differ when the stages per window
  are not a multiple of the devices (which device starts the window rotates); a whole rotation
  averages them.

Pure Python: no torch, no Lightning, no devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from lightning_roundpipe.metrics.timeline import Timeline
from lightning_roundpipe.partition.devices import MixedDevices
from lightning_roundpipe.partition.partitioner import schedule_ranges
from lightning_roundpipe.partition.profile import HardwareModel, LayerProfile
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.schedule.lower import DEFAULT_CHUNK_BYTES
from lightning_roundpipe.schedule.plan import StageSpec
from lightning_roundpipe.schedule.program import STREAMS
from lightning_roundpipe.schedule.dispatch import DispatchPolicy
from lightning_roundpipe.schedule.roundpipe import OPTIMIZER_MODES, build_stages, build_steady_state_plan
from lightning_roundpipe.schedule.steady import SteadyStateProgram, lower_steady_state
from lightning_roundpipe.simulate.costs import OpCostModel
from lightning_roundpipe.simulate.engine import _Engine, _intervals, _Run, _check_inputs

__all__ = ["DEFAULT_WINDOWS", "ModeChoice", "TrainingPrediction", "choose_for_mode", "optimizer_step_s",
           "partition_stages", "rotation_windows", "simulate_steady_program", "simulate_training"]

_COMPUTE = STREAMS.index("compute")
#: Windows (optimizer steps) simulated per mode by default, and the first one measured. Sync: one
#: window, measured to where the next would start (its optimizer step's end plus the same lead-in:
#: every sync window starts from idle devices, see :func:`simulate_steady_program`).
#: Async: from window 2 (the first that waits for an optimizer step) over :func:`rotation_windows`
#: windows (the count here is for a rotation of two).
DEFAULT_WINDOWS = {"sync": (1, 0), "async": (5, 2)}


def rotation_windows(num_stages: int, num_devices: int, dispatch_rounds: int = 1, accumulate_grad_batches: int = 1) -> int:
    """Windows after which the round robin's rotation repeats: window ``w`` starts on device
    ``(w x A x R x S) mod D`` (``S`` stages, ``R`` microbatch rounds per iteration, ``A`` iterations
    per window), so ``D / gcd(A x R x S, D)`` windows; at least 2."""
    return max(2, num_devices // math.gcd(accumulate_grad_batches * dispatch_rounds * num_stages, num_devices))


@dataclass(frozen=True)
class TrainingPrediction:
    """What :func:`simulate_training` and :func:`simulate_steady_program` return.

    Attributes:
        optimizer: ``"sync"`` or ``"async"``.
        step_s: seconds per training iteration (batch) in the measured window: the window's length
            (start of its first iteration to the start of the first iteration after it) over its
            iterations.
        optimizer_step_s: seconds of one optimizer step on the host.
        idle_pct: per device, percent (0..100) of the measured window it did not compute.
        mean_idle_pct: mean of ``idle_pct``.
        timeline: the devices' intervals in the measured window (seconds from its start); ``None``
            when not recorded.
        optimizer_spans: ``(start_s, end_s)`` of the optimizer steps overlapping the window (seconds
            from its start, clipped to it).
        num_iterations: iterations in the measured window.
        iteration_starts_s: start of every simulated iteration (its first compute), seconds from the
            run's start.
        optimizer_steps_s: ``(start_s, end_s)`` of every optimizer step of the run, seconds from its start.
        run_timeline: every device interval of the whole run (seconds from its start), with
            ``record_run=True``; else ``None``.
    """

    optimizer: str
    step_s: float
    optimizer_step_s: float
    idle_pct: tuple[float, ...]
    mean_idle_pct: float
    timeline: Timeline | None
    optimizer_spans: tuple[tuple[float, float], ...]
    num_iterations: int
    iteration_starts_s: tuple[float, ...] = ()
    optimizer_steps_s: tuple[tuple[float, float], ...] = ()
    run_timeline: Timeline | None = None

    def tokens_per_s(self, tokens_per_iteration: float) -> float:
        """Throughput for ``tokens_per_iteration`` tokens per batch, tokens/s."""
        return tokens_per_iteration / self.step_s


def optimizer_step_s(optimizer_bytes: int, hardware: HardwareModel | None) -> float:
    """Seconds of one optimizer step: ``optimizer_bytes`` (the trainable masters and their state,
    :func:`~lightning_roundpipe.partition.profile.optimizer_step_bytes`) over the host's optimizer
    rate (``hardware.optimizer_bytes_per_s``; the documented default without ``hardware``).

    Raises:
        ValueError: negative ``optimizer_bytes``.
    """
    if optimizer_bytes < 0:
        raise ValueError(f"`optimizer_bytes` must be >= 0, got {optimizer_bytes!r}.")
    if hardware is None:
        from lightning_roundpipe.partition.profile import DEFAULT_HOST_OPTIMIZER_BYTES_PER_S as rate
    else:
        rate = hardware.optimizer_bytes_per_s
    return optimizer_bytes / rate


class _HostEngine(_Engine):
    """The simulator's engine plus a host queue of optimizer ops (one more "device" with one unit)."""

    def __init__(self, program: SteadyStateProgram, costs: OpCostModel, optimizer_s: float) -> None:
        super().__init__(program.program, costs)
        host = len(self.queues)
        queue = []
        for step in program.optimizer_ops:
            at = len(self.ops)
            self.index[step] = at
            queue.append(at)
            self.ops.append(step)
            self.devices.append(host)
            self.streams.append(_COMPUTE)
            self.fixed_s.append(float(optimizer_s))
            self.nbytes.append(0)
            producers = program.optimizer_deps.get(step, ())
            self.waiting.append(len(producers))
            self.consumers.append([])
            for producer in producers:
                self.consumers[self.index[producer]].append(at)
        for consumer, step in program.optimizer_waits.items():
            self.waiting[self.index[consumer]] += 1
            self.consumers[self.index[step]].append(self.index[consumer])
        count = len(self.ops)
        self.start_s = [0.0] * count
        self.end_s = [0.0] * count
        self.done = [False] * count
        self.queues.append([[] if s != _COMPUTE else queue for s in range(len(STREAMS))])
        self.heads.append([0] * len(STREAMS))
        self.running.append([-1, -1, -1])
        self.host = host


def simulate_steady_program(
    program: SteadyStateProgram,
    profiles: Sequence[LayerProfile],
    hardware: HardwareModel | None = None,
    *,
    optimizer_step_s: float = 0.0,
    measure_from_window: int | None = None,
    comm_s_per_hop: float | None = None,
    weight_grad_fraction: float = 0.5,
    microbatch_weights: Sequence[float] | None = None,
    record_timeline: bool = True,
    record_run: bool = False,
) -> TrainingPrediction:
    """Time a steady-state program: its device streams and its host queue of optimizer steps.

    The measured window runs from the start (first compute) of window ``measure_from_window``'s
    first iteration to that of the first iteration after the program's last window but one. A sync
    program of a single window is measured to where the next window would start: its optimizer
    step's end plus the same lead-in (in sync mode nothing of a window starts before the previous
    optimizer step ends, so every window starts from idle devices as the first does, the rotation
    aside: the same on identical devices).

    Args:
        program: from :func:`~lightning_roundpipe.schedule.steady.lower_steady_state`.
        profiles: one :class:`LayerProfile` per layer (seconds and bytes per microbatch).
        hardware: link rates (bytes/s); ``None``: weights and gradients move for free.
        optimizer_step_s: seconds of one ``OPT`` op (>= 0; :func:`optimizer_step_s`).
        measure_from_window: the first measured window (optimizer step); the measurement runs to
            the start of the last window, so at least one window must lie between. ``None``: the
            mode's default (:data:`DEFAULT_WINDOWS`: 0 for sync, 2 for async).
        comm_s_per_hop, weight_grad_fraction: as :func:`~lightning_roundpipe.simulate.simulate_program`.
        microbatch_weights: per microbatch of one iteration (``M`` entries), its size relative to
            the profiled one; the same for every iteration. ``None``: every weight 1.
        record_timeline: build the measured window's :class:`Timeline` (``False``: ``timeline`` is
            ``None``; idle is computed all the same, faster, for choosing among candidates).
        record_run: also return the whole run's device intervals (``run_timeline``).

    Returns:
        A :class:`TrainingPrediction`.

    Raises:
        TypeError: ``program`` is not a :class:`SteadyStateProgram`.
        ValueError: a negative ``optimizer_step_s``, a measured window outside the program (at
            least one window after it is needed), a bad ``microbatch_weights``, or as
            :func:`~lightning_roundpipe.simulate.simulate_program`.
    """
    if not isinstance(program, SteadyStateProgram):
        raise TypeError(f"`program` must be a SteadyStateProgram (from `lower_steady_state`), got {type(program).__name__}.")
    if not optimizer_step_s >= 0:
        raise ValueError(f"`optimizer_step_s` must be >= 0 (seconds), got {optimizer_step_s!r}.")
    spec = program.steady_state
    windows = spec.num_iterations // spec.accumulate_grad_batches
    first = DEFAULT_WINDOWS[spec.optimizer][1] if measure_from_window is None else measure_from_window
    single = spec.optimizer == "sync" and windows == 1 and spec.num_steps == 1 and first == 0
    if isinstance(first, bool) or not isinstance(first, int) or not (0 <= first < windows - 1 or single):
        raise ValueError(f"`measure_from_window` must be an int in 0..{windows - 2} (a window after it ends the"
                         f" measurement; a sync program of one window is measured to its optimizer step's end);"
                         f" got {first!r} for a program of {windows} window(s). HINT: simulate more iterations.")
    profiles = _check_inputs(program.plan, profiles, comm_s_per_hop, weight_grad_fraction)
    weights = None
    if microbatch_weights is not None:
        per = list(microbatch_weights)
        if len(per) != spec.microbatches_per_iteration or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < float("inf") for w in per):
            raise ValueError(f"`microbatch_weights` must hold one finite number >= 0 per microbatch of an iteration"
                             f" ({spec.microbatches_per_iteration}), got {microbatch_weights!r}.")
        weights = per * spec.num_iterations
    costs = OpCostModel(program.program, profiles, hardware, comm_s_per_hop, weight_grad_fraction, weights)
    engine = _HostEngine(program, costs, optimizer_step_s)
    run = engine.run()
    device_ops = [at for at, device in enumerate(run.devices) if device != engine.host]
    starts: dict[int, float] = {}
    for at in device_ops:
        op = run.ops[at]
        if op.kind.is_compute:
            iteration = spec.iteration_of(op.microbatch_index)
            starts[iteration] = min(starts.get(iteration, run.start_s[at]), run.start_s[at])
    accumulate = spec.accumulate_grad_batches
    steps = tuple((run.start_s[at], run.end_s[at]) for at in engine.queues[engine.host][_COMPUTE])
    if single:
        window = (starts[0], steps[0][1] + starts[0])
        iterations = accumulate
    else:
        window = (starts[first * accumulate], starts[(windows - 1) * accumulate])
        iterations = (windows - 1 - first) * accumulate
    device_run = _Run([run.ops[at] for at in device_ops], [run.devices[at] for at in device_ops],
                      [run.streams[at] for at in device_ops], [run.start_s[at] for at in device_ops],
                      [run.end_s[at] for at in device_ops], [run.nbytes[at] for at in device_ops])
    length = window[1] - window[0]
    num_devices = program.program.num_devices
    busy = [0.0] * num_devices
    for at in device_ops:
        if run.ops[at].kind.is_compute:
            busy[run.devices[at]] += max(0.0, min(run.end_s[at], window[1]) - max(run.start_s[at], window[0]))
    idle = tuple(100.0 * (1.0 - b / length) if length > 0 else 0.0 for b in busy)
    timeline = (Timeline(num_devices, _intervals(device_run, offset_s=window[0], window=window), wall_s=length)
                if record_timeline else None)
    spans = tuple((max(start, window[0]) - window[0], min(end, window[1]) - window[0])
                  for start, end in steps if end > window[0] and start < window[1])
    whole = _intervals(device_run) if record_run else None
    return TrainingPrediction(
        optimizer=spec.optimizer, step_s=length / iterations, optimizer_step_s=float(optimizer_step_s),
        idle_pct=idle, mean_idle_pct=sum(idle) / len(idle), timeline=timeline, optimizer_spans=spans,
        num_iterations=iterations, iteration_starts_s=tuple(starts[k] for k in sorted(starts)),
        optimizer_steps_s=steps,
        run_timeline=None if whole is None else Timeline(program.program.num_devices, whole,
                                                         wall_s=max((iv.end_s for iv in whole), default=0.0)))


def simulate_training(
    stages: Sequence[StageSpec],
    num_devices: int,
    num_microbatches: int,
    profiles: Sequence[LayerProfile],
    hardware: HardwareModel | None = None,
    *,
    optimizer: str = "sync",
    optimizer_bytes: int = 0,
    accumulate_grad_batches: int = 1,
    num_windows: int | None = None,
    microbatches_per_round: int | None = None,
    cursor: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    comm_s_per_hop: float | None = None,
    microbatch_weights: Sequence[float] | None = None,
    record_timeline: bool = True,
    dispatch: DispatchPolicy | None = None,
) -> TrainingPrediction:
    """Predict the training step of the run's own optimizer mode (DESIGN.md section 11).

    Builds ``num_windows x accumulate_grad_batches`` iterations with
    :func:`~lightning_roundpipe.schedule.roundpipe.build_steady_state_plan` (the builder the runtime
    uses), lowers them with the mode's optimizer edges and times them with one optimizer step of
    ``optimizer_bytes / hardware.optimizer_bytes_per_s`` seconds per window.

    Args:
        stages: stage specs in plan order (``build_stages(..., fused_tail=True)``).
        num_devices: devices ``D``.
        num_microbatches: microbatches ``M`` per iteration.
        profiles: one :class:`LayerProfile` per layer: ``param_bytes`` size the ``LOAD`` s,
            ``grad_bytes`` the backward stages' ``WD2H``, ``activation_bytes`` the activations.
        hardware: link rates and the host's optimizer rate; ``None``: transfers free, the default
            optimizer rate.
        optimizer: ``"sync"`` or ``"async"``.
        optimizer_bytes: bytes one optimizer step touches (trainable masters and optimizer state,
            :func:`~lightning_roundpipe.partition.profile.optimizer_step_bytes`); 0: a free step.
        accumulate_grad_batches: iterations per optimizer step.
        num_windows: optimizer steps simulated (default: 1 sync; async, 3 + :func:`rotation_windows`,
            the measurement covering one whole rotation).
        microbatches_per_round, cursor, chunk_bytes: as the builder and :func:`lower`.
        comm_s_per_hop: seconds per activation hop (overrides the bytes-based activation times).
        microbatch_weights: per microbatch of an iteration, its relative size.
        record_timeline: as :func:`simulate_steady_program`.
        dispatch: the builder's dispatch policy (rule and device speeds, DESIGN.md section 12;
            ``None``: the round robin on equal devices); compute ops take their time over their
            device's speed.

    Returns:
        A :class:`TrainingPrediction`; ``step_s`` per iteration (batch).

    Raises:
        ValueError: a bad ``optimizer`` (valid ones listed), ``num_windows`` too small for the mode,
            or as the builder, the lowering and :func:`simulate_steady_program`.
    """
    if optimizer not in OPTIMIZER_MODES:
        raise ValueError(f"`optimizer` must be one of {list(OPTIMIZER_MODES)}, got {optimizer!r}.")
    default_windows, first = DEFAULT_WINDOWS[optimizer]
    if optimizer == "async":
        per_round = microbatches_per_round or num_microbatches
        default_windows = first + 1 + rotation_windows(len(stages), num_devices, -(-num_microbatches // per_round),
                                                       accumulate_grad_batches)
    windows = default_windows if num_windows is None else num_windows
    least = 1 if optimizer == "sync" else first + 2
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < least:
        raise ValueError(f"`num_windows` must be an int >= {least} for the {optimizer!r} optimizer (window"
                         f" {first} is the first measured), got {num_windows!r}.")
    plan = build_steady_state_plan(stages, num_devices, num_microbatches, windows * accumulate_grad_batches,
                                   optimizer=optimizer, accumulate_grad_batches=accumulate_grad_batches, cursor=cursor,
                                   microbatches_per_round=microbatches_per_round, validate=False, dispatch=dispatch)
    profiles = list(profiles)
    weights = [sum(profiles[i].param_bytes for i in spec.layers) for spec in plan.stages]
    grads = [0 if spec.kind == "forward" else sum(profiles[i].grad_bytes for i in spec.layers) for spec in plan.stages]
    program = lower_steady_state(plan, stage_weight_bytes=weights, stage_grad_bytes=grads, chunk_bytes=chunk_bytes,
                                 validate=False)
    return simulate_steady_program(program, profiles, hardware, optimizer_step_s=optimizer_step_s(optimizer_bytes, hardware),
                                   measure_from_window=first, comm_s_per_hop=comm_s_per_hop,
                                   microbatch_weights=microbatch_weights, record_timeline=record_timeline)


@dataclass(frozen=True)
class ModeChoice:
    """The candidate the simulator picks for one optimizer mode (:func:`choose_for_mode`).

    Attributes:
        optimizer: the mode.
        label: the candidate's label (``"optimal"``, ``"paper"``, ``"16 stages"``...).
        partition: the candidate's partition.
        microbatches_per_round: the microbatch rounds it runs with (``None``: one round).
        prediction: its :class:`TrainingPrediction` in that mode.
    """

    optimizer: str
    label: str
    partition: PartitionPlan
    microbatches_per_round: int | None
    prediction: TrainingPrediction


def partition_stages(partition: PartitionPlan) -> tuple[StageSpec, ...]:
    """The fused-path stage specs of a partition in :func:`~lightning_roundpipe.partition.auto_partition`'s
    form (forward stages ending with the tail's range)."""
    forward, backward = schedule_ranges(partition)
    return build_stages(forward, backward, fused_tail=True)


def choose_for_mode(
    candidates: Sequence[tuple[str, PartitionPlan]],
    profiles: Sequence[LayerProfile],
    hardware: HardwareModel | None,
    num_devices: int,
    num_microbatches: int,
    *,
    optimizer: str,
    optimizer_bytes: int = 0,
    round_options: Sequence[int | None] = (None,),
    accumulate_grad_batches: int = 1,
    comm_s_per_hop: float | None = None,
    devices: MixedDevices | None = None,
    dispatch_rule: str = "round_robin",
) -> ModeChoice:
    """The fastest candidate in the run's own mode: each labelled partition with each option of
    ``round_options`` is timed by :func:`simulate_training`; the smallest ``step_s`` wins (ties: the
    earlier candidate, then the earlier round option).

    ``devices`` (devices of unequal speed or memory, DESIGN.md section 12) with ``dispatch_rule``
    (``"round_robin"`` or ``"weighted"``) gives each candidate's plan its
    :meth:`~lightning_roundpipe.partition.devices.MixedDevices.policy`; a candidate with a stage
    that fits no device is skipped.

    Raises:
        ValueError: no candidates, no candidate that fits the devices, or as :func:`simulate_training`.
    """
    if not candidates:
        raise ValueError("`candidates` is empty: pass at least one (label, PartitionPlan).")
    best: ModeChoice | None = None
    for label, partition in candidates:
        stages = partition_stages(partition)
        policy = None
        if devices is not None:
            try:
                policy = devices.policy(dispatch_rule, stages, profiles)
            except ValueError:  # a stage no device holds
                continue
        for per_round in round_options:
            prediction = simulate_training(stages, num_devices, num_microbatches, profiles, hardware, optimizer=optimizer,
                                           optimizer_bytes=optimizer_bytes, accumulate_grad_batches=accumulate_grad_batches,
                                           microbatches_per_round=per_round, comm_s_per_hop=comm_s_per_hop,
                                           record_timeline=False, dispatch=policy)
            if best is None or prediction.step_s < best.prediction.step_s * (1 - 1e-12):
                best = ModeChoice(optimizer, label, partition, per_round, prediction)
    if best is None:
        raise ValueError(f"No candidate partition fits the devices' memory for the {dispatch_rule!r} rule."
                         " HINT: devices with more memory, or a smaller microbatch or sequence.")
    return best
