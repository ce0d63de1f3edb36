"""`RoundPipeStrategy`: ``Trainer(strategy="roundpipe")``.

One process per node (a ``ParallelStrategy`` with ``world_size = num_nodes``; with one node no
process group is made): the LightningModule (its parameters are the master weights), the
optimizer and the batches stay on the CPU; ``parallel_devices`` are the stateless workers the
:class:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine` dispatches stages to round-robin. The
strategy only adapts Lightning's hooks: find the module, build the engine in ``setup``, install the
pipelined forward, and close it in ``teardown``; with ``optimizer="async"`` it also hands the
optimizer steps to :class:`~lightning_roundpipe.integration.async_step.AsyncOptimizer`. Across
nodes the host gradients are averaged before the optimizer step
(:mod:`~lightning_roundpipe.integration.data_parallel`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.adapters.find import find_pipelined_module
from lightning_roundpipe.adapters.base import check_not_compiled
from lightning_roundpipe.config import DEFAULT_STALENESS_LAMBDA, DEFAULT_TRACE_EVERY_N_STEPS, DataParallel, RoundPipeConfig
from lightning_roundpipe.integration import data_parallel as dp
from lightning_roundpipe.integration.async_step import STALENESS_CHECKPOINT_KEY, AsyncOptimizer
from lightning_roundpipe.integration.frozen_fp8 import FrozenFp8
from lightning_roundpipe.integration.precision import RoundPipePrecision, frozen_rounding_note
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
from lightning_roundpipe.runtime.execution.replica import diverged_attributes
from lightning_roundpipe.runtime.backends import smallest_stage_budget
from lightning_roundpipe.runtime.tuning.autopartition import describe_rounds, follow_profiles
from lightning_roundpipe.runtime.tuning.mixed import configure_devices, describe_devices
from lightning_roundpipe.runtime.tuning.plan_state import CHECKPOINT_KEY, plan_state, restore_plan_state
from lightning_roundpipe.schedule.lower import DEFAULT_CHUNK_BYTES

StageRanges = Sequence[range | tuple[int, int] | Sequence[int]]


def format_stage_table(stages: Sequence[Any], layer_names: Sequence[str]) -> str:
    """The stage table of the announcement: one row per stage (index, kind, layer range, layer names).

    Args:
        stages: :class:`~lightning_roundpipe.schedule.StageSpec` s in dispatch order.
        layer_names: the layer sequence's labels (``LayerSequence.layer_names``).
    """
    rows = ["  stage  kind      layers   names"]
    for stage in stages:
        first, last = stage.layers.start, stage.layers.stop - 1
        label = layer_names[first] if first == last else f"{layer_names[first]} .. {layer_names[last]}"
        kind = "fused" if stage.fused else stage.kind
        rows.append(f"  {stage.stage_index:5d}  {kind:8s}  {first:>3d}..{last:<3d}  {label}")
    return "\n".join(rows)


def stage_memory_bytes(devices: Sequence[torch.device], device_memory_bytes: int | Sequence[int] | None) -> int | None:
    """The memory budget of one stage on one worker: half of a device's memory (double buffering: the
    next stage is prefetched). ``device_memory_bytes`` (one worker's memory; with one per worker, the
    smallest) when given; else, on GPUs, the first GPU's measured usable memory
    (:func:`~lightning_roundpipe.runtime.backends.cuda.usable_device_bytes`: free memory less a margin,
    not ``total_memory``) shared by the logical workers on one GPU
    (``parallel_devices=[torch.device("cuda:0")] * 4``: four workers with their own streams on one
    GPU; the most crowded GPU counts); ``None`` on CPU virtual devices without a budget."""
    if device_memory_bytes is not None:
        return smallest_stage_budget(device_memory_bytes)
    first = torch.device(devices[0])
    if first.type != "cuda":
        return None
    counts: dict[int, int] = {}
    for d in map(torch.device, devices):
        index = d.index if d.index is not None else torch.cuda.current_device()
        counts[index] = counts.get(index, 0) + 1
    from lightning_roundpipe.runtime.backends.cuda import usable_device_bytes

    return usable_device_bytes(first) // (2 * max(counts.values()))


def _make_config(config: RoundPipeConfig | None, given: dict[str, Any]) -> RoundPipeConfig:
    """``config``, or a :class:`RoundPipeConfig` of the keyword arguments ``given``.

    Raises:
        TypeError: when ``config`` is not a ``RoundPipeConfig``.
        ValueError: when ``config`` and a keyword argument other than its default are both given; the
            config's own errors otherwise.
    """
    if config is None:
        return RoundPipeConfig(**given)
    if not isinstance(config, RoundPipeConfig):
        raise TypeError(f"`config` must be a `lightning_roundpipe.RoundPipeConfig`, got {type(config).__name__}."
                        " HINT: RoundPipeStrategy(config=RoundPipeConfig(num_microbatches=4)).")
    default_config = RoundPipeConfig()
    defaults = {f.name: getattr(default_config, f.name) for f in dataclasses.fields(RoundPipeConfig)}
    clash = sorted(k for k, v in given.items() if v is not defaults[k] and v != defaults[k])
    if clash:
        raise ValueError(f"`RoundPipeStrategy` got both `config` and {', '.join(f'`{k}`' for k in clash)}."
                         " HINT: set them in the config, e.g. `dataclasses.replace(config, num_microbatches=4)`.")
    return config


class RoundPipeStrategy(dp.NodeParallelStrategy):
    """RoundPipe pipeline training (arXiv 2604.27085) for Lightning.

    Args:
        num_microbatches, module, partition, profile_steps, fused_loss, forward_stages,
            backward_stages, chunk_bytes, microbatches_per_round, balance_microbatches, cpu_link_bytes_per_s,
            debug_copy_delay_s, check_streams, device_memory_bytes, cpu_device_speeds, dispatch, optimizer,
            overlap_batches, trace_every_n_steps, peak_flops, frozen_weights, data_parallel: the fields of :class:`~lightning_roundpipe.RoundPipeConfig`
            (type, unit, default and meaning are documented there), gathered into :attr:`config`. In
            short: ``num_microbatches`` (default devices + 1), ``module`` (the attribute to pipeline),
            ``partition`` (``"auto"``: re-cut from ``profile_steps`` profiled steps), ``fused_loss``
            (a training call with ``labels`` runs the whole step inside the forward and returns the
            loss only), explicit ``forward_stages``/``backward_stages``, ``chunk_bytes`` (weight
            upload chunk), ``microbatches_per_round``, ``balance_microbatches`` (the automatic choice
            may cut the batch into a multiple of the devices), ``cpu_link_bytes_per_s`` and
            ``debug_copy_delay_s`` (CPU virtual devices), ``device_memory_bytes`` (one device's memory, or
            one per device; enforced on CPU virtual devices), ``cpu_device_speeds`` (CPU virtual devices'
            relative speeds, e.g. ``[1.0, 0.5]``), ``dispatch`` (``"auto"``, ``"round_robin"`` or
            ``"weighted"``: devices of unequal speed or memory, DESIGN.md section 12), ``optimizer``
            (``"sync"`` or ``"async"``, see *Asynchronous optimizer* below), ``staleness_correction`` and
            ``staleness_correction_lambda`` (async's stale step corrected on the host, ``RoundPipeConfig``), ``overlap_batches`` (the next batch's
            pipeline is issued while this one drains: accumulated batches in ``"sync"``, every step in
            ``"async"``), ``trace_every_n_steps`` (a Chrome/Perfetto trace and a
            timeline PNG every N batches into ``<trainer.log_dir>/roundpipe/`` and W&B, with a logger; 0: off),
            ``peak_flops`` (device peak FLOP/s for ``roundpipe/mfu(%)``; looked up by GPU name),
            ``frozen_weights`` (``"fp8"``: the frozen matmul weights, a LoRA base, held and uploaded in fp8;
            :mod:`~lightning_roundpipe.integration.frozen_fp8`),
            ``data_parallel`` (:class:`~lightning_roundpipe.DataParallel`: the data parallelism across
            nodes, ``Trainer(num_nodes=N)`` with one process per node; ignored with one node).
        config: a :class:`~lightning_roundpipe.RoundPipeConfig` instead of those keyword arguments
            (then they must stay at their defaults).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for
            Lightning strategies;
            ``parallel_devices`` is normally filled from ``Trainer(accelerator=..., devices=...)``;
            given here, one GPU may appear several times (``[torch.device("cuda:0")] * 4``: four
            logical workers, each with its own streams, sharing that GPU's memory budget),
            the precision plugin from ``Trainer(precision=...)``: Lightning's plugin is wrapped in a
            :class:`~lightning_roundpipe.RoundPipePrecision` (``16-mixed`` on the CPU computes in
            fp16 with loss scaling, where Lightning's own plugin would fall back to bf16).

    Asynchronous optimizer (``optimizer="async"``, fit only). Write ``W_j`` for the weights after
    ``j`` optimizer steps and ``g(W)`` for a step's gradient computed on weights ``W``:

    - Step 1 is exact: ``W_1 = update(W_0, g(W_0))``. Step ``j >= 2`` computes its gradient on
      ``W_{j-2}`` (one step stale: update ``j - 1`` is running on the thread meanwhile) and applies
      it to ``W_{j-1}``: ``W_j = update(W_{j-1}, g(W_{j-2}))``. With ``accumulate_grad_batches``
      every batch of a window computes on the same weights. A step the precision plugin skips
      (``16-mixed``, inf gradients) hands nothing to the thread, so the step after it computes on
      the current weights. When fit ends, all updates are applied.
    - ``on_before_optimizer_step``, gradient clipping and ``on_after_backward`` run in the main
      thread on the step's gradient, before its update is handed to the thread. In the steady state
      (``overlap_batches=True``: step ``j + 1``'s pipeline is issued while step ``j``'s drains; the
      staleness above is unchanged) step ``j``'s ``on_before_optimizer_step`` and clipping run when
      its gradient is complete, during step ``j + 1``'s ``training_step`` (docs/usage.md). ``zero_grad`` and
      LR scheduler steps called while an update is in flight run in the main thread at the next
      wait, right after that update (the update of step ``j`` uses the same learning rate as in
      ``"sync"``); a callback reading ``param_groups``' ``lr`` in ``on_train_batch_start``/``end``
      may see it before that scheduler step.
    - Checkpoints, the end of every training epoch and of fit, and exceptions wait for the step in
      flight: a checkpoint saved after step ``j`` holds ``W_j`` and the optimizer state after it.
      Validation during fit waits and also refreshes the pipeline's weights: it evaluates ``W_j``,
      and the first training step after it computes on ``W_j`` (exact) instead of ``W_{j-1}``.
    - Resuming from a checkpoint restarts the staleness (its first step is exact), so a resumed run
      is not bitwise equal to a straight one, unlike ``"sync"``.
    - The masters are being updated between the step's end and the next step's backward:
      ``training_step`` must reach the pipelined module's weights only through its forward, and a
      callback that reads them in ``on_train_batch_end``/``on_train_batch_start`` must call
      :meth:`wait_for_optimizer` first. On CPU virtual devices the pipeline reads copies of the
      trainable weights (one more fp32 copy of them in host memory).

    Generation: ``generate()`` and any call with a KV cache (``use_cache=True`` or ``past_key_values``)
    runs un-pipelined on the host, the original forward on the CPU master weights (after waiting for
    an asynchronous optimizer step in flight); see docs/usage.md.

    Raises:
        ValueError: for an invalid field (:class:`~lightning_roundpipe.RoundPipeConfig`), or ``config``
            together with a keyword argument other than its default; for a precision other than ``32-true``, ``64-true``,
            ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``16-true``
            (:class:`~lightning_roundpipe.RoundPipePrecision`); at setup, for an accelerator other
            than CPU and CUDA, and with ``optimizer="async"`` for manual optimization,
            ``torch.optim.LBFGS`` or an optimizer updating parameters outside the pipelined module.
        TypeError: for ill-typed arguments, or a precision plugin other than Lightning's
            ``Precision``, ``MixedPrecision``, ``HalfPrecision``, ``DoublePrecision`` and
            :class:`~lightning_roundpipe.RoundPipePrecision`.
    """

    strategy_name = "roundpipe"

    def __init__(
        self,
        num_microbatches: int | None = None,
        module: str | None = None,
        partition: str = "auto",
        profile_steps: int = 3,
        fused_loss: bool = True,
        forward_stages: StageRanges | None = None,
        backward_stages: StageRanges | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        microbatches_per_round: int | None = None,
        balance_microbatches: bool = True,
        cpu_link_bytes_per_s: float | None = None,
        debug_copy_delay_s: float = 0.0,
        check_streams: bool | None = None,
        device_memory_bytes: int | Sequence[int] | None = None,
        cpu_device_speeds: Sequence[float] | None = None,
        dispatch: str = "auto",
        optimizer: str = "sync",
        staleness_correction: str | None = None,
        staleness_correction_lambda: float = DEFAULT_STALENESS_LAMBDA,
        overlap_batches: bool = True,
        trace_every_n_steps: int | None = DEFAULT_TRACE_EVERY_N_STEPS,
        peak_flops: float | None = None,
        frozen_weights: str | None = None,
        data_parallel: DataParallel | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        config: RoundPipeConfig | None = None,
    ) -> None:
        given = {"num_microbatches": num_microbatches, "module": module, "partition": partition,
                 "profile_steps": profile_steps, "fused_loss": fused_loss, "forward_stages": forward_stages,
                 "backward_stages": backward_stages, "chunk_bytes": chunk_bytes,
                 "microbatches_per_round": microbatches_per_round, "balance_microbatches": balance_microbatches,
                 "cpu_link_bytes_per_s": cpu_link_bytes_per_s,
                 "debug_copy_delay_s": debug_copy_delay_s, "check_streams": check_streams,
                 "device_memory_bytes": device_memory_bytes, "cpu_device_speeds": cpu_device_speeds,
                 "dispatch": dispatch, "optimizer": optimizer, "overlap_batches": overlap_batches,
                 "staleness_correction": staleness_correction, "staleness_correction_lambda": staleness_correction_lambda,
                 "trace_every_n_steps": trace_every_n_steps, "peak_flops": peak_flops, "frozen_weights": frozen_weights,
                 "data_parallel": DataParallel() if data_parallel is None else data_parallel}
        self.config = _make_config(config, given)
        # the plugin used while none is set; not stored in `_precision_plugin`, which Lightning reads as the user's choice
        self._default_precision = RoundPipePrecision()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        cfg = self.config
        self.partition = PartitionPlan(cfg.forward_stages, cfg.backward_stages) if cfg.forward_stages is not None else None
        self.partition_mode = "explicit" if cfg.forward_stages is not None else cfg.partition
        self.engine: RoundPipeEngine | None = None
        self._async: AsyncOptimizer | None = None
        self._callback = None
        self._announced: str | None = None
        self._announced_auto = False
        self._warned_fused = False
        self._warned_rounding = False  # the frozen matmul weights come back rounded (once per strategy)
        self._warned_attributes = False  # layer attributes differ from the replicas' (once per strategy)
        self._fp8 = FrozenFp8()  # frozen_weights="fp8": announcements, checkpoint keys, the after-run warning
        self._train_batches_started = 0
        self._restored_plan: dict[str, Any] | None = None  # the checkpoint's engine state (load_checkpoint)
        self._finished_plan: dict[str, Any] | None = None  # the last engine's state, kept at teardown
        self._restored_staleness = self._finished_staleness = None  # the staleness correction's state, as the plan's
        self.step_metrics: dict[str, float] = {}
        """RoundPipe's metrics of the last training batch (``roundpipe/device0/bubble(%)``...; every batch,
        whatever ``log_every_n_steps``; kept after fit), written by
        :class:`~lightning_roundpipe.RoundPipeMetricsCallback`. They go to the loggers, never into the
        Trainer's ``callback_metrics``, ``logged_metrics`` or ``progress_bar_metrics``."""

    # ------------------------------------------------------------------ the config's fields (read-only)
    num_microbatches = property(lambda self: self.config.num_microbatches, doc="`RoundPipeConfig.num_microbatches`.")
    module_name = property(lambda self: self.config.module, doc="`RoundPipeConfig.module`.")
    profile_steps = property(lambda self: self.config.profile_steps, doc="`RoundPipeConfig.profile_steps`.")
    fused_loss = property(lambda self: self.config.fused_loss, doc="`RoundPipeConfig.fused_loss`.")
    chunk_bytes = property(lambda self: self.config.chunk_bytes, doc="`RoundPipeConfig.chunk_bytes`.")
    microbatches_per_round = property(lambda self: self.config.microbatches_per_round,
                                      doc="`RoundPipeConfig.microbatches_per_round`.")
    balance_microbatches = property(lambda self: self.config.balance_microbatches,
                                    doc="`RoundPipeConfig.balance_microbatches`.")
    cpu_link_bytes_per_s = property(lambda self: self.config.cpu_link_bytes_per_s,
                                    doc="`RoundPipeConfig.cpu_link_bytes_per_s`.")
    debug_copy_delay_s = property(lambda self: self.config.debug_copy_delay_s, doc="`RoundPipeConfig.debug_copy_delay_s`.")
    device_memory_bytes = property(lambda self: self.config.device_memory_bytes,
                                   doc="`RoundPipeConfig.device_memory_bytes`.")
    cpu_device_speeds = property(lambda self: self.config.cpu_device_speeds, doc="`RoundPipeConfig.cpu_device_speeds`.")
    dispatch = property(lambda self: self.config.dispatch, doc="`RoundPipeConfig.dispatch`.")
    optimizer_mode = property(lambda self: self.config.optimizer, doc="`RoundPipeConfig.optimizer`.")
    trace_every_n_steps = property(lambda self: self.config.trace_every_n_steps or 0,
                                   doc="`RoundPipeConfig.trace_every_n_steps` (0: off).")
    peak_flops = property(lambda self: self.config.peak_flops, doc="`RoundPipeConfig.peak_flops`.")
    frozen_weights = property(lambda self: self.config.frozen_weights, doc="`RoundPipeConfig.frozen_weights`.")
    data_parallel = property(lambda self: self.config.data_parallel, doc="`RoundPipeConfig.data_parallel`.")

    # ------------------------------------------------------------------ precision
    @property
    @override
    def precision_plugin(self) -> RoundPipePrecision:
        return self._precision_plugin if self._precision_plugin is not None else self._default_precision

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else RoundPipePrecision.from_lightning(plugin)

    # ------------------------------------------------------------------ devices
    @property
    def num_devices(self) -> int:
        """Number of pipeline devices (workers) of this node."""
        return len(self.parallel_devices or [torch.device("cpu")])

    @override
    def setup_environment(self) -> None:
        assert self.accelerator is not None
        super().setup_environment()  # several nodes: the process group (NodeParallelStrategy)
        devices = self.parallel_devices or [torch.device("cpu")]
        # the master weights live on the CPU; the accelerator is set up for the first worker device
        self.accelerator.setup_device(devices[0])

    # ------------------------------------------------------------------ setup / teardown
    @override
    def setup(self, trainer: Any) -> None:
        dp.warn_devices_auto(trainer)
        super().setup(trainer)
        target = find_pipelined_module(self.lightning_module, self.module_name)
        check_not_compiled(self.lightning_module, target)
        seq = make_layer_sequence(target)
        if self.partition is not None:
            self.partition.validate(len(seq))
        precision = self.precision_plugin
        devices = [torch.device(d) for d in (self.parallel_devices or [torch.device("cpu")])]
        stage_memory = stage_memory_bytes(devices, self.device_memory_bytes)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.engine = RoundPipeEngine.from_config(seq, devices, self.config, fitting=fitting,
                                                  compute_dtype=precision.compute_dtype,
                                                  autocast_dtype=precision.autocast_dtype,
                                                  stage_memory_bytes=stage_memory, loss_seed=precision.loss_seed)
        self.engine.info = rank_zero_info
        configure_devices(self.engine, self.cpu_device_speeds, self.dispatch)  # mixed devices (DESIGN.md section 12)
        self.engine.on_fused_call = self._warn_fused_once
        self.engine.host_barrier = self.wait_for_optimizer
        self.engine.install()
        if fitting:
            restore_plan_state(self.engine, self._restored_plan)  # resuming (`ckpt_path`): Lightning loads it first
        self._announce(seq, devices, fitting)
        self._fp8.setup(self.engine.store, self.lightning_module, target)
        rounding = frozen_rounding_note(self.engine.store.frozen_in_compute_dtype, precision.compute_dtype,
                                        precision.precision)
        if rounding is not None and not self._warned_rounding:
            self._warned_rounding = True
            rank_zero_warn(rounding)
        if fitting and self.optimizer_mode == "async":
            # the steady state (DESIGN.md section 11) needs the gradients only at the optimizer step: not with a
            # GradScaler (it unscales and checks them inside the plugin's step), accumulation or several nodes
            steady = (self.config.overlap_batches and getattr(precision, "scaler", None) is None
                      and self.num_nodes == 1 and trainer.accumulate_grad_batches == 1)
            self._async = AsyncOptimizer(steady, self.config.staleness_correction, self.config.staleness_correction_lambda)
            try:
                self._async.install(trainer, self.lightning_module, self.optimizers, self.engine,
                                    precision=getattr(precision, "plugin", precision))
                self._async.load_correction_state(self._restored_staleness)
            except BaseException:
                self._async.uninstall()
                self._async = None
                raise
        if fitting and self.num_nodes > 1:  # one process per node (a `world_size` set by hand mocks no processes)
            self.data_parallel_sync = dp.DataParallelSync(self.engine, self.lightning_module, self.data_parallel)
        if trainer.state.fn == TrainerFn.FITTING:
            from lightning_roundpipe.integration.callbacks import RoundPipeMetricsCallback

            if not any(isinstance(c, RoundPipeMetricsCallback) for c in trainer.callbacks):
                self._callback = RoundPipeMetricsCallback()
                trainer.callbacks.append(self._callback)

    def _announce(self, seq: Any, devices: list[torch.device], fitting: bool) -> None:
        """``rank_zero_info`` of what is pipelined where (model, layers, devices, microbatches, the
        stage table: with the fused loss on, the stages of a training call with ``labels``, the tail
        fused); said again by a later ``fit``/``validate`` only when it changed."""
        engine = self.engine
        assert engine is not None
        names = ", ".join(str(d) for d in devices)
        fused = "on" if self.fused_loss and seq.loss_key else "off"
        count = engine.split_num_microbatches or engine.num_microbatches
        cut = f", run as {count}" if count != engine.num_microbatches else ""
        body = sum(not name.startswith(("prefix(", "tail(")) for name in seq.layer_names)  # HF: decoder layers
        layers = f"{len(seq)} layers" if body == len(seq) else f"{body} decoder layers + prefix and tail: {len(seq)} layers"
        text = (f"RoundPipe: pipelining `{type(seq.target).__name__}` ({seq.family}, {layers}) on"
                f" {len(devices)} device(s) [{names}], {engine.num_microbatches} microbatches"
                f" ({describe_rounds(engine.microbatches_per_round, count)}{cut}),"
                f" precision {self.precision_plugin.precision}, optimizer {self.optimizer_mode!r}"
                + (f" (staleness correction {self.config.staleness_correction!r})" if self.optimizer_mode == "async" else "")
                + f", fused loss {fused}\n"
                + format_stage_table(engine.fused_stages if fused == "on" else engine.stages, seq.layer_names))
        devices_line = describe_devices(engine)
        text += f"\n{devices_line}" if devices_line else ""
        if text != self._announced:
            self._announced = text
            rank_zero_info(text)
        if (fitting and engine.auto_partition_after_steps is not None and engine.plan_choice is None
                and not self._announced_auto):
            self._announced_auto = True
            rank_zero_info(f"RoundPipe: partition=\"auto\": these stages run for {engine.auto_partition_after_steps}"
                           " profiled steps, then the stages are re-cut from the measured layer times.")
            max_steps = getattr(getattr(self._lightning_module, "_trainer", None), "max_steps", -1)
            if isinstance(max_steps, int) and 0 < max_steps < engine.auto_partition_after_steps:
                rank_zero_warn(f"RoundPipe: `max_steps={max_steps}` ends this fit before the"
                               f" `profile_steps={engine.auto_partition_after_steps}` profiled steps are over, so the"
                               " stages are never re-cut. HINT: lower `profile_steps` (at least 2), or pass"
                               " `partition=\"default\"` to keep the fixed partition without profiling.")

    def _warn_fused_once(self) -> None:
        if not self._warned_fused:
            self._warned_fused = True
            rank_zero_warn(
                "RoundPipe runs this training call with `labels` on the fused path: forward, loss and backward run"
                " inside the model's forward, and the output carries the loss only (reading `.logits` raises)."
                " Use `RoundPipeStrategy(fused_loss=False)` to get logits in `training_step`."
            )

    def _warn_diverged_attributes(self) -> None:
        """Warn (once) when plain attributes differ between the pipelined layers and the devices'
        replicas of them (:func:`~lightning_roundpipe.runtime.execution.replica.diverged_attributes`)."""
        engine = self.engine
        if engine is None or self._warned_attributes:
            return
        found = diverged_attributes(engine.executor.replicas, engine.executor.attributes)
        if not found:
            return
        self._warned_attributes = True
        names = {id(m): n for n, m in self.lightning_module.named_modules()}
        listed = ", ".join(f"`{names.get(id(module), type(module).__name__)}.{name}`" for module, name in found[:6])
        listed += f" and {len(found) - 6} more" if len(found) > 6 else ""
        rank_zero_warn(
            f"RoundPipe: the attribute(s) {listed} differ between your layers and the copies the pipeline runs. Each"
            " device runs a layer's forward on its own shallow copy of it (a replica: the layer's parameters, its own"
            " attribute dict), once per microbatch and again in the backward's recomputation: an attribute a layer sets"
            " on itself in forward stays on the replica (and holds a microbatch's value), and one set on a layer during"
            " fit does not reach the replicas. RoundPipe copies neither way: no copy gives the default strategy's value."
            " HINT: return such values from forward (or compute them outside the pipelined model), and set layer"
            " attributes before fit (PEFT's `set_adapter`, `disable_adapter()` included)."
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._train_batches_started += 1
        if self.engine is not None:
            follow_profiles(self.engine)  # the weighted dispatch balances the measured stage costs once known
            self.engine.overlap_next = self._may_overlap()
        # after the first training step: warn early, not only at teardown (with "async" the step's backward
        # stages may still run now, so only teardown, after the drain, reads the replicas)
        if self._train_batches_started == 2 and self._async is None:
            self._warn_diverged_attributes()

    def _may_overlap(self) -> bool:
        """Whether this batch's pipeline may still drain when its backward returns (DESIGN.md section 11):
        ``overlap_batches``, and in ``"sync"`` mode a batch that does not step the optimizer, in ``"async"``
        mode every batch of the steady state (:attr:`AsyncOptimizer.steady`); and neither the
        LightningModule nor a callback overrides ``on_after_backward`` (which would read its gradients)."""
        trainer = self.lightning_module.trainer
        if not self.config.overlap_batches:
            return False
        if self._async is not None:
            if not self._async.steady:
                return False
        elif not trainer.fit_loop._should_accumulate():
            return False
        if is_overridden("on_after_backward", self.lightning_module, LightningModule):
            return False
        return not any(is_overridden("on_after_backward", callback, Callback) for callback in trainer.callbacks)

    def drain(self) -> None:
        """Finish the overlapped batches still in flight (``accumulate_grad_batches > 1``): their
        gradients land in ``.grad``, their buffers in the masters (:meth:`RoundPipeEngine.drain`)."""
        if self.engine is not None:
            self.engine.drain()

    # ------------------------------------------------------------------ asynchronous optimizer
    @property
    def async_optimizer(self) -> AsyncOptimizer | None:
        """The :class:`AsyncOptimizer` of the running fit with ``optimizer="async"``, else ``None``."""
        return self._async

    def wait_for_optimizer(self) -> None:
        """Block until the optimizer step in flight (``optimizer="async"``) has updated the weights;
        a no-op in ``"sync"`` mode or outside fit.

        Raises:
            The exception the step raised on the optimizer thread (its type and attributes kept).
        """
        if self._async is not None:
            self._async.wait()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def step() -> Any:
            out = super(RoundPipeStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)
            if self.engine is not None:  # a fused optimizer bumps no version counter: the shadows must be told
                self.engine.store.mark_stale(p for group in optimizer.param_groups for p in group["params"])
            return out

        if self._async is None:
            return step()
        return self._async.optimizer_step(optimizer, step)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        # the last step of Lightning's `Strategy.backward` (not overridden: `mock.patch.object(Strategy, "backward",
        # wraps=trainer.strategy.backward)` would recurse through an override calling `super().backward`)
        super().post_backward(closure_loss)
        self.wait_for_optimizer()  # the pipeline's gradients waited already; anything else written now is safe
        if self.data_parallel_sync is not None:
            self.data_parallel_sync.after_backward()  # before clipping and the optimizer step: the global gradient

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Also leaves out the fp8 frozen weights (``frozen_weights="fp8"``: the base comes from its files)."""
        self.drain()
        self.wait_for_optimizer()
        return self._fp8.checkpoint_state(super().lightning_module_state_dict)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """A checkpoint that left fp8 frozen weights out loads with exactly those keys missing."""
        if not self._fp8.load_state_dict(self.lightning_module, checkpoint, strict):
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, torch.Tensor]:
        self.drain()
        self.wait_for_optimizer()
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Also keeps the engine's profiling progress and automatic choice (plain values) under
        ``"roundpipe_plan"``, so a resumed fit goes on with the plan of the straight run. The file gets
        the key, the ``checkpoint`` dict the ``on_save_checkpoint`` hooks saw is left as it was."""
        self.drain()
        self.wait_for_optimizer()
        state = self._finished_plan if self.engine is None else plan_state(self.engine)
        if state is not None:
            checkpoint = {**checkpoint, CHECKPOINT_KEY: state}
        staleness = self._finished_staleness if self._async is None else self._async.correction_state()
        if staleness is not None:
            checkpoint = {**checkpoint, STALENESS_CHECKPOINT_KEY: staleness}
        checkpoint = {**checkpoint, **self._fp8.checkpoint_entry()}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Also takes the ``"roundpipe_plan"`` key out (the strategy's own state: the ``on_load_checkpoint``
        hooks see the checkpoint as under Lightning's strategies)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._restored_plan = checkpoint.pop(CHECKPOINT_KEY, None)
        self._restored_staleness = checkpoint.pop(STALENESS_CHECKPOINT_KEY, None)
        if self._async is not None:
            self._async.load_correction_state(self._restored_staleness)
        self._fp8.take_from_checkpoint(checkpoint)
        if self.engine is not None:
            restore_plan_state(self.engine, self._restored_plan)
        return checkpoint

    @override
    def on_train_end(self) -> None:
        self.drain()
        if self._async is not None:
            self._async.synchronize()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self.engine is not None:  # the batches before the failing one keep their gradients
            with contextlib.suppress(BaseException):
                self.engine.drain()
        if self._async is not None:
            self._async.wait(raise_errors=False)
        super().on_exception(exception)  # several nodes: leave the process group, so every rank stops

    @override
    def teardown(self) -> None:
        if self.data_parallel_sync is not None:
            self.data_parallel_sync.close()
            self.data_parallel_sync = None
        if self._async is not None:
            self._finished_staleness = self._async.correction_state()
            self._async.uninstall()
            self._async = None
        if self.engine is not None:
            self._finished_plan = plan_state(self.engine)  # for `trainer.save_checkpoint` after `fit`
            self._warn_diverged_attributes()
            restore = self.engine.seq.restore  # what building the layer sequence changed (HF gradient checkpointing)
            self.engine.close()
            self.engine = None
            self._fp8.after_teardown()  # the fp8 weights hold rounded values now: saving them warns once
            if restore is not None:
                restore()
        if self._callback is not None and self.lightning_module is not None and self.lightning_module._trainer is not None:
            callbacks = self.lightning_module.trainer.callbacks
            if self._callback in callbacks:
                callbacks.remove(self._callback)
        self._callback = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="RoundPipe pipeline training (CPU master weights, round-robin stages)")

    def __repr__(self) -> str:
        return (f"RoundPipeStrategy(num_microbatches={self.num_microbatches}, module={self.module_name!r},"
                f" devices={self.num_devices}, num_nodes={self.num_nodes}, optimizer={self.optimizer_mode!r})")
