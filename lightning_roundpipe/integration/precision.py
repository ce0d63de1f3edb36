"""`RoundPipePrecision`: every Lightning precision, for CPU master weights and stateless workers.

DESIGN.md section 5. The plugin wraps the Lightning plugin of the same precision (``Precision``,
``MixedPrecision``, ``HalfPrecision``, ``DoublePrecision``) and delegates to it everything that
happens on the main thread: module and input conversion, init contexts, loss scaling, unscaling,
clipping, the optimizer step and the scaler's checkpoint state. What it adds is what the device
workers need, as plain dtypes and a number (the runtime knows no Lightning): the dtype the matmul
weights are uploaded in (:attr:`~RoundPipePrecision.compute_dtype`), the workers' ``torch.autocast`` dtype
(:attr:`~RoundPipePrecision.autocast_dtype`; autocast is thread-local, so the workers set it
themselves) and the seed of the fused tail's backward (:meth:`~RoundPipePrecision.loss_seed`).

| precision  | CPU master | uploaded compute copy                             | grads on CPU | loss scaling             |
|------------|------------|---------------------------------------------------|--------------|--------------------------|
| 32-true    | fp32       | fp32                                              | fp32         | no                       |
| 64-true    | fp64       | fp64                                              | fp64         | no                       |
| bf16-mixed | fp32       | matmul weights bf16, the rest fp32; bf16 autocast | fp32         | no                       |
| 16-mixed   | fp32       | matmul weights fp16, the rest fp32; fp16 autocast | fp32         | dynamic (``GradScaler``) |
| bf16-true  | bf16       | bf16                                              | bf16         | no                       |
| 16-true    | fp16       | fp16                                              | fp16         | no (as Lightning's)      |

Under the mixed precisions the devices compute what Lightning's autocast computes for the same module:
only the matmul weights (``nn.Linear`` and convolution weights, LoRA's included), which autocast casts
anyway, travel in half precision; norms, biases, embeddings (a tied embedding / LM head weight too) and
buffers travel in fp32, so embedding outputs, norms and the residual stream between stages stay fp32
(:func:`~lightning_roundpipe.runtime.host.store.autocast_cast_weights`).

Code of the LightningModule outside the pipelined model runs on the main thread as under
Lightning's own plugin: under CPU autocast for the mixed precisions (so a loss computed there is
upcast to fp32 as usual), in the module's dtype for the true precisions. The default dtype is not
changed during the step (``HalfPrecision.forward_context`` would change it for the whole process,
workers included, while the transparent path's recomputation runs outside that context).
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Generator

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_roundpipe.integration.frozen_fp8 import frozen_weights_phrase

VALID_PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}
_HALF = {"bf16": torch.bfloat16, "16": torch.float16}
_LIGHTNING_PLUGINS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


def _canonical(precision: Any) -> str:
    name = str(precision)
    name = _ALIASES.get(name, name)
    if name not in VALID_PRECISIONS:
        raise ValueError(
            f"`RoundPipePrecision` does not support `precision={precision!r}`. Valid options: {list(VALID_PRECISIONS)}."
            " HINT: `Trainer(strategy='roundpipe', precision='bf16-mixed')` trains with fp32 CPU master weights and"
            " bf16 compute on the devices; '16-mixed' adds dynamic loss scaling for fp16."
        )
    return name


def frozen_rounding_note(frozen: list[Tensor], compute_dtype: torch.dtype | None, precision: str) -> str | None:
    """What a run does to the frozen matmul weights it holds in the compute dtype, and how to keep the
    originals: the text the strategy announces once per fit; ``None`` when it rounds nothing.

    Args:
        frozen: the frozen parameters the weight store holds only as their upload copy
            (:attr:`~lightning_roundpipe.runtime.host.store.WeightStore.frozen_in_compute_dtype`);
            those in ``compute_dtype`` were converted from a wider dtype (the others only pinned).
        compute_dtype: the upload dtype of the matmul weights (:attr:`RoundPipePrecision.compute_dtype`).
        precision: the precision's name, for the message.
    """
    rounded = [t for t in frozen if compute_dtype is not None and t.dtype == compute_dtype]
    if not rounded:
        return None
    name = str(compute_dtype).replace("torch.", "")
    numel = sum(t.numel() for t in rounded)
    return (f"RoundPipe holds {frozen_weights_phrase(len(rounded))} ({numel / 1e6:.2f}M parameters: `nn.Linear` weights"
            f" with `requires_grad=False`, e.g. a LoRA base's projections) in {name} while it runs (`precision={precision!r}`:"
            f" {compute_dtype.itemsize} host bytes per parameter, no fp32 copy). When the strategy tears down they get their"
            f" dtype back with {name}-rounded values (the values the pipeline computed with): the model's frozen weights"
            " change. HINT: to keep the original weights, copy them before `fit`, `frozen = {n: p.detach().clone() for n, p"
            " in model.named_parameters() if not p.requires_grad}`, and load them back after it,"
            " `model.load_state_dict(frozen, strict=False)`; or reload the base model from its files;"
            " `precision='32-true'` keeps them as they are.")


def _cpu_scaler(scaler: torch.amp.GradScaler | None) -> torch.amp.GradScaler:
    """A ``GradScaler`` on the CPU (the masters and their gradients live there) with ``scaler``'s
    settings and state; ``scaler`` itself when it already is one."""
    if scaler is None:
        return torch.amp.GradScaler("cpu")
    if getattr(scaler, "_device", "cpu") == "cpu":
        return scaler
    cpu = torch.amp.GradScaler("cpu", init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
                               backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval(),
                               enabled=scaler.is_enabled())
    if scaler.is_enabled():
        cpu.load_state_dict(scaler.state_dict())
    rank_zero_info(f"RoundPipe: the `GradScaler` on `{scaler._device}` is replaced by a CPU `GradScaler` with its settings:"
                   " the master weights and their gradients live on the CPU.")
    return cpu


def _lightning_plugin(precision: str, scaler: torch.amp.GradScaler | None) -> Precision:
    """Lightning's own plugin for ``precision`` (main-thread tensors are on the CPU: CPU autocast, CPU scaler)."""
    if scaler is not None and precision != "16-mixed":
        raise ValueError(f"`RoundPipePrecision(precision={precision!r})` takes no `scaler`: only '16-mixed' scales the loss.")
    if precision == "32-true":
        return Precision()
    if precision == "64-true":
        return DoublePrecision()
    if precision.endswith("-true"):
        return HalfPrecision(precision)  # type: ignore[arg-type]
    if precision == "16-mixed":
        return MixedPrecision("16-mixed", device="cpu", scaler=_cpu_scaler(scaler))
    return MixedPrecision("bf16-mixed", device="cpu")


def _user_asked_fp16_on_cpu() -> bool:
    """Whether Lightning's accelerator connector, now building the Trainer, rewrote the user's
    ``precision='16-mixed'`` into ``'bf16-mixed'`` because the accelerator is the CPU.

    Lightning keeps only the rewritten flag (``_AcceleratorConnector._precision_flag``); the user's
    argument survives as the ``precision`` argument of the connector's ``__init__``, which is on the
    call stack while the connector hands the plugin to the strategy. ``False`` outside that call.
    """
    from lightning.fabric.connector import _convert_precision_to_unified_args
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, _AcceleratorConnector) and frame.f_code.co_name == "__init__":
            try:
                asked = _convert_precision_to_unified_args(frame.f_locals.get("precision"))
            except ValueError:
                return False
            return (asked == "16-mixed" and owner._precision_plugin_flag is None
                    and owner._precision_flag == "bf16-mixed" and owner._accelerator_flag == "cpu")
        frame = frame.f_back
    return False


class RoundPipePrecision(Precision):
    """Precision plugin of :class:`~lightning_roundpipe.RoundPipeStrategy` (the table in this module's docstring).

    ``Trainer(strategy="roundpipe", precision=...)`` builds it from Lightning's plugin; pass one
    yourself as ``plugins=[RoundPipePrecision("16-mixed", scaler=...)]`` to set the scaler.

    Args:
        precision: one of ``"32-true"``, ``"64-true"``, ``"bf16-mixed"``, ``"16-mixed"``,
            ``"bf16-true"``, ``"16-true"`` (or Lightning's aliases ``32``, ``64``, ``16``, ``"bf16"``).
        scaler: ``16-mixed`` only: the ``torch.amp.GradScaler`` of the dynamic loss scaling
            (default ``GradScaler("cpu")``: initial scale 2**16, growth factor 2, backoff factor 0.5,
            growth interval 2000 steps). A scaler on another device is replaced by a CPU one with its
            settings and state, because the master gradients it unscales live on the CPU.

    Raises:
        ValueError: for any other precision, or a ``scaler`` with a precision other than ``16-mixed``.

    Attributes:
        plugin: the wrapped Lightning plugin (``Precision``, ``DoublePrecision``, ``MixedPrecision``
            with ``device="cpu"``, or ``HalfPrecision``).
    """

    def __init__(self, precision: str = "32-true", scaler: torch.amp.GradScaler | None = None) -> None:
        self.precision = _canonical(precision)  # type: ignore[assignment]
        self.plugin = _lightning_plugin(self.precision, scaler)

    # ------------------------------------------------------------------ what the device workers get
    @property
    def compute_dtype(self) -> torch.dtype | None:
        """Dtype the matmul weights (``nn.Linear`` / convolution weights) are uploaded in:
        ``torch.bfloat16`` / ``torch.float16`` for the mixed precisions (every other parameter and
        buffer is uploaded in fp32, as autocast reads it), ``None`` (every tensor as its master: fp32,
        fp64, bf16 or fp16) otherwise."""
        return self.autocast_dtype

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Dtype of ``torch.autocast`` on the device workers (``None``: no autocast)."""
        if self.precision.endswith("-mixed"):
            return _HALF[self.precision.split("-")[0]]
        return None

    @property
    def param_dtype(self) -> torch.dtype:
        """Dtype of the CPU master weights (and of their gradients) after :meth:`convert_module`."""
        return {"32-true": torch.float32, "64-true": torch.float64, "bf16-true": torch.bfloat16,
                "16-true": torch.float16}.get(self.precision, torch.float32)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The CPU ``GradScaler`` of ``16-mixed`` (``None`` otherwise)."""
        return getattr(self.plugin, "scaler", None)

    def loss_seed(self) -> float:
        """Gradient the fused tail seeds its loss's backward with on the devices: the current loss
        scale under ``16-mixed`` (so fp16 device gradients do not underflow; the engine divides it
        out again), else 1.0."""
        scaler = self.scaler
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0

    # ------------------------------------------------------------------ delegated to Lightning's plugin
    def convert_module(self, module: nn.Module) -> nn.Module:
        """The true precisions convert the module (its parameters are the masters) to their dtype."""
        return self.plugin.convert_module(module)

    def convert_input(self, data: Any) -> Any:
        """The true precisions convert floating-point inputs to their dtype (as ``HalfPrecision``)."""
        return self.plugin.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        return self.plugin.convert_output(data)

    def tensor_init_context(self) -> AbstractContextManager:
        return self.plugin.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        return self.plugin.module_init_context()

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Main-thread context of the ``*_step`` methods: CPU autocast for the mixed precisions (the
        workers set their own), nothing otherwise (see the module docstring)."""
        context = self.plugin.forward_context() if isinstance(self.plugin, MixedPrecision) else nullcontext()
        with context:
            yield

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        """Scales the loss under ``16-mixed`` (then Lightning's ``on_before_backward`` hooks)."""
        return self.plugin.pre_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        """Lightning's step: under ``16-mixed`` the closure, ``unscale_`` (before
        ``on_before_optimizer_step`` and clipping), then ``scaler.step`` (skipped on inf/NaN
        gradients) and ``scaler.update`` (back off, or grow after ``growth_interval`` good steps)."""
        return self.plugin.optimizer_step(optimizer, model=model, closure=closure, **kwargs)

    def clip_gradients(self, optimizer: Optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Clips the master gradients (unscaled by then under ``16-mixed``).

        Raises:
            RuntimeError: under ``16-mixed``, for an optimizer that unscales inside its step (fused
                AdamW): its gradients are still scaled here (Lightning's ``MixedPrecision`` check).
                Without a scaler (``bf16-mixed``) such optimizers clip fine.
        """
        plugin = self.plugin if self.scaler is not None else super()
        plugin.clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state under ``16-mixed`` (scale, growth tracker, factors), else ``{}``."""
        return self.plugin.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.plugin.load_state_dict(state_dict)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also store the state under the wrapped plugin's key (``"MixedPrecision"``), so a resume
        with the default strategy and Lightning's own ``16-mixed`` restores the scale too."""
        state = self.state_dict()
        if state:
            checkpoint.setdefault(type(self.plugin).__qualname__, state)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of Lightning's own ``16-mixed`` (key ``"MixedPrecision"``) restores the scaler."""
        if type(self).__qualname__ not in checkpoint and type(self.plugin).__qualname__ in checkpoint:
            self.load_state_dict(checkpoint[type(self.plugin).__qualname__])

    # ------------------------------------------------------------------ from Lightning's choice
    @classmethod
    def from_lightning(cls, plugin: Precision) -> "RoundPipePrecision":
        """The RoundPipe plugin for the plugin Lightning built from ``Trainer(precision=...)`` or got
        through ``plugins=[...]``; a ``MixedPrecision``'s scaler is kept (moved to the CPU).

        On the CPU, Lightning replaces ``precision='16-mixed'`` by ``'bf16-mixed'`` for its own
        plugin ("AMP with fp16 is not supported on CPU"). CPU virtual devices emulate GPUs, and CPU
        autocast computes in fp16, so RoundPipe honours what the user asked for: fp16 on the devices
        with dynamic loss scaling.

        Raises:
            TypeError: for a plugin other than Lightning's ``Precision``, ``MixedPrecision``,
                ``HalfPrecision``, ``DoublePrecision`` (or a ``RoundPipePrecision``): its behaviour
                would be lost on the device workers.
        """
        if isinstance(plugin, RoundPipePrecision):
            return plugin
        if type(plugin) not in _LIGHTNING_PLUGINS:
            raise TypeError(
                f"`RoundPipeStrategy` cannot run the precision plugin `{type(plugin).__name__}`: its device workers"
                f" run exactly Lightning's own `Precision`, `MixedPrecision`, `HalfPrecision` and `DoublePrecision`"
                f" classes (`RoundPipePrecision` wraps them), not subclasses or other plugins. HINT: pass `Trainer(precision=...)` with one of"
                f" {list(VALID_PRECISIONS)}, or `plugins=[lightning_roundpipe.RoundPipePrecision(...)]`."
            )
        if type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed" and _user_asked_fp16_on_cpu():
            rank_zero_info("RoundPipe: `precision='16-mixed'` on CPU virtual devices computes in fp16 with dynamic loss"
                           " scaling, as asked (Lightning's switch to bf16-mixed above is for its own CPU plugin).")
            return cls("16-mixed")
        return cls(plugin.precision, scaler=getattr(plugin, "scaler", None))
