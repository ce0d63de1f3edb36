"""Callbacks the strategy adds: per-device RoundPipe metrics through the Trainer's loggers."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_roundpipe.metrics.step import step_metrics


class RoundPipeMetricsCallback(Callback):
    """Logs :func:`~lightning_roundpipe.metrics.step_metrics` after every training batch, and tells
    the engine a step ended (the automatic partition profiles the first steps).

    Keys look like ``roundpipe/device0/bubble(%)``; they go to every logger of the Trainer (W&B,
    CSV, TensorBoard) at the Trainer's ``log_every_n_steps``. Evaluation phases are not logged.
    """

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:
            return
        engine.end_step()
        metrics = step_metrics(engine.pop_timelines())
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def _drop(self, trainer: Any) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.pop_timelines()

    @override
    def on_validation_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._drop(trainer)

    @override
    def on_train_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._drop(trainer)
