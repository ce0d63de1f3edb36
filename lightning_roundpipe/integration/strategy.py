"""`RoundPipeStrategy`: ``Trainer(strategy="roundpipe")``.

A single-process strategy: the LightningModule (its parameters are the master weights), the
optimizer and the batches stay on the CPU; ``parallel_devices`` are the stateless workers the
:class:`~lightning_roundpipe.runtime.engine.RoundPipeEngine` dispatches stages to round-robin. The
strategy only adapts Lightning's hooks: find the module, build the engine in ``setup``, install the
pipelined forward, and close it in ``teardown``; with ``optimizer="async"`` it also hands the
optimizer steps to :class:`~lightning_roundpipe.integration.async_step.AsyncOptimizer`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_roundpipe.adapters import is_supported, make_layer_sequence
from lightning_roundpipe.integration.async_step import AsyncOptimizer, check_optimizer_mode
from lightning_roundpipe.integration.precision import RoundPipePrecision
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.runtime.engine import RoundPipeEngine
from lightning_roundpipe.schedule.lower import DEFAULT_CHUNK_BYTES

log = logging.getLogger(__name__)

StageRanges = Sequence[range | tuple[int, int] | Sequence[int]]


def _as_ranges(name: str, stages: StageRanges | None) -> tuple[range, ...] | None:
    if stages is None:
        return None
    out = []
    for s in stages:
        if isinstance(s, range):
            out.append(s)
        elif isinstance(s, Sequence) and len(s) == 2 and all(isinstance(v, int) for v in s):
            out.append(range(s[0], s[1]))
        else:
            raise TypeError(
                f"`{name}` entries must be `range`s or `(start, stop)` pairs of layer indices, got {s!r}."
                " HINT: forward_stages=[(0, 3), (3, 6)] covers layers 0..5 in two stages."
            )
    return tuple(out)


def _check_positive(name: str, value: Any, integer: bool, hint: str) -> None:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not value > 0:
        kind = "a positive int" if integer else "a positive number"
        raise ValueError(f"`{name}` must be {kind}, got {value!r}. HINT: {hint}.")


class RoundPipeStrategy(SingleDeviceStrategy):
    """RoundPipe pipeline training (arXiv 2604.27085) for Lightning.

    Args:
        num_microbatches: microbatches each batch is cut into (along dim 0); default: number of
            devices + 1 (paper section 3: bubbles nearly vanish once microbatches >= devices + 1).
        module: attribute of the LightningModule to pipeline (dotted paths allowed); default: the one
            child that is a supported model (HF causal LM, also under PEFT, or ``nn.Sequential``).
        partition: ``"auto"`` (default): start with the simple partition (forward stages of 3
            layers, backward stages of 1) while every layer is profiled for ``profile_steps``
            training steps, then re-cut the stages with the automatic partitioner from the measured
            times (DESIGN.md section 6); ``"default"``: keep the simple partition.
        profile_steps: training steps profiled before the automatic partition (>= 2; the first
            is warm-up and dropped).
        fused_loss: when the model computes its own loss (HF causal LM called with ``labels``), run
            forward stages, the fused tail (last layers, LM head and loss: never recomputed, logits
            never leave the device) and the backward stages as one plan inside the forward call;
            the returned output then has ``logits=None``. ``False``: always the transparent path.
        forward_stages: optional explicit forward stage boundaries: ascending ``range`` s or
            ``(start, stop)`` pairs of layer indices of the layer sequence (overrides ``partition``).
        backward_stages: optional explicit backward stage boundaries, tail first.
        chunk_bytes: largest weight upload chunk, bytes (default 64 MiB); activation uploads go
            between chunks (paper section 3.3).
        microbatches_per_round: dispatch the microbatches in rounds of at most this many (the
            paper's artifact uses rounds of ``devices``); ``None`` (default): one round, every stage
            loaded once per step.
        cpu_link_bytes_per_s: CPU virtual devices only: model a host link of this many bytes/s per
            direction (every copy takes ``bytes / rate``), so a CPU run reproduces a PCIe-bound
            regime; ``None`` (default): copies run at memory speed.
        debug_copy_delay_s: CPU virtual devices only, for debugging the runtime: every copy lands
            this many seconds late and its destination holds NaN meanwhile, so a missing
            dependency shows up as a wrong result (default 0: off).
        device_memory_bytes: memory of one device, bytes. CPU virtual devices enforce it: a step
            that would hold more on a device (weights, saved activations, per-op outputs) raises
            :class:`~lightning_roundpipe.runtime.backends.budget.DeviceMemoryError` (a
            ``torch.OutOfMemoryError``) naming the stage, the bytes asked and the budget. On GPUs it
            replaces the device's total memory in the automatic partition's per-stage budget (half
            of it). ``None`` (default): unlimited on CPU virtual devices, the GPU's memory on CUDA.
        optimizer: ``"sync"`` (default): Lightning's exact semantics, the optimizer step runs
            between two pipelines. ``"async"``: the paper's mode (section 4, "RoundPipe" vs
            "RoundPipe-sync"): the CPU optimizer step of step k runs on a background thread while
            the pipeline of step k+1 runs on the weights from before it; see *Asynchronous
            optimizer* below.
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for Lightning strategies;
            ``parallel_devices`` is normally filled from ``Trainer(accelerator=..., devices=...)``,
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
      thread on the step's gradient, before its update is handed to the thread. ``zero_grad`` and
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

    Raises:
        ValueError: for ``num_microbatches < 1``, a non-positive ``chunk_bytes``,
            ``microbatches_per_round`` or ``cpu_link_bytes_per_s``; an ``optimizer`` other than
            ``"sync"``/``"async"``; for a precision other than ``32-true``, ``64-true``,
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
        cpu_link_bytes_per_s: float | None = None,
        debug_copy_delay_s: float = 0.0,
        device_memory_bytes: int | None = None,
        optimizer: str = "sync",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        if num_microbatches is not None and (not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool)
                                             or num_microbatches < 1):
            raise ValueError(
                f"`num_microbatches` must be a positive int or None (devices + 1), got {num_microbatches!r}."
            )
        if module is not None and not isinstance(module, str):
            raise TypeError(f"`module` must be the name of a LightningModule attribute (str) or None, got {type(module).__name__}.")
        if partition not in ("auto", "default"):
            raise ValueError(f"`partition` must be one of ['auto', 'default'], got {partition!r}."
                             " HINT: pass explicit stages with `forward_stages=` and `backward_stages=`.")
        if not isinstance(profile_steps, int) or isinstance(profile_steps, bool) or profile_steps < 2:
            raise ValueError(f"`profile_steps` must be an int >= 2 (the first step is warm-up), got {profile_steps!r}.")
        _check_positive("chunk_bytes", chunk_bytes, integer=True, hint="e.g. 64 * 2**20 (64 MiB)")
        if microbatches_per_round is not None:
            _check_positive("microbatches_per_round", microbatches_per_round, integer=True, hint="e.g. the number of devices")
        if cpu_link_bytes_per_s is not None:
            _check_positive("cpu_link_bytes_per_s", cpu_link_bytes_per_s, integer=False, hint="25e9 models PCIe 4.0 x16 one way")
        if (not isinstance(debug_copy_delay_s, (int, float)) or isinstance(debug_copy_delay_s, bool)
                or not 0 <= debug_copy_delay_s < math.inf):
            raise ValueError(f"`debug_copy_delay_s` must be a finite number of seconds >= 0, got {debug_copy_delay_s!r}."
                             " HINT: 0.05 makes a missing dependency show; 0 turns the delay off.")
        if device_memory_bytes is not None:
            _check_positive("device_memory_bytes", device_memory_bytes, integer=True,
                            hint="e.g. 64 * 2**20 for 64 MiB per device")
        if not isinstance(fused_loss, bool):
            raise TypeError(f"`fused_loss` must be a bool, got {fused_loss!r}."
                            " HINT: `fused_loss=False` returns logits from a training call with `labels`.")
        check_optimizer_mode(optimizer)
        if (forward_stages is None) != (backward_stages is None):
            raise ValueError("Pass both `forward_stages` and `backward_stages`, or neither (default partition).")
        # the plugin used while none is set; not stored in `_precision_plugin`, which Lightning reads as the user's choice
        self._default_precision = RoundPipePrecision()
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.parallel_devices = parallel_devices
        self.num_microbatches = num_microbatches
        self.module_name = module
        fwd, bwd = _as_ranges("forward_stages", forward_stages), _as_ranges("backward_stages", backward_stages)
        self.partition = PartitionPlan(fwd, bwd) if fwd is not None else None
        self.partition_mode = "explicit" if fwd is not None else partition
        self.profile_steps = profile_steps
        self.fused_loss = bool(fused_loss)
        self.chunk_bytes = chunk_bytes
        self.microbatches_per_round = microbatches_per_round
        self.cpu_link_bytes_per_s = cpu_link_bytes_per_s
        self.debug_copy_delay_s = float(debug_copy_delay_s)
        self.device_memory_bytes = device_memory_bytes
        self.optimizer_mode = optimizer
        self.engine: RoundPipeEngine | None = None
        self._async: AsyncOptimizer | None = None
        self._callback = None

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
    def num_nodes(self) -> int:
        """Always 1: RoundPipe is a single-process, single-machine strategy."""
        return 1

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        if value != 1:
            raise ValueError(
                f"`RoundPipeStrategy` runs in one process on one machine; got `num_nodes={value}`."
                " HINT: use `Trainer(num_nodes=1, devices=N)` with the N GPUs (or CPU virtual devices) of this machine."
            )

    @property
    def num_devices(self) -> int:
        """Number of pipeline devices (workers)."""
        return len(self.parallel_devices or [torch.device("cpu")])

    @override
    def setup_environment(self) -> None:
        assert self.accelerator is not None
        devices = self.parallel_devices or [torch.device("cpu")]
        # the master weights live on the CPU; the accelerator is set up for the first worker device
        self.accelerator.setup_device(devices[0])

    # ------------------------------------------------------------------ setup / teardown
    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        target = self._find_module()
        seq = make_layer_sequence(target)
        if self.partition is not None:
            self.partition.validate(len(seq))
        precision = self.precision_plugin
        devices = [torch.device(d) for d in (self.parallel_devices or [torch.device("cpu")])]
        m = self.num_microbatches or len(devices) + 1
        auto = self.partition_mode == "auto" and trainer.state.fn == TrainerFn.FITTING
        stage_memory = None
        if self.device_memory_bytes is not None:
            stage_memory = self.device_memory_bytes // 2  # double buffering: the next stage is prefetched
        elif devices[0].type == "cuda":
            stage_memory = torch.cuda.get_device_properties(devices[0]).total_memory // 2  # double buffering
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.engine = RoundPipeEngine(seq, devices, m, self.partition, precision.compute_dtype, precision.autocast_dtype,
                                      auto_partition_after_steps=self.profile_steps if auto else None,
                                      stage_memory_bytes=stage_memory, fused_loss=self.fused_loss,
                                      chunk_bytes=self.chunk_bytes, microbatches_per_round=self.microbatches_per_round,
                                      cpu_link_bytes_per_s=self.cpu_link_bytes_per_s,
                                      debug_copy_delay_s=self.debug_copy_delay_s,
                                      device_memory_bytes=self.device_memory_bytes,
                                      profile_steps=self.profile_steps if fitting else None,
                                      loss_seed=precision.loss_seed)
        self.engine.install()
        log.info("RoundPipe: pipelining `%s` (%s, %d layers) on %d device(s), %d microbatches",
                 type(seq.target).__name__, seq.family, len(seq), len(devices), m)
        if self.fused_loss and seq.loss_key:
            log.info("RoundPipe: fused path on: a training call with `labels` returns the loss only (`logits=None`);"
                     " use `RoundPipeStrategy(fused_loss=False)` to get logits in `training_step`.")
        if fitting and self.optimizer_mode == "async":
            self._async = AsyncOptimizer()
            try:
                self._async.install(trainer, self.lightning_module, self.optimizers, self.engine)
            except BaseException:
                self._async.uninstall()
                self._async = None
                raise
        if trainer.state.fn == TrainerFn.FITTING:
            from lightning_roundpipe.integration.callbacks import RoundPipeMetricsCallback

            if not any(isinstance(c, RoundPipeMetricsCallback) for c in trainer.callbacks):
                self._callback = RoundPipeMetricsCallback()
                trainer.callbacks.append(self._callback)

    def _find_module(self) -> nn.Module:
        lm = self.lightning_module
        if self.module_name is not None:
            try:
                mod = lm.get_submodule(self.module_name)
            except AttributeError:
                children = [n for n, _ in lm.named_children()]
                raise ValueError(
                    f"`RoundPipeStrategy(module={self.module_name!r})`: the LightningModule has no submodule of that name."
                    f" Its children are {children}."
                ) from None
            return mod
        found = [(n, m) for n, m in lm.named_children() if is_supported(m)]
        if not found:  # look deeper, outermost first
            found = [(n, m) for n, m in lm.named_modules() if n and is_supported(m)]
            found = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
        if len(found) == 1:
            return found[0][1]
        if not found:
            children = {n: type(m).__name__ for n, m in lm.named_children()}
            raise ValueError(
                f"RoundPipe found no module to pipeline in `{type(lm).__name__}`: none of its submodules ({children}) is a"
                " supported Hugging Face causal LM (llama, mistral, qwen2, qwen3; also under PEFT) or an `nn.Sequential`."
                " HINT: express the model as an `nn.Sequential` whose inputs and outputs carry the batch on dim 0 and"
                " point `RoundPipeStrategy(module='<attribute>')` at it, or use a supported model family."
            )
        raise ValueError(
            f"RoundPipe found several modules it could pipeline in `{type(lm).__name__}`: {[n for n, _ in found]}."
            " HINT: choose one with `RoundPipeStrategy(module='<attribute>')`."
        )

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
        if self._async is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self._async.optimizer_step(optimizer, lambda: super(RoundPipeStrategy, self).optimizer_step(
            optimizer, closure, model, **kwargs))

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        self.wait_for_optimizer()  # the pipeline's gradients waited already; anything else written now is safe
        return out

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.wait_for_optimizer()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, torch.Tensor]:
        self.wait_for_optimizer()
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.wait_for_optimizer()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def on_train_end(self) -> None:
        if self._async is not None:
            self._async.synchronize()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._async is not None:
            self._async.wait(raise_errors=False)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if self._async is not None:
            self._async.uninstall()
            self._async = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
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
                f" devices={self.num_devices}, optimizer={self.optimizer_mode!r})")
