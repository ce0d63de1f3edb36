"""Devices of unequal speed and memory at run time (DESIGN.md section 12; no Lightning here).

RoundPipe's devices are stateless, so a faster device can take more stages and a larger one larger
stages. An engine (passed in; this module does not import it) gets from :func:`configure_devices`:

- ``cpu_device_speeds``: CPU virtual devices throttled to relative speeds
  (:meth:`~lightning_roundpipe.runtime.backends.cpu.CpuBackend.set_speed`), so mixed GPUs can be
  reproduced and tested on a CPU;
- the dispatch rule its plans are built with (:func:`build_plan`): ``"round_robin"`` (the paper's),
  ``"weighted"`` (:mod:`~lightning_roundpipe.schedule.dispatch`: each stage to the device that
  would finish it first given its speed and load, only on devices whose memory holds it), or
  ``"auto"``: the round robin until the profiled steps are over, then the one the simulator times
  faster (:func:`~lightning_roundpipe.runtime.tuning.autopartition.choose_partition`);
- the devices' relative speeds: on CPU virtual devices the configured ``cpu_device_speeds`` are the
  speeds (the throttle makes them exact; a probe on a loaded host would only add noise), never
  measured; on distinct GPUs they are measured after the warm-up step of the profiled steps by
  :func:`measure_device_speeds` (the same matrix multiplies timed on each device's compute stream),
  with nothing in flight (the engine's overlapped runs are drained first) and repeated while the
  spans of one device spread more than :data:`SPEED_TOLERANCE`. The speeds also scale the profiled
  layer times to a device of speed 1
  (:class:`~lightning_roundpipe.runtime.tuning.profiler.LayerProfiler`). Speeds that differ by less
  than :data:`SPEED_TOLERANCE` are taken as equal (the probe's noise on identical devices).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Sequence

import torch

from lightning_roundpipe.partition.devices import relative_speeds, stage_costs, stage_devices
from lightning_roundpipe.runtime.backends import per_device_bytes
from lightning_roundpipe.schedule import ExecutionPlan, build_roundpipe_plan
from lightning_roundpipe.schedule.dispatch import DISPATCH_RULES, DispatchPolicy

__all__ = ["DISPATCH_MODES", "SPEED_TOLERANCE", "build_plan", "compares_rules", "configure_devices", "describe_devices",
           "describe_speeds", "device_stage_budgets", "dispatch_policy", "measure_device_speeds", "set_dispatch_rule"]

#: Values of ``RoundPipeConfig.dispatch``: ``"auto"`` or a fixed rule.
DISPATCH_MODES = ("auto",) + DISPATCH_RULES
SPEED_TOLERANCE = 0.10
"""Measured speeds whose slowest is within this fraction of the fastest are taken as equal devices:
two identical GPUs (or CPU virtual devices sharing one host) time the probe a few percent apart."""
_PROBE_SIZE = {"cpu": 256, "cuda": 4096}  # square matrix side of the probe's matrix multiplies
_PROBE_MATMULS = {"cpu": 8, "cuda": 8}  # matrix multiplies per timed span
_PROBE_SPANS = 5  # timed spans per device, after a warm-up span
_PROBE_ATTEMPTS = 3  # probes at most, while a device's spans spread more than SPEED_TOLERANCE


def configure_devices(engine: Any, cpu_device_speeds: Sequence[float] | None = None, dispatch: str = "auto") -> None:
    """Set up ``engine`` (a new :class:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine`)
    for devices of unequal speed and memory (see the module docstring).

    Args:
        engine: the engine; its per-device memory is ``engine.device_memory_bytes`` (one int for
            every device, one per device, or ``None``).
        cpu_device_speeds: CPU virtual devices: per device, its relative speed (finite, > 0; scaled
            so the fastest is 1.0): that device's compute runs ``1 / speed`` times longer.
            ``None``: every device at the host's speed.
        dispatch: ``"auto"``, ``"round_robin"`` or ``"weighted"``.

    Raises:
        ValueError: an unknown ``dispatch`` (valid ones listed); ``cpu_device_speeds`` of another
            length than the devices, with a value that is not a finite number > 0, or on GPUs.
    """
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"`dispatch` must be one of {list(DISPATCH_MODES)}, got {dispatch!r}. HINT: 'auto' lets the"
                         " simulator choose after the profiled steps.")
    num_devices = len(engine.backends)
    engine.device_speeds = None
    engine.device_speeds_source = None
    if cpu_device_speeds is not None:
        values = list(cpu_device_speeds)
        if any(backend.is_cuda for backend in engine.backends):
            raise ValueError("`cpu_device_speeds` applies to CPU virtual devices only: a GPU runs at its own speed,"
                             " measured after the warm-up step. HINT: drop it, or use `accelerator='cpu'`.")
        if len(values) != num_devices:
            raise ValueError(f"`cpu_device_speeds` has {len(values)} entries for {num_devices} devices. HINT: one"
                             f" relative speed per device, e.g. {[1.0] + [0.5] * (num_devices - 1)}.")
        speeds = relative_speeds(values)
        for backend, speed in zip(engine.backends, speeds):
            backend.set_speed(speed)
        engine.device_speeds = _distinct(speeds)
        engine.device_speeds_source = "configured"
    engine.dispatch_mode = dispatch
    engine.dispatch_rule = "weighted" if dispatch == "weighted" else "round_robin"
    profiler = engine.executor.profiler
    if cpu_device_speeds is not None and profiler is not None:  # the known speeds scale the profiled times
        profiler.device_speeds = list(speeds)
    if num_devices == 1 or not _may_differ(engine):
        return
    if profiler is not None:
        profiler.speed_probe = lambda: _take_measured_speeds(engine)
    elif dispatch == "weighted":
        _take_measured_speeds(engine)  # no profiled steps: measure now


def _may_differ(engine: Any) -> bool:
    """Whether the devices' speeds are worth measuring: distinct GPUs only (CPU virtual devices run at
    their configured speeds, or all at the host's; logical devices of one GPU are equal)."""
    if all(backend.is_cuda for backend in engine.backends):
        return len({backend.device for backend in engine.backends}) > 1
    return False


def _distinct(speeds: Sequence[float]) -> tuple[float, ...] | None:
    """``speeds`` (relative, the fastest 1.0), or ``None`` when they are equal within :data:`SPEED_TOLERANCE`."""
    return None if min(speeds) >= 1.0 - SPEED_TOLERANCE else tuple(speeds)


def _take_measured_speeds(engine: Any) -> list[float]:
    """Measure with nothing in flight (the engine's overlapped runs drained first: a probe beside a
    step's kernels times the step, not the device), keep as ``engine.device_speeds`` (equal within the
    tolerance: ``None``) and return the speeds; plans built before are dropped (they were built with
    the prior speeds)."""
    engine.drain()
    measured = measure_device_speeds(engine.backends)
    engine.measured_device_speeds = measured
    engine.device_speeds = _distinct(measured)
    engine.device_speeds_source = "measured"
    _drop_plans(engine)
    return list(engine.device_speeds or [1.0] * len(measured))


def _drop_plans(engine: Any) -> None:
    engine._plans.clear()
    engine._programs.clear()
    engine._predictions.clear()


def measure_device_speeds(backends: Sequence[Any], attempts: int = _PROBE_ATTEMPTS) -> list[float]:
    """Relative compute speed of each device (the fastest 1.0): the same square matrix multiplies
    (fp32 on CPU virtual devices, bf16 on GPUs) timed on each device's compute stream. One device
    runs at a time, the devices take turns for :data:`_PROBE_SPANS` rounds after a warm-up round,
    and each device's shortest span counts (work running beside the probe only lengthens a span).
    While some device's timed spans spread more than :data:`SPEED_TOLERANCE` (its median over its
    shortest, minus 1: something ran beside the probe), the probe is repeated, ``attempts`` times
    at most; each device's shortest span over all attempts counts. Call with nothing in flight on
    the devices (:func:`configure_devices` drains the engine first).

    A device's speed on the model's own layers is about its matrix-multiply throughput (what the
    table of ``roundpipe plan --devices`` lists); a throttled CPU virtual device slows the probe as
    it slows every op.
    """
    best = [math.inf] * len(backends)
    for _ in range(max(1, attempts)):
        spreads = []
        for index, timed in enumerate(_probe_spans(backends)):
            shortest = min(timed) if timed else math.inf
            best[index] = min(best[index], shortest)
            median = sorted(timed)[len(timed) // 2] if timed else math.inf
            spreads.append(median / max(shortest, 1e-12) - 1.0 if timed else math.inf)
        if max(spreads) <= SPEED_TOLERANCE:
            break
    return list(relative_speeds([1.0 / max(s, 1e-12) for s in best]))


def _probe_spans(backends: Sequence[Any]) -> list[list[float]]:
    """One probe (see :func:`measure_device_speeds`): per device, its timed spans (s) after the warm-up one."""
    operands: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    spans: dict[int, list[tuple[Any, Any]]] = {index: [] for index in range(len(backends))}
    for _ in range(_PROBE_SPANS + 1):
        for index, backend in enumerate(backends):
            kind = "cuda" if backend.is_cuda else "cpu"

            def probe(index=index, backend=backend, kind=kind) -> None:
                if index not in operands:
                    dtype = torch.bfloat16 if backend.is_cuda else torch.float32
                    generator = torch.Generator(device=backend.device).manual_seed(0)
                    operands[index] = tuple(torch.randn(_PROBE_SIZE[kind], _PROBE_SIZE[kind], device=backend.device,
                                                        dtype=dtype, generator=generator) for _ in range(2))
                left, right = operands[index]
                start = backend.mark()
                for _ in range(_PROBE_MATMULS[kind]):
                    left @ right
                spans[index].append((start, backend.mark()))

            context = torch.cuda.device(backend.device) if backend.is_cuda else contextlib.nullcontext()
            with context, backend.stream_context("compute"):
                backend.launch("compute", probe, label="device speed probe")
            backend.synchronize()
    operands.clear()
    return [[backend.elapsed_s(start, end) for start, end in spans[index][1:]]  # the first round warms up
            for index, backend in enumerate(backends)]


def device_stage_budgets(engine: Any) -> list[int | None]:
    """Per device, bytes one stage may use: half of its memory (the next stage is prefetched):
    ``device_memory_bytes`` (per device) when given, else a GPU's measured usable memory (free less a margin) shared by the logical
    devices on it, lowered to what the profiled steps measured
    (:meth:`~lightning_roundpipe.runtime.backends.cuda.CudaBackend.measured_stage_budget`); ``None``:
    unlimited (CPU virtual devices without a budget)."""
    sharing: dict = {}
    for backend in engine.backends:
        sharing[backend.device] = sharing.get(backend.device, 0) + 1
    out: list[int | None] = []
    for backend, memory in zip(engine.backends, per_device_bytes(engine.device_memory_bytes, len(engine.backends))):
        budget = None if memory is None else memory // 2
        if budget is None and backend.is_cuda:
            from lightning_roundpipe.runtime.backends.cuda import usable_device_bytes

            budget = usable_device_bytes(backend.device) // (2 * sharing[backend.device])
        measured = backend.measured_stage_budget()
        if measured is not None:
            measured //= sharing[backend.device]
            budget = measured if budget is None else min(budget, measured)
        out.append(budget)
    return out


def _stage_devices(engine: Any, stages: Sequence[Any]) -> tuple[tuple[int, ...], ...] | None:
    """Per stage, the devices whose budget holds it; ``None`` when the budgets are equal (every stage
    may go anywhere, as in the round robin). From the partitioner's memory model on the measured
    profiles; before them, the stage's pooled bytes (its weights and, for a backward stage, its fp32
    gradient accumulator) against the budget.

    Raises:
        ValueError: a stage that fits no device (:func:`~lightning_roundpipe.partition.devices.stage_devices`).
    """
    budgets = device_stage_budgets(engine)
    if len(set(budgets)) <= 1:
        return None
    if engine.measured_profiles is not None:
        return stage_devices(engine.measured_profiles, stages, budgets)
    out: list[tuple[int, ...]] = [()] * (max(s.stage_index for s in stages) + 1)
    for spec in stages:
        need = engine.store.layout(spec.layers).total_bytes
        if spec.kind == "backward":
            need += 4 * engine.store.accumulator_numel(spec.layers)
        fits = tuple(d for d, budget in enumerate(budgets) if budget is None or need <= budget)
        if not fits:
            raise ValueError(f"RoundPipe: {spec.describe()} holds {need} bytes of weights (and fp32 gradient"
                             f" accumulators), more than any device's per-stage budget (half its memory: {budgets})."
                             " HINT: cut the stages finer (`forward_stages`/`backward_stages`) or give the devices"
                             " more memory (`device_memory_bytes`).")
        out[spec.stage_index] = fits
    return tuple(out)


def dispatch_policy(engine: Any, stages: Sequence[Any], rule: str | None = None) -> DispatchPolicy | None:
    """The :class:`~lightning_roundpipe.schedule.dispatch.DispatchPolicy` the engine's plans for
    ``stages`` are built with: ``rule`` (default: the engine's ``dispatch_rule``), the device speeds
    (``None`` for equal devices), and for the weighted rule the stage costs of the measured profiles
    (before them, 1 per forward layer and 3 per backward layer) and the devices that hold each
    stage. ``None``: the plain round robin on equal devices."""
    rule = rule or getattr(engine, "dispatch_rule", "round_robin")
    speeds = getattr(engine, "device_speeds", None)
    if rule == "round_robin":
        return None if speeds is None else DispatchPolicy("round_robin", tuple(speeds))
    profiles = engine.measured_profiles
    costs = None if profiles is None else stage_costs(profiles, stages)
    return DispatchPolicy("weighted", None if speeds is None else tuple(speeds), costs, _stage_devices(engine, stages))


def build_plan(engine: Any, stages: Sequence[Any], num_microbatches: int, cursor: int,
               microbatches_per_round: int | None, rule: str | None = None) -> ExecutionPlan:
    """The engine's plan for ``stages``
    (:func:`~lightning_roundpipe.schedule.roundpipe.build_roundpipe_plan` with :func:`dispatch_policy`).

    Raises:
        ValueError: as the builder, or a stage that fits no device's memory under the weighted rule.
    """
    return build_roundpipe_plan(stages, len(engine.backends), num_microbatches, cursor,
                                microbatches_per_round=microbatches_per_round,
                                dispatch=dispatch_policy(engine, stages, rule))


def describe_speeds(engine: Any) -> str:
    """The engine's device speeds for a message: ``"[1.00, 0.49]"``, or ``"equal"``."""
    speeds = getattr(engine, "device_speeds", None)
    return "equal" if speeds is None else "[" + ", ".join(f"{s:.2f}" for s in speeds) + "]"


def set_dispatch_rule(engine: Any, rule: str) -> None:
    """Build the engine's plans with ``rule`` from the next call on (cached plans are dropped)."""
    if rule not in DISPATCH_RULES:
        raise ValueError(f"`rule` must be one of {list(DISPATCH_RULES)}, got {rule!r}.")
    if getattr(engine, "dispatch_rule", "round_robin") != rule:
        engine.dispatch_rule = rule
        _drop_plans(engine)


def compares_rules(engine: Any) -> bool:
    """Whether the automatic choice times both dispatch rules: ``dispatch="auto"`` on several devices
    that differ in speed (measured or configured) or in memory."""
    if getattr(engine, "dispatch_mode", "auto") != "auto" or len(engine.backends) == 1:
        return False
    return getattr(engine, "device_speeds", None) is not None or len(set(device_stage_budgets(engine))) > 1


def describe_devices(engine: Any) -> str | None:
    """A line on the devices' speeds, memory and the dispatch rule (for the setup announcement);
    ``None`` for equal devices under the default rule."""
    speeds = getattr(engine, "device_speeds", None)
    budgets = per_device_bytes(engine.device_memory_bytes, len(engine.backends))
    mode = getattr(engine, "dispatch_mode", "auto")
    unequal_memory = len(set(budgets)) > 1
    if speeds is None and not unequal_memory and mode == "auto" and getattr(engine, "device_speeds_source", None) is None:
        return None
    parts = []
    if speeds is not None:
        parts.append(f"relative speeds {[round(s, 3) for s in speeds]} ({engine.device_speeds_source})")
    if unequal_memory:
        parts.append(f"memory {[None if b is None else round(b / 2**20, 1) for b in budgets]} MiB")
    what = "; ".join(parts) or "equal devices so far"
    rule = {"auto": "dispatch 'auto': round robin until the profiled steps are over (GPU speeds are measured"
                    " after the warm-up step), then the simulator compares it with the weighted dispatch and keeps"
                    " the faster",
            "round_robin": "dispatch 'round_robin' (stage k on device k mod D)",
            "weighted": "dispatch 'weighted': each stage to the device that would finish it first given its speed"
                        " and load, on devices whose memory holds it"}[mode]
    return f"RoundPipe: devices: {what}; {rule}."
