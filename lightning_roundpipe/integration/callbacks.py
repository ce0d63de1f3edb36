"""Callbacks the strategy adds: per-device RoundPipe metrics through the Trainer's loggers."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_roundpipe.integration.data_parallel import node_metrics
from lightning_roundpipe.integration.trace import (
    DEFAULT_TRACE_EVERY_N_STEPS,
    StepRecord,
    StepTracer,
    throughput_metrics,
)
from lightning_roundpipe.metrics.step import step_metrics
from lightning_roundpipe.runtime.tuning.optimizer_mode import predicted_run_step_s, record_optimizer_step

#: The keys a progress bar of ours shows (the main job's ``recipes.callbacks``), when present.
PROGRESS_BAR_KEYS = ("roundpipe/tokens_per_s", "roundpipe/samples_per_s", "roundpipe/bubble(%)")


def log_to_loggers(trainer: Any, metrics: dict[str, float]) -> bool:
    """Hand ``metrics`` to every logger of ``trainer`` at the step and cadence of the user's own step
    metrics, without entering the user's metric dictionaries (``trainer.logged_metrics``,
    ``callback_metrics``, ``progress_bar_metrics``): at the batches Lightning logs
    (``log_every_n_steps``, every batch with ``fast_dev_run``; not while accumulating gradients with
    automatic optimization), as Lightning's ``ThroughputMonitor`` does. Returns whether it logged."""
    if not trainer.loggers or not metrics:
        return False
    connector = trainer._logger_connector
    if not (connector.should_update_logs or trainer.fast_dev_run):
        return False
    if trainer.fit_loop._should_accumulate() and trainer.lightning_module.automatic_optimization:
        return False
    step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step the user's metrics of this batch get
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=step)
        logger.save()
    return True


class RoundPipeMetricsCallback(Callback):
    """Logs :func:`~lightning_roundpipe.metrics.step_metrics` after every training batch, and tells
    the engine a step ended (the first steps are profiled for the automatic partition and the
    simulator's prediction).

    Keys look like ``roundpipe/device0/bubble(%)``; they go to every logger of the Trainer (W&B,
    CSV, TensorBoard) at the steps the user's own step metrics go (``log_every_n_steps``; not while
    accumulating gradients), as Lightning's ``ThroughputMonitor`` logs, and stay out of the user's
    metric dictionaries (``trainer.callback_metrics``, ``logged_metrics``, ``progress_bar_metrics``): read
    every step's values in :attr:`last_metrics` or the strategy's ``step_metrics``. ``roundpipe/step(s)`` is the whole
    batch (its programs, the gaps between them and the optimizer step), ``roundpipe/optimizer(s)``
    the optimizer step, ``roundpipe/predicted_step(s)`` the simulator's time for the programs this
    step ran, from the measured per-layer times, with the host's optimizer step (after the
    profiled steps; its bytes over the rate measured during them, DESIGN.md section 11: sync, added;
    async, the larger of the two,
    :func:`~lightning_roundpipe.runtime.tuning.optimizer_mode.step_with_optimizer_s`), ``roundpipe/host_memory(GiB)`` the host bytes of the model's parameters
    (masters, compute copies, gradients and their host buffers, optimizer state; see
    :func:`~lightning_roundpipe.runtime.host.memory.host_memory`), ``roundpipe/frozen_host_bytes_per_param(bytes)``
    and ``roundpipe/frozen_matmul_host_bytes_per_param(bytes)`` those bytes per frozen parameter and per frozen
    matmul weight parameter (about 1 with ``frozen_weights="fp8"``, 2 in bf16), ``roundpipe/h2d_weights(bytes)``
    the weight bytes uploaded in the step (all devices), ``roundpipe/boundary_bytes_per_microbatch(bytes)``
    the mean bytes of one microbatch's carry at a stage boundary, what each hop moves device -> host
    -> device (:func:`~lightning_roundpipe.metrics.step.boundary_hop_bytes`). With
    ``RoundPipeStrategy(optimizer="async")`` also ``roundpipe/optimizer_thread(s)`` and
    ``roundpipe/optimizer_wait(s)`` (:meth:`AsyncOptimizer.pop_metrics`). Evaluation phases are
    not logged (the engine keeps no timeline of them). With several nodes (one process each) rank 0
    logs every node's keys with the node in them, ``roundpipe/node1/device0/bubble(%)``, plus
    ``roundpipe/allreduce(s)`` (the largest over the nodes of the main thread's seconds in the
    gradient all-reduce) and ``roundpipe/allreduce(bytes)`` (fp32 bytes each node all-reduced)
    (:func:`~lightning_roundpipe.integration.data_parallel.node_metrics`).

    Throughput (:func:`~lightning_roundpipe.integration.trace.throughput_metrics`):
    ``roundpipe/samples_per_s`` (dim 0 of the batch over ``step(s)``), for batches with
    ``input_ids`` ``roundpipe/tokens_per_s`` (``input_ids.numel()``, padding included) and, where
    the device's peak FLOP/s is known (``RoundPipeStrategy(peak_flops=...)`` or a known GPU),
    ``roundpipe/mfu(%)`` and ``roundpipe/hfu(%)`` (with recomputation).

    Every ``RoundPipeStrategy(trace_every_n_steps=...)`` batches (default 50, from the first batch
    after the profiled steps) the step's Chrome/Perfetto trace and timeline picture are written into
    the logger's folder and logged (:class:`~lightning_roundpipe.integration.trace.StepTracer`); without
    a logger that has a folder, nowhere.
    """

    def __init__(self) -> None:
        self.last_metrics: dict[str, float] = {}
        """The last training batch's metrics (every batch, whatever the logging cadence; with several
        nodes rank 0's gathered keys, ``{}`` on the other ranks)."""
        self._batch_start: float | None = None
        self._optimizer_start: float | None = None
        self._tracer: StepTracer | None = None
        self._flops_cache: dict = {}

    @property
    def tracer(self) -> StepTracer | None:
        """The fit's :class:`StepTracer` (its ``written`` lists the trace and PNG paths)."""
        return self._tracer

    @override
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._tracer = None  # a new fit counts its batches from 0

    @override
    def on_train_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._drop(trainer)
        self._batch_start = time.perf_counter()
        self._optimizer_start = None

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._optimizer_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            return
        now = time.perf_counter()
        step_s = None if self._batch_start is None else now - self._batch_start
        optimizer_s = None if self._optimizer_start is None else now - self._optimizer_start
        programs = engine.pop_step_programs()
        tracer = self._tracer
        if tracer is None:
            tracer = self._tracer = StepTracer(getattr(trainer.strategy, "trace_every_n_steps", DEFAULT_TRACE_EVERY_N_STEPS) or 0)
        traced = tracer.due(engine)
        mode = getattr(trainer.strategy, "optimizer_mode", "sync")
        record_optimizer_step(engine, trainer.optimizers, _optimizer_seconds(trainer, optimizer_s, mode), mode)
        engine.end_step()
        predicted = predicted_run_step_s(engine, programs, optimizer_s)
        memory = engine.host_memory(trainer.optimizers)
        timelines = engine.pop_timelines()
        metrics = step_metrics(timelines, step_s=step_s, optimizer_s=optimizer_s, predicted_step_s=predicted,
                               host_memory_bytes=memory.total_bytes, programs=programs)
        for key, group in (("frozen", memory.frozen), ("frozen_matmul", memory.frozen_matmul)):
            if metrics and group.num_params:  # host bytes per frozen (matmul) parameter: 4 fp32, 2 bf16, ~1 fp8
                metrics[f"roundpipe/{key}_host_bytes_per_param(bytes)"] = group.total_bytes / group.num_params
        async_optimizer = getattr(trainer.strategy, "async_optimizer", None)
        if metrics and async_optimizer is not None:
            metrics.update(async_optimizer.pop_metrics())
        metrics = node_metrics(trainer.strategy, metrics)  # several nodes: rank 0 logs every node's keys
        peaks = engine.pop_step_memory_peaks()
        if metrics and peaks is not None:
            metrics.update({f"roundpipe/device{i}/peak_memory(GiB)": peak / 2**30 for i, peak in enumerate(peaks)})
        if metrics:
            precision = trainer.strategy.precision_plugin
            dtype = getattr(precision, "autocast_dtype", None) or getattr(precision, "compute_dtype", None)
            metrics.update(throughput_metrics(engine, batch, step_s, programs, getattr(trainer.strategy, "peak_flops", None),
                                              dtype, cache=self._flops_cache))
            log_to_loggers(trainer, metrics)
        self.last_metrics = metrics
        if hasattr(trainer.strategy, "step_metrics"):
            trainer.strategy.step_metrics = metrics
        if traced and metrics and self._batch_start is not None and trainer.is_global_zero:  # several nodes: rank 0's
            record = StepRecord(timelines, programs, self._batch_start, now, self._optimizer_start)
            tracer.trace(trainer, engine, record, metrics)

    def _drop(self, trainer: Any) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.pop_timelines()
            engine.pop_step_programs()

    @override
    def on_validation_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._drop(trainer)


def _optimizer_seconds(trainer: Any, main_thread_s: float | None, mode: str) -> float | None:
    """Seconds of the step's optimizer work for the host's optimizer rate: sync, the main thread's
    time from ``on_before_optimizer_step`` to the batch's end (clipping, ``optimizer.step()``, the
    weight refresh); async, the optimizer thread's time in optimizer steps since the metrics were last
    popped (the previous step's job, which this step waited for; the snapshot refresh the thread
    also runs is left out), ``None`` when it ran none."""
    if mode != "async":
        return main_thread_s
    stepper = getattr(getattr(trainer.strategy, "async_optimizer", None), "stepper", None)
    busy = getattr(stepper, "step_busy_s", 0.0)
    return busy if busy > 0 else None
