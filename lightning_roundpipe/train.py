"""The main job: ``python -m lightning_roundpipe.train [hydra overrides]``.

Fine-tunes SmolLM2-135M-Instruct with LoRA on Shakespeare with ``strategy=roundpipe`` (configs in the
top-level ``conf/`` folder, shipped in the wheel as ``lightning_roundpipe/conf``; see ``docs/main_job.md``). Prints the validation loss before and after
training and the wall time::

    python -m lightning_roundpipe.train
    python -m lightning_roundpipe.train experiment=ci
    python -m lightning_roundpipe.train trainer.max_steps=5 trainer.devices=3 strategy.num_microbatches=4
    python -m lightning_roundpipe.train strategy=auto          # plain Lightning, one device
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_roundpipe import _IMPORT_START_S

_T0 = _IMPORT_START_S
"""Where the printed wall time of a single run counts from: the moment Python began importing the
``lightning_roundpipe`` package, which ``python -m lightning_roundpipe.train`` (and ``roundpipe train``)
does first, before torch and Lightning. It covers every import, model and data loading, validation
and fitting; it leaves out the interpreter's own start-up (tens of ms) and whatever the shell ran
before (``bash -c "...; python ..."`` execs the last command in the shell's process, so the process
start time would count the earlier commands too)."""


def _conf_dir() -> Path:
    packaged = Path(__file__).resolve().parent / "conf"  # an installed wheel (setup.py ships conf/ there)
    return packaged if (packaged / "train.yaml").is_file() else Path(__file__).resolve().parent.parent / "conf"


CONF_DIR = _conf_dir()
"""The Hydra config folder: ``lightning_roundpipe/conf`` of an installed wheel, else the top-level ``conf/``
of the source tree (an editable install, or the repository on ``PYTHONPATH``)."""


def _accelerator() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _devices(cpu_devices: int = 2) -> int:
    """Every GPU where CUDA is present, else ``cpu_devices`` CPU virtual devices."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else int(cpu_devices)


def register_resolvers() -> None:
    """OmegaConf resolvers used by ``conf/trainer``: ``${rp_accelerator:}``, ``${rp_devices:2}``."""
    OmegaConf.register_new_resolver("rp_accelerator", _accelerator, replace=True)
    OmegaConf.register_new_resolver("rp_devices", _devices, replace=True)


register_resolvers()


def _instantiate_dict(node: DictConfig | None) -> list[Any]:
    """Instantiate every entry with a ``_target_`` of a ``{name: config}`` group (loggers, callbacks)."""
    if not node:
        return []
    return [
        hydra.utils.instantiate(value)
        for value in node.values()
        if isinstance(value, DictConfig) and "_target_" in value
    ]


def build_trainer(cfg: DictConfig, strategy: Any, loggers: list[Any], callbacks: list[Any], **overrides: Any) -> Any:
    """The ``lightning.pytorch.Trainer`` of ``cfg.trainer`` with the given strategy, loggers and callbacks.

    ``conf/trainer`` sets ``enable_checkpointing: false`` (no checkpoint by default); when a
    ``ModelCheckpoint`` is among ``callbacks`` (``callbacks=checkpoint``) checkpointing is switched on,
    as Lightning refuses a ``ModelCheckpoint`` with ``enable_checkpointing=False``.

    Args:
        overrides: further ``Trainer`` arguments (they win over ``cfg.trainer``).
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    kwargs: dict[str, Any] = {"strategy": strategy, "logger": loggers or False, "callbacks": callbacks}
    if any(isinstance(c, ModelCheckpoint) for c in callbacks):
        kwargs["enable_checkpointing"] = True
    kwargs.update(overrides)
    return hydra.utils.instantiate(cfg.trainer, **kwargs)


def run(cfg: DictConfig, start_s: float | None = None) -> dict[str, float]:
    """Build data, module, strategy and trainer from ``cfg``; validate, fit, validate.

    Args:
        cfg: the composed config (``conf/train.yaml``).
        start_s: ``time.perf_counter()`` value the wall time counts from; ``None``: now.

    Returns:
        ``val_loss_before`` and ``val_loss_after`` (nats/token) and the wall times in seconds:
        ``load_s`` (imports, model and data), ``validate_before_s``, ``fit_s``, ``validate_after_s``, ``total_s``.

    Raises:
        ValueError: if the validation set is empty (no ``val/loss`` logged).
    """
    import lightning.pytorch as pl

    os.environ.setdefault("WANDB_MODE", "offline")
    start = time.perf_counter() if start_s is None else start_s
    pl.seed_everything(cfg.seed, workers=True)

    datamodule = hydra.utils.instantiate(cfg.data)
    module = hydra.utils.instantiate(cfg.model)
    strategy = hydra.utils.instantiate(cfg.strategy) if isinstance(cfg.strategy, DictConfig) else cfg.strategy
    loggers = _instantiate_dict(cfg.get("logger"))
    callbacks = _instantiate_dict(cfg.get("callbacks"))
    trainer: pl.Trainer = build_trainer(cfg, strategy, loggers, callbacks)
    for logger in trainer.loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    datamodule.setup("fit")
    times = {"load_s": time.perf_counter() - start}

    def validate() -> float:
        metrics = trainer.validate(module, datamodule=datamodule, verbose=False)
        if not metrics or "val/loss" not in metrics[0]:
            raise ValueError("No `val/loss` was logged. HINT: check `data.val_blocks` and `trainer.limit_val_batches`.")
        return float(metrics[0]["val/loss"])

    t = time.perf_counter()
    before = validate()
    times["validate_before_s"] = time.perf_counter() - t
    print(f"val loss before: {before:.4f}", flush=True)

    t = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    times["fit_s"] = time.perf_counter() - t

    t = time.perf_counter()
    after = validate()
    times["validate_after_s"] = time.perf_counter() - t
    times["total_s"] = time.perf_counter() - start
    print(f"val loss after: {after:.4f}", flush=True)
    print(
        f"wall time: {times['total_s']:.1f} s (load {times['load_s']:.1f} s, validate {times['validate_before_s']:.1f}"
        f" + {times['validate_after_s']:.1f} s, fit {times['fit_s']:.1f} s for {trainer.global_step} steps)",
        flush=True,
    )
    summary = {"val/loss_before": before, "val/loss_after": after, **{f"time/{k}": v for k, v in times.items()}}
    for logger in trainer.loggers:
        logger.log_metrics(summary)

    if cfg.get("save_adapter") and hasattr(module.model, "peft_config"):
        adapter_dir = Path(cfg.paths.output_dir) / "adapter"
        module.model.save_pretrained(adapter_dir)
        print(f"LoRA adapter saved to {adapter_dir}", flush=True)
    return {"val_loss_before": before, "val_loss_after": after, **times}


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Hydra entry point; returns the final validation loss (the objective of sweeps)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    single_run = HydraConfig.get().mode == RunMode.RUN  # in a sweep, each job counts from its own start
    return run(cfg, start_s=_T0 if single_run else None)["val_loss_after"]


if __name__ == "__main__":
    main()
