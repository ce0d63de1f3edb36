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

#: Keys shown in the progress bar (``prog_bar=True``), when logged.
PROGRESS_BAR_KEYS = ("roundpipe/tokens_per_s", "roundpipe/samples_per_s", "roundpipe/bubble(%)")


class RoundPipeMetricsCallback(Callback):
    """Logs :func:`~lightning_roundpipe.metrics.step_metrics` after every training batch, and tells
    the engine a step ended (the first steps are profiled for the automatic partition and the
    simulator's prediction).

    Keys look like ``roundpipe/device0/bubble(%)``; they go to every logger of the Trainer (W&B,
    CSV, TensorBoard) at the Trainer's ``log_every_n_steps``. ``roundpipe/step(s)`` is the whole
    batch (its programs, the gaps between them and the optimizer step), ``roundpipe/optimizer(s)``
    the optimizer step, ``roundpipe/predicted_step(s)`` the simulator's time for the programs this
    step ran, from the measured per-layer times, plus the measured optimizer time (after the
    profiled steps), ``roundpipe/host_memory(GiB)`` the host bytes of the model's parameters
    (masters, compute copies, gradients and their host buffers, optimizer state; see
    :func:`~lightning_roundpipe.runtime.host.memory.host_memory`), ``roundpipe/boundary_bytes_per_microbatch(bytes)``
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
    ``roundpipe/mfu(%)`` and ``roundpipe/hfu(%)`` (with recomputation). The progress bar shows
    tokens/s (samples/s without ``input_ids``) and the mean bubble.

    Every ``RoundPipeStrategy(trace_every_n_steps=...)`` batches (default 50, from the first batch
    after the profiled steps) the step's Chrome/Perfetto trace and timeline picture are written
    and logged (:class:`~lightning_roundpipe.integration.trace.StepTracer`).
    """

    def __init__(self) -> None:
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
        engine.end_step()
        predicted = engine.predict_s(programs)
        if predicted is not None:
            predicted += optimizer_s or 0.0
        memory = engine.host_memory(trainer.optimizers)
        timelines = engine.pop_timelines()
        metrics = step_metrics(timelines, step_s=step_s, optimizer_s=optimizer_s, predicted_step_s=predicted,
                               host_memory_bytes=memory.total_bytes, programs=programs)
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
            bar = {k: metrics.pop(k) for k in PROGRESS_BAR_KEYS if k in metrics}
            if "roundpipe/tokens_per_s" in bar:
                metrics["roundpipe/samples_per_s"] = bar.pop("roundpipe/samples_per_s")
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
            pl_module.log_dict(bar, on_step=True, on_epoch=False, batch_size=1, prog_bar=True)
            metrics.update(bar)
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
