"""Lightning callbacks of the main job: the adapter on interrupt, a progress bar for step-limited runs,
and progress lines for output that is not a terminal."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override


class SaveAdapterOnException(Callback):
    """Saves the LoRA adapter (PEFT ``save_pretrained``) when ``fit`` is interrupted after a step.

    Runs in Lightning's ``on_exception`` hook, which ``Trainer.fit`` calls for ``KeyboardInterrupt``
    (Ctrl+C, SIGINT) and any other exception before it exits; Lightning then ends the process with
    ``sys.exit(1)`` (interrupt) or re-raises. Saves nothing during ``validate``/``test``/``predict``
    or before the first optimizer step; the checkpoint on interrupt is Lightning's own
    ``ModelCheckpoint(save_on_exception=True)`` (``conf/callbacks/default.yaml``).

    Args:
        dirpath: folder of the adapter (``adapter_config.json``, ``adapter_model.safetensors``).
        interrupt_only: save on an interrupt only (default): ``KeyboardInterrupt`` (Ctrl+C) and
            Lightning's ``SIGTERMException`` (SIGTERM); ``False``: on any exception.
        module: attribute of the LightningModule holding the PEFT model (default ``"model"``).
    """

    def __init__(self, dirpath: str | Path, interrupt_only: bool = True, module: str = "model") -> None:
        self.dirpath = Path(dirpath)
        self.interrupt_only = bool(interrupt_only)
        self.module = module
        self.saved_to: Path | None = None

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        # Ctrl+C, and SIGTERM (what SLURM, `timeout` and `kill` send; Lightning raises it after the step)
        if self.interrupt_only and not isinstance(exception, (KeyboardInterrupt, SIGTERMException)):
            return
        if trainer.state.fn != TrainerFn.FITTING or trainer.global_step == 0:
            return
        model = getattr(pl_module, self.module, None)
        if model is None or not hasattr(model, "peft_config"):
            return
        model.save_pretrained(self.dirpath)
        self.saved_to = self.dirpath
        rank_zero_info(f"{type(exception).__name__} after {trainer.global_step} steps: LoRA adapter saved to {self.dirpath}")


def with_roundpipe_metrics(metrics: dict[str, Any], trainer: Any) -> dict[str, Any]:
    """A progress bar's ``metrics`` plus RoundPipe's throughput and mean bubble of the last training batch
    (``roundpipe/tokens_per_s``, else ``roundpipe/samples_per_s``, and ``roundpipe/bubble(%)``), read from the
    strategy's ``step_metrics``: they stay out of the Trainer's ``progress_bar_metrics``, so only the main
    job's bars show them."""
    from lightning_roundpipe.integration.callbacks import PROGRESS_BAR_KEYS

    step = getattr(trainer.strategy, "step_metrics", None) or {}
    shown = {k: step[k] for k in PROGRESS_BAR_KEYS if k in step}
    if "roundpipe/tokens_per_s" in shown:
        shown.pop("roundpipe/samples_per_s", None)
    return {**metrics, **shown}


class StepProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar``, but a step-limited run (``max_steps`` set, ``max_epochs`` unset,
    which Lightning turns into ``max_epochs=-1``) shows ``Epoch 0`` instead of ``Epoch 0/-2``, and the
    RoundPipe throughput and bubble (:func:`with_roundpipe_metrics`).

    The bar's total is already ``max_steps`` in that case; only the description is changed.
    ``train.build_trainer`` installs it when the progress bar is on and no other is given.
    """

    @override
    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        return with_roundpipe_metrics(super().get_metrics(trainer, pl_module), trainer)

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        if len(self.validation_description) > len(description):  # as Lightning: no flicker beside "Validation"
            description = f"{description:{len(self.validation_description)}}"
        return description


class ProgressLines(ProgressBar):
    """Lightning's progress bar for output that is not a terminal (a file, a pipe, a SLURM log): one
    line through ``rank_zero_info`` (so also in Hydra's ``train.log``) every ``refresh_rate`` batches
    and at the last one, where a live bar would print nothing until it closes.

    A training line: ``Epoch 0: 10/40 (25%), 4.21 s/batch, 2.1 min left | train/loss=3.412, ...``
    (the progress-bar metrics, as Lightning's bars show them, and :func:`with_roundpipe_metrics`); validation, test and predict lines
    likewise, with their own descriptions. The count and total are Lightning's: batches of the epoch out
    of :attr:`total_train_batches` (``max_steps`` for a step-limited run), seconds per batch from the
    first batch's start. ``train.build_trainer`` installs it when the progress bar is on, none is
    given and stdout is not a terminal.

    Args:
        refresh_rate: batches between lines (the last batch always gets one); ``None``: the
            trainer's ``log_every_n_steps``.

    Raises:
        ValueError: if ``refresh_rate`` is not a positive int or ``None``.
    """

    def __init__(self, refresh_rate: int | None = None) -> None:
        super().__init__()
        if refresh_rate is not None and (isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int)
                                         or refresh_rate < 1):
            raise ValueError(f"`ProgressLines(refresh_rate={refresh_rate!r})` must be a positive int or None."
                             " HINT: None prints every `trainer.log_every_n_steps` batches.")
        self._refresh_rate = refresh_rate
        self._enabled = True
        self._started: dict[str, float] = {}
        self._totals: dict[str, int | float] = {}
        self._first: dict[str, int] = {}  # batches already done when the timing started (a resumed epoch)

    @property
    def refresh_rate(self) -> int:
        """Batches between lines."""
        if self._refresh_rate is not None:
            return self._refresh_rate
        return max(1, int(self.trainer.log_every_n_steps))

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self._enabled

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    def _start(self, kind: str, total: int | float, first: int = 0) -> None:
        self._started[kind] = time.perf_counter()
        self._totals[kind] = total
        self._first[kind] = first

    def _line(self, kind: str, description: str, done: int, metrics: dict[str, Any] | None = None) -> None:
        total = self._totals.get(kind, math.inf)
        last = math.isfinite(total) and done >= total
        if not self._enabled or (done % self.refresh_rate and not last):
            return
        now = time.perf_counter()
        per_batch_s = (now - self._started.get(kind, now)) / max(done - self._first.get(kind, 0), 1)
        if math.isfinite(total) and total > 0:
            left_s = per_batch_s * max(total - done, 0)
            left = f"{left_s / 60:.1f} min left" if left_s >= 60 else f"{left_s:.0f} s left"
            text = f"{description}: {done}/{int(total)} ({100 * done / total:.0f}%), {per_batch_s:.2f} s/batch, {left}"
        else:
            text = f"{description}: {done} batches, {per_batch_s:.2f} s/batch"
        if metrics:
            text += " | " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        rank_zero_info(text)

    @override
    def on_train_epoch_start(self, trainer: Any, *_: Any) -> None:
        self._start("train", self.total_train_batches)

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if "train" not in self._started:  # an epoch resumed mid-way (`ckpt_path`): Lightning skips its epoch start
            # `total_train_batches` caps the epoch at the steps left (max_steps - global_step), counted from
            # here; the lines count the epoch's batches from its start, so the cap moves by `batch_idx`
            total = trainer.num_training_batches
            if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
                total = min(total, batch_idx + trainer.max_steps - trainer.global_step)
            self._start("train", total, first=batch_idx)

    @override
    def on_train_epoch_end(self, trainer: Any, *_: Any) -> None:
        self._started.pop("train", None)

    @override
    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        return with_roundpipe_metrics(super().get_metrics(trainer, pl_module), trainer)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._line("train", f"Epoch {trainer.current_epoch}", batch_idx + 1, self.get_metrics(trainer, pl_module))

    def _eval_batch_start(self, kind: str, batch_idx: int, dataloader_idx: int) -> None:
        if self.has_dataloader_changed(dataloader_idx) or batch_idx == 0:  # the tracker first: totals read it
            self._start(kind, getattr(self, f"total_{kind}_batches_current_dataloader"))

    @override
    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._eval_batch_start("val", batch_idx, dataloader_idx)

    @override
    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        description = self.sanity_check_description if trainer.sanity_checking else self.validation_description
        self._line("val", description, batch_idx + 1)

    @override
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.reset_dataloader_idx_tracker()

    @override
    def on_test_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        self._eval_batch_start("test", batch_idx, dataloader_idx)

    @override
    def on_test_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self._line("test", self.test_description, batch_idx + 1)

    @override
    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self.reset_dataloader_idx_tracker()

    @override
    def on_predict_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None:
        self._eval_batch_start("predict", batch_idx, dataloader_idx)

    @override
    def on_predict_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self._line("predict", self.predict_description, batch_idx + 1)

    @override
    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self.reset_dataloader_idx_tracker()
