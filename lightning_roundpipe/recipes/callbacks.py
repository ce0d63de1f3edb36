"""Lightning callbacks of the main job: the adapter on interrupt, and a progress bar for step-limited runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, RichProgressBar
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


class StepProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar``, but a step-limited run (``max_steps`` set, ``max_epochs`` unset,
    which Lightning turns into ``max_epochs=-1``) shows ``Epoch 0`` instead of ``Epoch 0/-2``.

    The bar's total is already ``max_steps`` in that case; only the description is changed.
    ``train.build_trainer`` installs it when the progress bar is on and no other is given.
    """

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        if len(self.validation_description) > len(description):  # as Lightning: no flicker beside "Validation"
            description = f"{description:{len(self.validation_description)}}"
        return description
