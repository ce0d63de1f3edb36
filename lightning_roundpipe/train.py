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

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _passive_openmp() -> str:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` for this process where that still takes effect; returns what happened
    (``"set"``, ``"given"``: the user's value is kept, ``"late"``: torch was imported first).

    libgomp (torch's OpenMP) reads the variable once, when torch is imported; by default the threads of
    an OpenMP team spin at every join waiting for cores. On a CPU shared with other busy processes they
    spin for cores others hold: the host optimizer step on the main job's 1.8 M LoRA parameters took
    0.4-1.1 s on average (up to 2.3 s) against 0.024 s with ``PASSIVE`` (docs/usage.md, "A CPU shared
    with other busy processes"). Waiting threads then sleep instead: a wake-up of microseconds per
    parallel region on an idle machine. ``python -m lightning_roundpipe.train`` and ``roundpipe train``
    import this module before torch, so the setting applies to them."""
    if "OMP_WAIT_POLICY" in os.environ:
        return "given"
    if "torch" in sys.modules:
        return "late"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "set"


_OPENMP = _passive_openmp()
"""What :func:`_passive_openmp` did at import (said in one line when the job starts)."""

_OPENMP_LINES = {
    "set": "OpenMP: OMP_WAIT_POLICY=PASSIVE (set by the app before torch was imported: threads waiting at a join"
           " sleep instead of spinning for cores that other processes hold; docs/usage.md). Keep libgomp's"
           " default with OMP_WAIT_POLICY=ACTIVE.",
    "late": "OpenMP: OMP_WAIT_POLICY is not set, and torch was imported before the app could set it: on a CPU"
            " shared with other busy processes the host optimizer step can take seconds (docs/usage.md)."
            " HINT: `export OMP_WAIT_POLICY=PASSIVE` before starting Python.",
}

import logging

# bitsandbytes (imported by PEFT whenever it is installed) warns at import, on CPUs with AVX512-BF16, that an
# optional kernel from the Hugging Face hub could not be loaded; it falls back to its own kernel, the job needs
# neither the hub nor that kernel, and the line reads like a required action. The app keeps it out of its log.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

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


def _is_multirun(mode: Any) -> bool:
    return str(mode).rpartition(".")[2] == "MULTIRUN"  # `${hydra:mode}` is a RunMode (None in the compose API)


def _run_name(mode: Any, task_name: str, override_dirname: str) -> str:
    """W&B run name: ``task_name``; in a multirun job ``task_name:<the job's overrides>`` (``hydra.job.override_dirname``)."""
    return f"{task_name}:{override_dirname}" if _is_multirun(mode) and override_dirname else str(task_name)


def _sweep_group(mode: Any, sweep_dir: str) -> str | None:
    """W&B group: the sweep's folder (``hydra.sweep.dir``) in a multirun job, else ``None`` (no group)."""
    return str(sweep_dir) if _is_multirun(mode) else None


def register_resolvers() -> None:
    """OmegaConf resolvers of ``conf/``: ``${rp_accelerator:}``, ``${rp_devices:2}`` (``conf/trainer``),
    ``${rp_run_name:mode,task_name,override_dirname}`` and ``${rp_sweep_group:mode,sweep_dir}`` (``conf/logger/wandb.yaml``)."""
    OmegaConf.register_new_resolver("rp_accelerator", _accelerator, replace=True)
    OmegaConf.register_new_resolver("rp_devices", _devices, replace=True)
    OmegaConf.register_new_resolver("rp_run_name", _run_name, replace=True)
    OmegaConf.register_new_resolver("rp_sweep_group", _sweep_group, replace=True)


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

    ``conf/trainer`` sets ``enable_checkpointing: false`` (Lightning adds no checkpoint of its own);
    when a ``ModelCheckpoint`` is among ``callbacks`` (``conf/callbacks/default.yaml`` has one that
    saves on interrupt only; ``callbacks=checkpoint`` also saves ``last.ckpt``) checkpointing is
    switched on, as Lightning refuses a ``ModelCheckpoint`` with ``enable_checkpointing=False``. With
    the progress bar on and none among ``callbacks``: where stdout is a terminal, the bar is a
    :class:`~lightning_roundpipe.recipes.callbacks.StepProgressBar` (``Epoch 0``, not ``Epoch 0/-2``,
    for a run limited by ``max_steps``) when ``rich`` is installed, else Lightning's default; where it
    is not (a file, a pipe), :class:`~lightning_roundpipe.recipes.callbacks.ProgressLines` prints a line
    every ``log_every_n_steps`` batches (a live bar would print nothing until it closes).

    ``precision=auto`` (``conf/trainer``'s default) becomes ``bf16-mixed`` where the accelerator computes
    bf16 natively and ``32-true`` elsewhere (:func:`~lightning_roundpipe.recipes.precision.resolve_precision`),
    with one ``rank_zero_info`` line saying what was detected, what was chosen and how to override it;
    the choice is written back into ``cfg.trainer.precision`` (the logged hyperparameters show what ran).

    Args:
        overrides: further ``Trainer`` arguments (they win over ``cfg.trainer``).
    """
    import sys

    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
    from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
    from lightning.pytorch.utilities.rank_zero import rank_zero_info
    from omegaconf import read_write

    from lightning_roundpipe.recipes.precision import resolve_precision

    callbacks = list(callbacks)
    kwargs: dict[str, Any] = {"strategy": strategy, "logger": loggers or False, "callbacks": callbacks}
    if any(isinstance(c, ModelCheckpoint) for c in callbacks):
        kwargs["enable_checkpointing"] = True
    kwargs.update(overrides)
    asked = kwargs.get("precision", cfg.trainer.get("precision"))
    precision, line = resolve_precision(asked, str(kwargs.get("accelerator", cfg.trainer.get("accelerator", "auto"))))
    if line is not None:
        rank_zero_info(line)
    if precision != asked:
        if "precision" in kwargs:
            kwargs["precision"] = precision
        else:
            with read_write(cfg.trainer):
                cfg.trainer.precision = precision
    progress_bar = kwargs.get("enable_progress_bar", cfg.trainer.get("enable_progress_bar", True))
    if progress_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
        from lightning_roundpipe.recipes.callbacks import ProgressLines, StepProgressBar

        if not (sys.stdout is not None and sys.stdout.isatty()):
            callbacks.append(ProgressLines())
        elif _RICH_AVAILABLE:
            callbacks.append(StepProgressBar())
    return hydra.utils.instantiate(cfg.trainer, **kwargs)


def _last_step_metrics(trainer: Any, tokens_per_batch: int | None) -> dict[str, float]:
    """``step_s``, ``bubble_pct`` and ``tokens_per_s`` of the last training step (RoundPipe's logged
    ``roundpipe/step(s)`` and ``roundpipe/bubble(%)``; tokens/s from ``roundpipe/tokens_per_s`` when
    the strategy logs it, else ``tokens_per_batch / step_s``). Empty without RoundPipe."""
    logged = {k: float(v) for k, v in getattr(trainer.strategy, "step_metrics", {}).items() if k.startswith("roundpipe/")}
    out: dict[str, float] = {}
    if "roundpipe/step(s)" in logged:
        out["step_s"] = logged["roundpipe/step(s)"]
    if "roundpipe/bubble(%)" in logged:
        out["bubble_pct"] = logged["roundpipe/bubble(%)"]
    if "roundpipe/tokens_per_s" in logged:
        out["tokens_per_s"] = logged["roundpipe/tokens_per_s"]
    elif tokens_per_batch and out.get("step_s"):
        out["tokens_per_s"] = tokens_per_batch / out["step_s"]
    return out


def _finish_wandb(loggers: list[Any], exit_code: int) -> None:
    """Finish the W&B run of the job (``wandb.finish``), so the next job of a sweep starts its own run.

    Lightning's ``WandbLogger`` reuses a run that is still in progress ("There is a wandb run already in
    progress") and never finishes one itself."""
    from lightning.pytorch.loggers import WandbLogger

    if any(isinstance(logger, WandbLogger) for logger in loggers):
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=exit_code)


def _log_lightning_once() -> None:
    """Print every Lightning log line once under Hydra.

    The ``lightning`` package's ``__init__`` adds a console handler (``INFO: ...``) to its ``lightning``
    logger and leaves propagation on; under Hydra the root logger has handlers too (console and
    ``<output_dir>/train.log``), so every Lightning (and RoundPipe ``rank_zero_info``) line appeared
    twice. Where the root logger has handlers, that console handler is removed: the lines then go once
    through Hydra's handlers, file included. Without root handlers (a plain script) nothing changes.
    """
    import logging

    import lightning

    console = getattr(lightning, "_console", None)
    if console is not None and logging.getLogger().hasHandlers():
        logging.getLogger("lightning").removeHandler(console)


def resolve_ckpt_path(ckpt_path: Any, trainer: Any) -> str | None:
    """The checkpoint ``Trainer.fit`` resumes from, for the ``ckpt_path`` key of ``conf/train.yaml``.

    ``None``: none (train from step 0). ``last``: the newest ``*.ckpt`` file (by modification time) in the
    job's checkpoint folders, the ``dirpath`` of every ``ModelCheckpoint`` among the trainer's callbacks and
    ``<default_root_dir>/checkpoints`` (``<output_dir>/checkpoints/``): there the job writes
    ``interrupted-step=<N>.ckpt`` on Ctrl+C or SIGTERM and, with ``callbacks=checkpoint``, ``last.ckpt``.
    This is Lightning's ``ckpt_path="last"`` (the newest of the last and on-exception checkpoints) for the
    job's own file names, which Lightning's search (``last*.ckpt`` only) would not find; as in Lightning,
    none found is a warning and training starts from step 0 (a command that resumes when there is
    something to resume, e.g. a SLURM job with a fixed ``hydra.run.dir`` that is requeued). Any other
    value is a path, relative to the working directory the job was started in
    (``hydra.utils.to_absolute_path``), passed on to Lightning (``best``, ``hpc`` and ``registry`` too).

    Args:
        ckpt_path: the config value (``str``, ``os.PathLike`` or ``None``).
        trainer: the ``lightning.pytorch.Trainer`` about to ``fit``.

    Returns:
        The path for ``Trainer.fit(..., ckpt_path=...)``, or ``None``.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

    if ckpt_path is None:
        return None
    if str(ckpt_path) in ("best", "hpc") or str(ckpt_path).startswith("registry"):
        return str(ckpt_path)  # Lightning's own special values
    if str(ckpt_path) != "last":
        return hydra.utils.to_absolute_path(str(ckpt_path))
    folders = [Path(cb.dirpath) for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    folders.append(Path(trainer.default_root_dir) / "checkpoints")
    found = {path.resolve() for folder in folders if folder.is_dir() for path in folder.glob("*.ckpt")}
    if not found:
        rank_zero_warn(f"`ckpt_path=last`: no checkpoint (`*.ckpt`) in {sorted({str(f) for f in folders})}; training"
                       " starts from step 0. HINT: to resume an earlier run, run in its folder"
                       " (`hydra.run.dir=<its output folder>`) or give the file: `'ckpt_path=\"<path>\"'`.")
        return None
    newest = max(found, key=lambda path: (path.stat().st_mtime_ns, str(path)))
    rank_zero_info(f"`ckpt_path=last`: resuming from {newest} (the newest of {len(found)} checkpoint(s)).")
    return str(newest)


def check_ckpt_file(ckpt_path: Any) -> None:
    """Check a ``ckpt_path`` that names a file before the model loads (the resume itself comes after the
    first validation): it exists and is a checkpoint, which ``torch.save`` writes as a zip archive.
    ``None``, ``last``, ``best``, ``hpc`` and ``registry...`` are left to :func:`resolve_ckpt_path`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the path is a folder, or a file that is not a checkpoint.
    """
    import zipfile

    if ckpt_path is None or str(ckpt_path) in ("last", "best", "hpc") or str(ckpt_path).startswith("registry"):
        return
    path = Path(hydra.utils.to_absolute_path(str(ckpt_path)))
    hint = (" HINT: give a `.ckpt` file the job wrote (`<output_dir>/checkpoints/interrupted-step=<N>.ckpt`), quoted"
            " where it holds `=`: `'ckpt_path=\"<path>\"'`; or `ckpt_path=last` with that run's `hydra.run.dir`.")
    if not path.exists():
        raise FileNotFoundError(f"`ckpt_path`: no such file, {path}.{hint}")
    if not path.is_file() or not zipfile.is_zipfile(path):
        raise ValueError(f"`ckpt_path`: {path} is not a checkpoint ({'a folder' if path.is_dir() else 'not a torch.save archive'})."
                         + hint)


def _sigterm_exit(exc: BaseException) -> int:
    """The exit status of a job that Lightning stopped on SIGTERM (``SIGTERMException``, raised after the
    ``on_exception`` hooks saved the adapter and checkpoint): the exception's own code where Lightning
    sets one (it does from Lightning-AI/pytorch-lightning#21623: 143), else 128 + SIGTERM = 143, the
    status a shell reports for a process that SIGTERM killed. Lightning 2.6 raises it without a code,
    which Python turns into status 0: a scheduler could not tell a preempted job from a finished one."""
    import signal

    code = getattr(exc, "code", None)
    return code if isinstance(code, int) and code != 0 else 128 + int(signal.SIGTERM)


def _steps_run(resumed_at: dict[str, int], global_step: int) -> str:
    """``"40 steps"``, or for a resumed fit ``"3 steps (from step 2 to 5)"``: the steps this process trained."""
    first = resumed_at.get("step", 0)
    return f"{global_step - first} steps" + (f" (from step {first} to {global_step})" if first else "")


def _say(line: str) -> None:
    """Print a result line (``val loss before: ...``, ``wall time: ...``) to stdout as it is, and write it
    to the log files of the root logger (Hydra's ``<output_dir>/train.log``) through their own handlers and
    format: a ``print`` reaches the console only, and logging it would print it twice on the console."""
    import logging

    print(line, flush=True)
    root = logging.getLogger()
    files = [handler for handler in root.handlers if isinstance(handler, logging.FileHandler)]
    if files:
        record = root.makeRecord(__name__, logging.INFO, __file__, 0, line, None, None)
        for handler in files:
            if record.levelno >= handler.level:
                handler.handle(record)


def run(cfg: DictConfig, start_s: float | None = None) -> dict[str, float]:
    """Build data, module, strategy and trainer from ``cfg``; validate, fit, validate.

    The W&B run (if ``logger`` has W&B) is finished when this returns or raises (exit code 1 then).
    An interrupt during ``fit`` (Ctrl+C, SIGTERM) saves the adapter and a checkpoint through the callbacks
    of ``conf/callbacks/default.yaml``; Lightning then exits the process with status 1 (Ctrl+C), and a
    SIGTERM ends it with status 143 (128 + SIGTERM, :func:`_sigterm_exit`). ``cfg.ckpt_path`` (a path,
    or ``last``: :func:`resolve_ckpt_path`) resumes ``fit`` from a checkpoint.

    Args:
        cfg: the composed config (``conf/train.yaml``).
        start_s: ``time.perf_counter()`` value the wall time counts from; ``None``: now.

    Returns:
        ``val_loss_before`` and ``val_loss_after`` (nats/token); the wall times in seconds:
        ``load_s`` (imports, model and data), ``validate_before_s``, ``fit_s``, ``validate_after_s``,
        ``total_s``; ``global_step``; with RoundPipe, the last training step's ``step_s`` (seconds),
        ``bubble_pct`` (mean over devices, %) and ``tokens_per_s``.

    Raises:
        TypeError: if a key of ``cfg.trainer`` or ``cfg.data`` has a value of the wrong type
            (:func:`~lightning_roundpipe.recipes.config_check.check_config_types`).
        ValueError: if the validation set is empty (no ``val/loss`` logged).
        SystemExit: with code 143 after a SIGTERM (the checkpoint saved), 1 after Ctrl+C (Lightning's).
    """
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_roundpipe.recipes.config_check import check_config_types

    check_config_types(cfg)  # a wrong type names its key here, before the model loads
    check_ckpt_file(cfg.get("ckpt_path"))  # and a checkpoint path that is no checkpoint
    _log_lightning_once()
    if _OPENMP in _OPENMP_LINES:
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        rank_zero_info(_OPENMP_LINES[_OPENMP])
    os.environ.setdefault("WANDB_MODE", "offline")
    start = time.perf_counter() if start_s is None else start_s
    pl.seed_everything(cfg.seed, workers=True)

    datamodule = hydra.utils.instantiate(cfg.data)
    module = hydra.utils.instantiate(cfg.model)
    strategy = hydra.utils.instantiate(cfg.strategy) if isinstance(cfg.strategy, DictConfig) else cfg.strategy
    loggers = _instantiate_dict(cfg.get("logger"))
    callbacks = _instantiate_dict(cfg.get("callbacks"))
    trainer: pl.Trainer = build_trainer(cfg, strategy, loggers, callbacks)
    exit_code = 1
    try:
        for logger in trainer.loggers:
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
        datamodule.setup("fit")
        times: dict[str, float] = {"load_s": time.perf_counter() - start}

        def validate() -> float:
            metrics = trainer.validate(module, datamodule=datamodule, verbose=False)
            if not metrics or "val/loss" not in metrics[0]:
                raise ValueError("No `val/loss` was logged. HINT: check `data.val_blocks` and `trainer.limit_val_batches`.")
            return float(metrics[0]["val/loss"])

        t = time.perf_counter()
        before = validate()
        times["validate_before_s"] = time.perf_counter() - t
        _say(f"val loss before: {before:.4f}")

        t = time.perf_counter()
        ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), trainer)
        # the job's checkpoints hold its hyperparameters (a `peft.LoraConfig`, the optimizer's partial), which
        # `torch.load(weights_only=True)` (torch's default since 2.6) refuses: load them as Lightning's docs say
        # for a trusted source
        from lightning.pytorch.callbacks import LambdaCallback

        resumed_at: dict[str, int] = {}  # the step fit starts from (after a checkpoint is restored)
        trainer.callbacks.append(LambdaCallback(on_train_start=lambda tr, _: resumed_at.setdefault("step", tr.global_step)))
        trainer.fit(module, datamodule=datamodule, **({"ckpt_path": ckpt_path, "weights_only": False} if ckpt_path else {}))
        times["fit_s"] = time.perf_counter() - t
        step = _last_step_metrics(trainer, getattr(datamodule, "tokens_per_batch", None))

        t = time.perf_counter()
        after = validate()
        times["validate_after_s"] = time.perf_counter() - t
        times["total_s"] = time.perf_counter() - start
        _say(f"val loss after: {after:.4f}")
        _say(f"wall time: {times['total_s']:.1f} s (load {times['load_s']:.1f} s, validate {times['validate_before_s']:.1f}"
             f" + {times['validate_after_s']:.1f} s, fit {times['fit_s']:.1f} s for {_steps_run(resumed_at, trainer.global_step)})")
        summary = {"val/loss_before": before, "val/loss_after": after, **{f"time/{k}": v for k, v in times.items()}}
        for logger in trainer.loggers:
            logger.log_metrics(summary, step=trainer.global_step)
            logger.save()  # CSVLogger buffers rows until save(); fit and validate are over

        if cfg.get("save_adapter") and hasattr(module.model, "peft_config"):
            adapter_dir = Path(cfg.paths.output_dir) / "adapter"
            module.model.save_pretrained(adapter_dir)
            _say(f"LoRA adapter saved to {adapter_dir}")
        exit_code = 0
        return {"val_loss_before": before, "val_loss_after": after, **times, "global_step": float(trainer.global_step),
                **step}
    except SIGTERMException as exc:
        exit_code = _sigterm_exit(exc)
        raise SystemExit(exit_code) from exc
    finally:
        _finish_wandb(trainer.loggers, exit_code)


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Hydra entry point: :func:`run`, then ``<output_dir>/metrics.json`` (what :func:`run` returned, with
    the job number and its overrides; read by the sweep summary, ``recipes/sweep.py``).

    Returns:
        ``metrics[cfg.optimized_metric]`` (default ``val_loss_after``): the objective of sweeps (Optuna).

    Raises:
        ValueError: if ``optimized_metric`` is not a key of the metrics.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    single_run = hydra_cfg.mode == RunMode.RUN  # in a sweep, each job counts from its own start
    metrics = run(cfg, start_s=_T0 if single_run else None)
    record = {"job": hydra_cfg.job.get("num"), "overrides": list(hydra_cfg.overrides.task), **metrics}
    (Path(cfg.paths.output_dir) / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
    key = cfg.get("optimized_metric") or "val_loss_after"
    if key not in metrics:
        raise ValueError(f"`optimized_metric={key!r}` is not one of the job's metrics {sorted(metrics)}."
                         " HINT: e.g. `optimized_metric=val_loss_after`.")
    return float(metrics[key])


if __name__ == "__main__":
    main()
