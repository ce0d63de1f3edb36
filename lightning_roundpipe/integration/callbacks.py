"""Callbacks the strategy adds: per-device RoundPipe metrics through the Trainer's loggers."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_roundpipe.integration.data_parallel import node_metrics
from lightning_roundpipe.metrics.step import step_metrics


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
    :func:`~lightning_roundpipe.runtime.memory.host_memory`). With
    ``RoundPipeStrategy(optimizer="async")`` also ``roundpipe/optimizer_thread(s)`` and
    ``roundpipe/optimizer_wait(s)`` (:meth:`AsyncOptimizer.pop_metrics`). Evaluation phases are
    not logged. With several nodes (one process each) rank 0 logs every node's keys with the
    node in them, ``roundpipe/node1/device0/bubble(%)``, plus ``roundpipe/allreduce(s)`` (the
    largest over the nodes of the main thread's seconds in the gradient all-reduce) and
    ``roundpipe/allreduce(bytes)`` (fp32 bytes each node all-reduced)
    (:func:`~lightning_roundpipe.integration.data_parallel.node_metrics`).
    """

    def __init__(self) -> None:
        self._batch_start: float | None = None
        self._optimizer_start: float | None = None

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
        engine.end_step()
        predicted = engine.predict_s(programs)
        if predicted is not None:
            predicted += optimizer_s or 0.0
        memory = engine.host_memory(trainer.optimizers)
        metrics = step_metrics(engine.pop_timelines(), step_s=step_s, optimizer_s=optimizer_s, predicted_step_s=predicted,
                               host_memory_bytes=memory.total_bytes)
        async_optimizer = getattr(trainer.strategy, "async_optimizer", None)
        if metrics and async_optimizer is not None:
            metrics.update(async_optimizer.pop_metrics())
        metrics = node_metrics(trainer.strategy, metrics)  # several nodes: rank 0 logs every node's keys
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def _drop(self, trainer: Any) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.pop_timelines()
            engine.pop_step_programs()

    @override
    def on_validation_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._drop(trainer)
