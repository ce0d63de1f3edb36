"""The run's optimizer mode and the host's optimizer step in the engine's predictions (DESIGN.md section 11).

The optimizer step is an op of the simulated program (``OPT``), timed as the bytes it touches over
the host's optimizer rate. The rate is measured here during the profiled steps: the strategy's
metrics callback passes each step's optimizer seconds (:func:`record_optimizer_step`), and the rate
is ``bytes touched / seconds``, where the bytes are each trainable parameter's own bytes plus those
of its optimizer state tensors of the same size (fp32 Adam: ``4 x (1 + 2)`` bytes per parameter,
:func:`optimizer_state_bytes`), so that the plan command's ``optimizer_step_bytes`` and a measured
run count alike. The median over the profiled steps after the first (which creates the state) is
kept.

Functions of a :class:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine` (passed in,
duck-typed; its attributes ``optimizer_mode`` and ``overlaps_steps`` are read when present) and of
torch optimizers. No Lightning.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any, Iterable

import torch

__all__ = ["measured_optimizer_rate", "mode_step_s", "optimizer_state_bytes", "predicted_optimizer_s",
           "predicted_run_step_s", "record_optimizer_step", "run_mode", "steady_state_prediction", "step_with_optimizer_s",
           "steps_overlap"]

#: Profiled steps kept (the first is dropped: it creates the optimizer state).
MAX_SAMPLES = 16


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes one step of ``optimizers`` touches, as the rate counts them: per trainable parameter
    (``requires_grad``, in a parameter group; each counted once), its bytes plus the bytes of its
    state tensors with as many elements (Adam's two moments; not the scalar ``step``).

    Raises:
        TypeError: ``optimizers`` holds something without ``param_groups``.
    """
    seen: set[int] = set()
    total = 0
    for optimizer in optimizers:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"`optimizers` must hold torch optimizers, got {type(optimizer).__name__}.")
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                total += param.numel() * param.element_size()
                # a snapshot (the async optimizer's thread may be stepping meanwhile; it updates in place)
                for value in tuple(optimizer.state.get(param, {}).values()):
                    if isinstance(value, torch.Tensor) and value.numel() == param.numel():
                        total += value.numel() * value.element_size()
    return total


def record_optimizer_step(engine: Any, optimizers: Iterable[torch.optim.Optimizer], seconds: float | None,
                          mode: str = "sync") -> None:
    """Record one measured optimizer step while the engine profiles its layers (no-op otherwise, or
    for ``seconds`` ``None`` or not positive); remember the run's optimizer ``mode`` for the
    automatic choice. Call before ``engine.end_step()``.

    Args:
        engine: the engine.
        optimizers: the step's optimizers (the rate's bytes: :func:`optimizer_state_bytes`).
        seconds: wall seconds of the step (clipping, ``optimizer.step()``, the weight refresh).
        mode: ``"sync"`` or ``"async"``.
    """
    engine.optimizer_mode = mode
    profiler = getattr(getattr(engine, "executor", None), "profiler", None)
    if profiler is None or not profiler.enabled or seconds is None or not seconds > 0:
        return
    nbytes = optimizer_state_bytes(optimizers)
    samples = engine.__dict__.setdefault("_optimizer_samples", [])
    if len(samples) < MAX_SAMPLES:
        samples.append((nbytes, float(seconds)))


def measured_optimizer_rate(engine: Any) -> float | None:
    """The host's optimizer rate, bytes/s: the median of ``bytes / seconds`` over the recorded steps
    after the first (all of them when there is one); ``None`` before any."""
    samples = getattr(engine, "_optimizer_samples", None)
    if not samples:
        return None
    kept = samples[1:] or samples
    return statistics.median(nbytes / seconds for nbytes, seconds in kept)


def predicted_optimizer_s(engine: Any) -> float | None:
    """Seconds of one optimizer step: the last recorded step's bytes over the measured rate;
    ``None`` before any step was recorded."""
    rate = measured_optimizer_rate(engine)
    if rate is None or rate <= 0:
        return None
    return engine._optimizer_samples[-1][0] / rate


def run_mode(engine: Any) -> str:
    """The run's optimizer mode as recorded (``"sync"`` until told otherwise)."""
    return getattr(engine, "optimizer_mode", "sync")


def steps_overlap(engine: Any) -> bool:
    """Whether the engine runs consecutive steps as one steady-state program (the next step's forward
    stages during this step's drain: ``engine.overlaps_steps``, set by an engine that does)."""
    return bool(getattr(engine, "overlaps_steps", False))


def step_with_optimizer_s(engine: Any, pipeline_s: float | None, measured_optimizer_s: float | None = None) -> float | None:
    """A step's predicted seconds with the optimizer step, for an engine that drains every step:
    sync, the pipeline then the optimizer (``pipeline + OPT``); async, the optimizer of the previous
    step runs during this step's pipeline and the next step waits for it (``max(pipeline, OPT)``).
    ``OPT`` is :func:`predicted_optimizer_s`, or ``measured_optimizer_s`` (the step's own, added as
    is) before the rate is known. ``None`` when ``pipeline_s`` is ``None``."""
    if pipeline_s is None:
        return None
    optimizer_s = predicted_optimizer_s(engine)
    if optimizer_s is None:
        return pipeline_s + (measured_optimizer_s or 0.0)
    return max(pipeline_s, optimizer_s) if run_mode(engine) == "async" else pipeline_s + optimizer_s


def mode_step_s(engine: Any, drained_s: float, fused_stages: Any, profiles: Any,
                microbatches_per_round: int | None, num_microbatches: int, dispatch: Any = None) -> float:
    """Seconds of one step in the run's own mode, for the automatic choice.

    An engine that runs the steady state (:func:`steps_overlap`), on the fused path
    (``fused_stages``, else ``None``): the steady-state program's step
    (:func:`steady_state_prediction` in the run's mode). Otherwise the drained step ``drained_s``
    (the simulator's time of the programs one step runs) with the optimizer step
    (:func:`step_with_optimizer_s`). ``dispatch``: the plans'
    :class:`~lightning_roundpipe.schedule.dispatch.DispatchPolicy` (``None``: the round robin on
    equal devices).
    """
    if fused_stages is None or not steps_overlap(engine):
        return step_with_optimizer_s(engine, drained_s)
    return steady_state_prediction(engine, fused_stages, profiles, microbatches_per_round, num_microbatches,
                                   dispatch=dispatch).step_s


def steady_state_prediction(engine: Any, fused_stages: Any, profiles: Any, microbatches_per_round: int | None,
                            num_microbatches: int, *, mode: str | None = None, accumulate_grad_batches: int = 1,
                            dispatch: Any = None) -> Any:
    """The simulator's whole steady-state result for the engine's fused stages (DESIGN.md section 11).

    The steady-state program of ``mode``
    (:func:`~lightning_roundpipe.schedule.roundpipe.build_steady_state_plan`, lowered with the
    engine's byte sizes and chunks), simulated with the host's ``OPT`` op of
    :func:`predicted_optimizer_s` seconds (0 before the rate is measured). Windows: sync, one
    optimizer step (``accumulate_grad_batches`` batches); async, from window 2 over the round
    robin's rotations (:func:`~lightning_roundpipe.simulate.steady.rotation_windows`).

    Args:
        engine: the engine (its devices, store, chunk size, microbatch weights, hardware model).
        fused_stages: the fused path's stages, in plan order.
        profiles: the layers' measured profiles.
        microbatches_per_round: rounds of at most this many microbatches (``None``: one round).
        num_microbatches: microbatches per batch.
        mode: ``"sync"`` or ``"async"`` (``None``: the run's, :func:`run_mode`).
        accumulate_grad_batches: batches per optimizer step (>= 1).
        dispatch: the plans' dispatch policy (``None``: the round robin on equal devices).

    Returns:
        The :class:`~lightning_roundpipe.simulate.steady.TrainingPrediction`: ``step_s`` (seconds
        per batch) and ``mean_idle_pct`` (%) over the measured windows, among others.

    Raises:
        ValueError: ``mode`` is not ``"sync"`` or ``"async"``, or ``accumulate_grad_batches`` < 1.
    """
    from lightning_roundpipe.simulate.steady import DEFAULT_WINDOWS, rotation_windows, simulate_steady_program

    mode = run_mode(engine) if mode is None else mode
    if mode not in DEFAULT_WINDOWS:
        raise ValueError(f"`mode` must be one of {sorted(DEFAULT_WINDOWS)}, got {mode!r}.")
    if not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
        raise ValueError(f"`accumulate_grad_batches` must be an int >= 1, got {accumulate_grad_batches!r}.")
    windows, first = DEFAULT_WINDOWS[mode]
    if mode == "async":
        rounds = -(-num_microbatches // (microbatches_per_round or num_microbatches))
        windows = first + 1 + rotation_windows(len(fused_stages), len(engine.backends), rounds)
    program = _steady_program(
        tuple(fused_stages), len(engine.backends), num_microbatches, windows, mode, accumulate_grad_batches,
        microbatches_per_round, dispatch,
        tuple((s.layers, engine.store.stage_bytes(s.layers), engine.store.stage_grad_bytes(s.layers))
              for s in fused_stages), engine.chunk_bytes)
    return simulate_steady_program(program, profiles, engine.hardware_model(),
                                   optimizer_step_s=predicted_optimizer_s(engine) or 0.0, measure_from_window=first,
                                   microbatch_weights=engine.microbatch_weights(num_microbatches))


@functools.lru_cache(maxsize=32)
def _steady_program(fused_stages: tuple, num_devices: int, num_microbatches: int, windows: int, mode: str,
                    accumulate_grad_batches: int, microbatches_per_round: int | None, dispatch: Any,
                    stage_sizes: tuple[tuple[range, int, int], ...], chunk_bytes: int) -> Any:
    """The lowered steady-state program of :func:`steady_state_prediction` (pure, so cached: the metrics callback
    predicts every step, and lowering a program of several iterations costs milliseconds of Python
    that, on CPU virtual devices, the devices' own threads wait for). ``stage_sizes``: per stage,
    (layers, weight bytes, gradient bytes); ``windows`` optimizer steps of ``accumulate_grad_batches``
    iterations each."""
    from lightning_roundpipe.schedule.roundpipe import build_steady_state_plan
    from lightning_roundpipe.schedule.steady import lower_steady_state

    plan = build_steady_state_plan(list(fused_stages), num_devices, num_microbatches, windows * accumulate_grad_batches,
                                   optimizer=mode, accumulate_grad_batches=accumulate_grad_batches,
                                   microbatches_per_round=microbatches_per_round, validate=False, dispatch=dispatch)
    sizes = {layers: (weight, grad) for layers, weight, grad in stage_sizes}
    return lower_steady_state(
        plan, stage_weight_bytes=[sizes[s.layers][0] for s in plan.stages],
        stage_grad_bytes=[sizes[s.layers][1] if s.kind == "backward" else 0 for s in plan.stages],
        chunk_bytes=chunk_bytes, validate=False)


def predicted_run_step_s(engine: Any, programs: Any, measured_optimizer_s: float | None = None) -> float | None:
    """``roundpipe/predicted_step(s)`` of a step that ran ``programs``: for an engine in the steady
    state (:func:`steps_overlap`) whose last call was fused, the steady-state program's step
    (:func:`mode_step_s`: the time between two steps' ends, drain overlapped); else the drained
    programs' time with the optimizer step (:func:`step_with_optimizer_s`). ``None`` before the
    profiled steps are over."""
    drained = engine.predict_s(programs)
    last = getattr(engine, "_last_call", None)
    if drained is None or not steps_overlap(engine) or last is None or not last[1]:
        return step_with_optimizer_s(engine, drained, measured_optimizer_s)
    return mode_step_s(engine, drained, engine.fused_stages, engine.measured_profiles,
                       engine.microbatches_per_round, last[0])
