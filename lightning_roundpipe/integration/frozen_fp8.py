"""The Lightning side of ``frozen_weights="fp8"`` (issue 21 item 2): what setup says, what checkpoints
hold, and the warning when the model is saved after the run.

The conversion itself is the weight store's (:mod:`~lightning_roundpipe.runtime.host.fp8`). Here:

- **Setup** says once (``rank_zero_info``) how many frozen matmul weights were converted and the host
  bytes before and after, or warns (``rank_zero_warn``) that nothing was converted, naming what the
  frozen parameters are (norms, embeddings...).
- **Checkpoints** keep the trainable weights' state as ever (masters, optimizer state) and the frozen
  parameters that were not converted; the fp8 weights are left out of ``state_dict`` (the base comes
  from its own files, so loading the checkpoint never replaces it by rounded values), and the file
  lists their keys under ``"roundpipe_fp8_frozen"``. Loading it back (``trainer.fit(ckpt_path=...)``)
  tolerates exactly those keys missing; outside a Trainer load it with
  ``LightningModule.load_from_checkpoint(path, strict=False)``.
- **After the run** the converted weights hold their fp8-rounded values in their original dtype. The
  first ``state_dict()`` that covers one of them (``torch.save(model.state_dict())``, a full
  ``save_pretrained``, another strategy's checkpoint) warns once (``rank_zero_warn``) and says how to
  get the original weights back. A state-dict pre-hook on each module holding such a weight does it;
  a copy or pickle of the module gets a no-op in its place (``builtins.slice`` takes the hook's three
  arguments and does nothing), so it unpickles where this package is not installed.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Mapping

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_roundpipe.runtime.host.fp8 import describe_frozen

CHECKPOINT_KEY = "roundpipe_fp8_frozen"
"""Checkpoint key listing the ``state_dict`` keys of the fp8 weights the checkpoint leaves out."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def frozen_weights_phrase(count: int) -> str:
    """``"1 frozen matmul weight"`` / ``"3 frozen matmul weights"``."""
    return f"{count} frozen matmul weight{'' if count == 1 else 's'}"


class _WarnWhenSaved:
    """State-dict pre-hook (``hook(module, prefix, keep_vars)``) of the modules holding a weight that
    was converted to fp8: warns once per run, except while :attr:`muted` (the strategy's own checkpoints)."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.warned = False
        self.muted = False

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not self.warned and not self.muted and not _saving_peft_adapter():
            self.warned = True
            rank_zero_warn(self.message)

    def __reduce__(self) -> tuple:
        return type, (slice(None),)  # copies get `builtins.slice`: called with the hook's arguments, it does nothing


#: PEFT's function that takes the whole state dict and keeps the adapter's entries only
#: (``PeftModel.save_pretrained``, ``get_peft_model_state_dict``): such a save holds no fp8 weight.
_ADAPTER_ONLY = "get_peft_model_state_dict"


def _saving_peft_adapter(max_depth: int = 40) -> bool:
    """Whether this ``state_dict()`` call comes from PEFT's adapter-only save (a caller frame named
    :data:`_ADAPTER_ONLY` in a ``peft`` module)."""
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code.co_name == _ADAPTER_ONLY and "peft" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class FrozenFp8:
    """What the strategy does for ``frozen_weights="fp8"`` across setups and teardowns.

    Attributes:
        names: the ``state_dict`` keys (relative to the LightningModule) of the converted weights of
            the last setup; kept after teardown, so a checkpoint saved after ``fit`` leaves them out too.
        restored_names: the keys a loaded checkpoint left out (:meth:`take_from_checkpoint`).
    """

    def __init__(self) -> None:
        self._mode = "fp8"  # the conversion of the last setup (for the after-run warning)
        self.names: frozenset[str] = frozenset()
        self.restored_names: frozenset[str] = frozenset()
        self._hook: _WarnWhenSaved | None = None
        self._owners: list[nn.Module] = []
        self._announced: str | None = None  # the last conversion announced (the same one is not repeated)

    # ------------------------------------------------------------------ setup / teardown
    def setup(self, store: Any, lightning_module: nn.Module, target: nn.Module) -> None:
        """After the engine (its weight store) converted the weights: record the converted keys and those of
        the weights loaded in 4/8 bits by bitsandbytes, announce the conversion (or warn that nothing was
        converted) and drop an earlier run's after-run warnings (this run's come at its teardown)."""
        self._hook, self._owners = None, []
        mode = store.frozen_weights
        loaded = [e for e in store.tensors.values() if e.packed is not None and not e.packed.converted]
        loaded_names = _loaded_keys(lightning_module, {id(e.master) for e in loaded})
        if loaded:
            self._announce_loaded(loaded)
        if mode not in ("fp8", "nf4"):
            self.names = loaded_names
            return
        self._mode = mode
        remove_save_warnings(lightning_module)
        converted = [e for e in store.tensors.values()
                     if e.scale is not None or (e.packed is not None and e.packed.converted)]
        ids = {id(entry.master) for entry in converted}
        self.names = loaded_names | frozenset(
            n for n, p in lightning_module.named_parameters(remove_duplicate=False) if id(p) in ids)
        self._owners = [m for m in lightning_module.modules()
                        if any(p is not None and id(p) in ids for p in m._parameters.values())]
        if not converted:
            already = (f" ({frozen_weights_phrase(len(loaded))} already held in 4/8 bits by bitsandbytes,"
                       " streamed packed as loaded)") if loaded else ""
            rank_zero_warn(
                f"RoundPipe: `frozen_weights='{mode}'` converted nothing{already}: the pipelined"
                f" `{type(target).__name__}` has no"
                " frozen matmul weight (a 2-D `nn.Linear` or Hugging Face `Conv1D` weight with `requires_grad=False`"
                f" that no other kind of module uses). Its frozen parameters: {describe_frozen(store.layers)}. The run"
                " goes on as with `frozen_weights=None`. HINT: freeze the base model before `fit` (`model.requires_grad_"
                "(False)`, then add the adapters, e.g. PEFT's `get_peft_model`), or leave `frozen_weights` unset.")
            return
        numel = sum(_numel(e) for e in converted)
        before = sum(_numel(e) * e.original_dtype.itemsize for e in converted)
        after = sum(e.block.numel() for e in converted)
        original = sorted({_dtype_name(e.original_dtype) for e in converted})
        dequantised = sorted({_dtype_name(e.dequant_dtype) for e in converted})
        held = ("float8_e4m3fn with one fp32 scale per output channel" if mode == "fp8" else
                "bitsandbytes NF4 codes (blocks of 64, double-quantised absmax)")
        message = (
            f"RoundPipe: frozen_weights='{mode}': {frozen_weights_phrase(len(converted))} ({numel / 1e6:.2f}M parameters)"
            f" are held on the host as {held} ({after / 2**20:.2f} MiB,"
            f" {after / numel:.3f} bytes per parameter, instead of {before / 2**20:.2f} MiB in {'/'.join(original)}),"
            f" uploaded so and dequantised to {'/'.join(dequantised)} on the devices. Checkpoints leave them out (they do not"
            " train: a checkpoint is loaded into the model built from its original weights); when the strategy tears"
            f" down they get their dtype back with {mode}-rounded"
            " values.")
        if message != self._announced:  # a later `validate`/`test` of the same model sets up again: said once
            self._announced = message
            rank_zero_info(message)

    def _announce_loaded(self, loaded: list) -> None:
        numel = sum(_numel(e) for e in loaded)
        held = sum(e.block.numel() for e in loaded)
        kinds = sorted({e.packed.meta.get("quant_type", "int8") for e in loaded})
        message = (
            f"RoundPipe: {frozen_weights_phrase(len(loaded))} ({numel / 1e6:.2f}M parameters) loaded by bitsandbytes in"
            f" {'/'.join(kinds)} are held on the host packed with their quantisation state ({held / 2**20:.2f} MiB,"
            f" {held / numel:.3f} bytes per parameter), uploaded so and computed by bitsandbytes' kernels on the"
            " devices. Checkpoints leave them out (they do not train: a checkpoint is loaded into the model built from its"
            " original weights); their values do not change.")
        if message != self._announced:
            self._announced = message
            rank_zero_info(message)

    def after_teardown(self) -> None:
        """The weights hold their fp8-rounded values now: the first state dict covering one warns (once)."""
        if not self._owners:
            return
        self._hook = _WarnWhenSaved(
            f"RoundPipe ran with `frozen_weights='{self._mode}'`: {frozen_weights_phrase(len(self._owners))} of this model"
            f" {'holds' if len(self._owners) == 1 else 'hold'} {self._mode}-rounded values now (dequantised back to their dtype when the strategy tore down), not the original"
            " weights, and a state dict taken now (`torch.save(model.state_dict())`, a full `save_pretrained`, a"
            " checkpoint of another strategy) saves those values. Saving only a PEFT adapter is unaffected. HINT:"
            " re-load the original base weights before saving the whole model: load the base model from its files"
            " again and the trained adapter into it (PEFT: `PeftModel.from_pretrained(base, adapter_dir)`), or copy the"
            " frozen weights before `fit`, `frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not"
            " p.requires_grad}`, and load them back after it, `model.load_state_dict(frozen, strict=False)`.")
        for module in self._owners:
            module.register_state_dict_pre_hook(self._hook)
        self._owners = []

    # ------------------------------------------------------------------ checkpoints
    @contextlib.contextmanager
    def _muted(self) -> Iterator[None]:
        hook = self._hook
        if hook is None:
            yield
            return
        hook.muted = True
        try:
            yield
        finally:
            hook.muted = False

    def checkpoint_state(self, take: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``take()`` (the LightningModule's state dict) without the fp8 weights' keys; the after-run
        warning stays quiet meanwhile (this checkpoint does not hold them)."""
        with self._muted():
            state = take()
        for name in self.names:
            state.pop(name, None)
        return state

    def checkpoint_entry(self) -> dict[str, list[str]]:
        """``{CHECKPOINT_KEY: [keys left out]}`` for the checkpoint file, or ``{}``."""
        return {CHECKPOINT_KEY: sorted(self.names)} if self.names else {}

    def take_from_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Pop :data:`CHECKPOINT_KEY` from a loaded checkpoint (the ``on_load_checkpoint`` hooks see it as
        under Lightning's strategies) and remember the keys it left out."""
        self.restored_names = frozenset(checkpoint.pop(CHECKPOINT_KEY, None) or ())

    def load_state_dict(self, module: nn.Module, checkpoint: Mapping[str, Any], strict: bool) -> bool:
        """Load ``checkpoint["state_dict"]`` into ``module`` when the checkpoint left fp8 weights out
        (they keep the model's own values); returns ``False`` (nothing done) otherwise.

        Raises:
            RuntimeError: with ``strict``, for other missing keys or for unexpected keys (as torch's
                ``load_state_dict``).
        """
        if not self.restored_names:
            return False
        result = module.load_state_dict(checkpoint["state_dict"], strict=False)
        missing = [k for k in result.missing_keys if k not in self.restored_names]
        if strict and (missing or result.unexpected_keys):
            lines = []
            if missing:
                lines.append(f"Missing key(s) in state_dict: {', '.join(repr(k) for k in missing)}.")
            if result.unexpected_keys:
                lines.append(f"Unexpected key(s) in state_dict: {', '.join(repr(k) for k in result.unexpected_keys)}.")
            raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(lines)
                               + f"\n(The checkpoint leaves out {len(self.restored_names)} fp8 frozen weights, which"
                               " keep the model's values; only they may be missing.)")
        return True


def _numel(entry: Any) -> int:
    """Parameters of a weight store entry (a packed weight's logical shape, not its codes')."""
    return entry.packed.numel if entry.packed is not None else entry.master.numel()


def _loaded_keys(module: nn.Module, ids: set[int]) -> frozenset[str]:
    """The ``state_dict`` keys of the bitsandbytes modules of ``module`` whose ``weight`` is in ``ids``: the weight
    and its quantisation state (``weight.absmax``, ``weight.quant_map``, ``weight.quant_state.bitsandbytes__nf4``,
    ``SCB``, ``weight_format``...)."""
    if not ids:
        return frozenset()
    keys = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if id(sub._parameters.get("weight")) not in ids:
            continue
        for key in sub.state_dict(keep_vars=True):
            if key == "weight" or key.startswith("weight.") or key in ("SCB", "weight_format"):
                keys.add(f"{prefix}.{key}" if prefix else key)
    return frozenset(keys)


def remove_save_warnings(module: nn.Module) -> int:
    """Remove the after-run warnings of an earlier fp8 run from ``module`` and its submodules; returns how many."""
    removed = 0
    for sub in module.modules():
        hooks = sub._state_dict_pre_hooks
        for key in [k for k, hook in hooks.items() if isinstance(hook, _WarnWhenSaved)]:
            del hooks[key]
            removed += 1
    return removed
