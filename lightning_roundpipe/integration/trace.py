"""Step traces and throughput for :class:`~lightning_roundpipe.integration.callbacks.RoundPipeMetricsCallback`.

- :class:`StepTracer`: every ``trace_every_n_steps`` training batches (the first one right after
  the profiled steps, when the automatic partition is in place and the simulator can predict the
  step), writes the step's Chrome/Perfetto trace (:func:`~lightning_roundpipe.metrics.trace.write_trace`)
  and a PNG (measured step above the simulator's timeline of the same programs) into
  ``<trainer.log_dir>/roundpipe/`` (nothing without a logger that has a folder), and hands both to the Trainer's W&B loggers (``wandb.Image``
  under ``roundpipe/timeline``, the trace as an artifact of type ``roundpipe-trace``); the plan
  (stages, cursor, microbatches, devices) goes to every logger's hyperparameters.
- :func:`throughput_metrics`: ``roundpipe/samples_per_s``, ``roundpipe/tokens_per_s``,
  ``roundpipe/mfu(%)`` and ``roundpipe/hfu(%)`` of one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils import _pytree as pytree

from lightning_roundpipe.config import DEFAULT_TRACE_EVERY_N_STEPS
from lightning_roundpipe.metrics.timeline import Timeline
from lightning_roundpipe.metrics.trace import HostSpan, join_timelines, write_trace
from lightning_roundpipe.runtime.tuning.flops import layer_flops, peak_flops_per_s, recompute_flops, step_model_flops
from lightning_roundpipe.schedule.program import OpKind, StreamProgram

__all__ = ["StepTracer", "throughput_metrics"]

def _log_dir(trainer: Any) -> Path | None:
    """The folder of the Trainer's logger, where the traces go (``trainer.log_dir`` without its
    broadcast, a collective: with several nodes only rank 0 traces, so it must not wait for the others):
    the first logger with a folder, its ``log_dir`` (TensorBoard, CSV) or ``save_dir``. ``None`` without
    such a logger: then no trace is written (not into ``default_root_dir``, the working directory or a
    checkpoint folder the user did not choose for them)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    for logger in trainer.loggers:
        folder = logger.log_dir if isinstance(logger, (TensorBoardLogger, CSVLogger)) else logger.save_dir
        if folder:
            return Path(folder)
    return None


# ---------------------------------------------------------------------------------------- throughput
def batch_size_of(batch: Any) -> tuple[int, int | None, int | None]:
    """``(samples, tokens, seq_len)`` of a training batch.

    Samples: dim 0 of the batch's first tensor. Tokens: for a mapping with an ``input_ids`` tensor
    (Hugging Face causal LMs), ``input_ids.numel()``: every position the model computes on, padding
    included (the FLOPs are spent on it; the attention-mask sum would count only real tokens), and
    ``seq_len`` its last dim; ``None`` for other batches.
    """
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        return int(ids.shape[0]), int(ids.numel()), int(ids.shape[-1])
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0]), None, None
    return 0, None, None


def _recomputed(programs: Sequence[StreamProgram], tokens: int) -> list[tuple[range, float]]:
    out = []
    for program in programs:
        share = tokens / program.plan.num_microbatches  # every R stage runs each microbatch once
        for _, _, _, op in program.ops():
            if op.kind is OpKind.R:
                out.append((program.plan.stages[op.stage_index].layers, share))
    return out


def throughput_metrics(engine: Any, batch: Any, step_s: float | None, programs: Sequence[StreamProgram],
                       peak_flops: float | None, compute_dtype: torch.dtype | None, prefix: str = "roundpipe",
                       cache: dict | None = None) -> dict[str, float]:
    """Throughput of one step (see :mod:`lightning_roundpipe.runtime.tuning.flops` for the FLOPs).

    Keys: ``samples_per_s``; for batches with ``input_ids`` (:func:`batch_size_of`) also
    ``tokens_per_s`` and, where the peak is known (``peak_flops``, else the GPU's entry in
    :data:`~lightning_roundpipe.runtime.tuning.flops.PEAK_FLOPS`; none on CPU), ``mfu(%)`` (model FLOPs
    / (``step_s`` x devices x peak)) and ``hfu(%)`` (the same with the recomputation).
    """
    samples, tokens, seq_len = batch_size_of(batch)
    if not step_s or step_s <= 0 or samples == 0:
        return {}
    out = {f"{prefix}/samples_per_s": samples / step_s}
    if tokens is None:
        return out
    out[f"{prefix}/tokens_per_s"] = tokens / step_s
    peak = peak_flops if peak_flops is not None else peak_flops_per_s(engine.devices[0], compute_dtype)
    if peak is None:
        return out
    cache = {} if cache is None else cache
    layers = cache.get(id(engine))
    if layers is None:
        layers = cache[id(engine)] = layer_flops(engine.seq.layers)
    model = step_model_flops(layers, tokens, seq_len)
    hardware = model + recompute_flops(layers, _recomputed(programs, tokens), seq_len)
    # physical GPUs: logical devices sharing one GPU (parallel_devices=[cuda:0] * 4) share its peak
    gpus = len({d for d in engine.devices}) if engine.devices[0].type == "cuda" else len(engine.devices)
    capacity = step_s * gpus * peak
    out[f"{prefix}/mfu(%)"] = 100.0 * model / capacity
    out[f"{prefix}/hfu(%)"] = 100.0 * hardware / capacity
    return out


# ---------------------------------------------------------------------------------------- traces
@dataclass
class StepRecord:
    """What one training batch ran, on the ``time.perf_counter()`` clock (seconds)."""

    timelines: list[Timeline]
    programs: list[StreamProgram]
    batch_start_s: float
    end_s: float
    optimizer_start_s: float | None = None


def plan_params(engine: Any, programs: Sequence[StreamProgram], prefix: str = "roundpipe") -> dict[str, Any]:
    """The plan of a step as hyperparameters: devices, microbatches, cursor, fused or not, stage table."""
    plan = programs[0].plan
    first = min(a.stage_index for acts in plan.actions for a in acts if a.kind.is_compute)
    stages = []
    for program in programs:
        for spec in program.plan.stages:
            row = f"{spec.stage_index} {'fused' if spec.fused else spec.kind} layers {spec.layers.start}..{spec.layers.stop - 1}"
            if row not in stages:
                stages.append(row)
    return {
        f"{prefix}/devices": len(engine.devices),
        f"{prefix}/device_names": [str(d) for d in engine.devices],
        f"{prefix}/num_microbatches": plan.num_microbatches,
        f"{prefix}/cursor": plan.device_of(first),
        f"{prefix}/fused": any(s.fused for s in plan.stages),
        f"{prefix}/stages": stages,
        f"{prefix}/forward_stages": [[r.start, r.stop] for r in engine.partition.forward_stages],
        f"{prefix}/backward_stages": [[r.start, r.stop] for r in engine.partition.backward_stages],
    }


@dataclass
class StepTracer:
    """Decides which batches are traced and writes/logs their trace and picture.

    Args:
        every_n_steps: trace every this many training batches (0: never), counted from the first
            batch that ran after the profiled steps (``engine.measured_profiles`` set; at the latest
            batch ``2 x profile_steps``, then without the simulator's panel).
    """

    every_n_steps: int = DEFAULT_TRACE_EVERY_N_STEPS
    first_batch: int | None = None
    batches: int = 0
    written: list[tuple[Path, Path]] = field(default_factory=list)
    _logged_plan: dict | None = None
    _warned_no_folder: bool = False

    def due(self, engine: Any) -> bool:
        """Call once per training batch, before ``engine.end_step()``: whether to trace this one."""
        batch = self.batches
        self.batches += 1
        if not self.every_n_steps:
            return False
        if self.first_batch is None:
            # wait for the profiled steps (the partition and the prediction); should a profile never
            # complete (no backward reached every layer), trace without a prediction after twice as many
            waiting = engine.measured_profiles is None and engine.profile_steps is not None
            if waiting and batch < 2 * engine.profile_steps:
                return False
            self.first_batch = batch
        return (batch - self.first_batch) % self.every_n_steps == 0

    def trace(self, trainer: Any, engine: Any, record: StepRecord, metrics: Mapping[str, float]) -> tuple[Path, Path] | None:
        """Write the step's trace JSON and PNG under ``<log_dir>/roundpipe/`` and log them; returns the paths
        (``None`` and nothing written without a logger folder: :func:`_log_dir`)."""
        log_dir = _log_dir(trainer)
        if log_dir is None:
            if self.every_n_steps != DEFAULT_TRACE_EVERY_N_STEPS and not self._warned_no_folder:
                self._warned_no_folder = True
                rank_zero_warn(f"RoundPipe: `trace_every_n_steps={self.every_n_steps}`, but the Trainer has no logger with a"
                               " folder, where the step traces go: none is written. HINT: add a logger, e.g."
                               " `Trainer(logger=CSVLogger(save_dir))`; its `log_dir`/roundpipe/ gets them.")
            return None
        if not record.timelines:
            return None
        origin = record.batch_start_s
        offsets = [(tl.origin_s if tl.origin_s is not None else origin) - origin for tl in record.timelines]
        step_s = record.end_s - origin
        measured = join_timelines(record.timelines, offsets, wall_s=step_s)
        phases = ["fused step" if any(s.fused for s in p.plan.stages) else
                  f"{p.plan.stages[min(a.stage_index for acts in p.plan.actions for a in acts)].kind} phase"
                  for p in record.programs]
        host = [HostSpan("main", name, offset, offset + tl.span_s())
                for name, offset, tl in zip(phases, offsets, record.timelines)]
        optimizer_s = 0.0
        if record.optimizer_start_s is not None:
            optimizer_s = record.end_s - record.optimizer_start_s
            host.append(HostSpan("optimizer", "optimizer step", record.optimizer_start_s - origin, step_s))
        predicted = self._predicted(engine, record.programs, optimizer_s)
        step = trainer.global_step
        folder = log_dir / "roundpipe"
        params = plan_params(engine, record.programs) if record.programs else {}
        wanted = ("roundpipe/step(s)", "roundpipe/predicted_step(s)", "roundpipe/bubble(%)", "roundpipe/tokens_per_s")
        meta = {"step": step, **params, **{k: metrics[k] for k in wanted if k in metrics}}
        try:
            json_path = write_trace(measured, folder / f"trace_step{step:06d}.json", host_spans=host,
                                    device_names=[f"device {i} ({d})" for i, d in enumerate(engine.devices)],
                                    metadata=meta)
            png_path = self._picture(measured, host, predicted, folder / f"timeline_step{step:06d}.png", step, optimizer_s)
        except OSError as error:
            rank_zero_warn(f"RoundPipe: could not write the step trace into {folder}: {error}")
            return None
        self.written.append((json_path, png_path))
        self._log(trainer, json_path, png_path, params, step)
        return json_path, png_path

    @staticmethod
    def _predicted(engine: Any, programs: Sequence[StreamProgram], optimizer_s: float) -> tuple[Timeline, list[HostSpan]] | None:
        if engine.measured_profiles is None or not programs:
            return None
        from lightning_roundpipe.runtime.tuning.optimizer_mode import predicted_optimizer_s
        from lightning_roundpipe.simulate import simulate_program

        # the prediction of `roundpipe/predicted_step(s)` (`predicted_run_step_s`, drained steps): the programs
        # timed with the microbatches' rows as run (8 rows in 3 microbatches: 3, 3, 2) and the optimizer
        # step predicted from the measured rate (the step's own before one is known)
        hardware = engine.hardware_model()
        parts = [simulate_program(p, engine.measured_profiles, hardware,
                                  microbatch_weights=engine.microbatch_weights(p.plan.num_microbatches)).timeline
                 for p in programs]
        joined = join_timelines(parts)
        pipeline_s = joined.span_s()
        predicted = predicted_optimizer_s(engine)
        optimizer_s = optimizer_s if predicted is None else predicted
        joined.wall_s = pipeline_s + optimizer_s
        host = [HostSpan("optimizer", "optimizer step (predicted)", pipeline_s, pipeline_s + optimizer_s)] if optimizer_s else []
        return joined, host

    @staticmethod
    def _picture(measured: Timeline, host: list[HostSpan], predicted: tuple[Timeline, list[HostSpan]] | None,
                 path: Path, step: int, optimizer_s: float) -> Path:
        from lightning_roundpipe.metrics.plot import plot_timelines

        panels = {f"step {step}, measured": measured}
        spans = {f"step {step}, measured": [s for s in host if s.thread == "optimizer"]}
        if predicted is not None:
            name = "simulator, same programs (measured layer times) + predicted optimizer"
            panels[name], spans[name] = predicted
        return plot_timelines(panels, path, share_time_axis=True, host_spans=spans)

    def _log(self, trainer: Any, json_path: Path, png_path: Path, params: dict, step: int) -> None:
        from lightning.pytorch.loggers import WandbLogger

        # the cursor moves every step: the plan is logged again only when its stages or microbatches change
        plan = {k: v for k, v in params.items() if not k.endswith("/cursor")}
        log_plan = bool(params) and plan != self._logged_plan
        for logger in trainer.loggers:
            if log_plan:
                logger.log_hyperparams(params)
            if isinstance(logger, WandbLogger):
                import wandb

                logger.log_image("roundpipe/timeline", [str(png_path)], step=step,
                                 caption=[f"step {step}: measured (top), simulated (bottom)"])
                run = logger.experiment
                artifact = wandb.Artifact(f"roundpipe-trace-{run.id}", type="roundpipe-trace",
                                          description="Chrome/Perfetto trace of one RoundPipe step (open in ui.perfetto.dev)",
                                          metadata={"step": step})
                artifact.add_file(str(json_path))
                run.log_artifact(artifact, aliases=[f"step{step}"])
        if log_plan:
            self._logged_plan = plan
