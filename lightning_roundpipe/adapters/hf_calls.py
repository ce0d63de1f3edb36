"""How a call of a Hugging Face causal LM meets the pipeline (issue 20): which arguments it runs,
which go to the model's own forward on the host, which are refused; and the Hugging Face gradient
checkpointing the adapter turns off while RoundPipe runs the model, turned back on after.

- **Pipelined**: :data:`SUPPORTED` (``input_ids``, ``attention_mask``, ``position_ids``, ``labels``,
  ``num_items_in_batch``, ``return_dict``), by name or by position as the model's forward names
  them (:func:`bind_arguments`), and :data:`NOOP_KWARGS` at their defaults.
- **On the host** (the model's own forward, without gradients): any other argument the model knows
  (:func:`model_arguments`): a KV cache, ``inputs_embeds``, hidden states, ``shift_labels``...;
  with gradients such a call is refused, naming those arguments (:func:`check_call`).
- **Refused**: extra keys, which the model's forward does not know and passes on through
  ``**kwargs`` (a batch's ``idx`` splatted in with ``self.model(**batch)``), named as such.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

#: arguments accepted at their no-op values only (anything else changes the output and is rejected)
NOOP_KWARGS = {"use_cache": (None, False), "output_attentions": (None, False),
               "output_hidden_states": (None, False), "logits_to_keep": (None, 0)}
#: arguments the pipelined forward runs
SUPPORTED = ("input_ids", "attention_mask", "position_ids", "labels", "num_items_in_batch", "return_dict")
#: Hugging Face keyword arguments a causal LM's signature may not name (deprecated aliases, the
#: `can_return_tuple` decorator's `return_dict`); with the forward's own parameters, those of
#: `TransformersKwargs` and of the loss function they are the arguments the model knows
_HF_KEYWORDS = ("return_dict", "past_key_values", "cache_params", "cache", "cache_position", "use_cache",
                "output_attentions", "output_hidden_states", "inputs_embeds", "logits_to_keep")


def _parameter_names(fn: Any) -> tuple[list[str], list[str]]:
    """``(positional names in order, every named parameter)`` of ``fn`` without ``self`` (its
    ``*args``/``**kwargs`` left out); ``([], [])`` when it has no signature."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return [], []
    if params and params[0].name == "self":
        params = params[1:]
    kinds = inspect.Parameter
    positional = [p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    return positional, [p.name for p in params if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]


def model_arguments(model: nn.Module) -> tuple[tuple[str, ...], frozenset[str]]:
    """What the forward of ``model`` (PEFT-unwrapped) takes: its positional parameters in order
    (``input_ids``, ``attention_mask``, ...), and every keyword argument it knows: its named
    parameters, the base model's (``model.model``), those of ``TransformersKwargs`` (passed on
    through ``**kwargs`` to the attention and the loss), the loss function's (``shift_labels``,
    ``ignore_index``) and a few aliases (``past_key_values``, ``return_dict``). Any other keyword is
    an *extra key*: the model's forward passes it on through ``**kwargs``."""
    positional, named = _parameter_names(type(model).forward)
    known = set(named) | set(_HF_KEYWORDS)
    body = getattr(model, "model", None)
    if isinstance(body, nn.Module):
        known.update(_parameter_names(type(body).forward)[1])
    known.update(_parameter_names(getattr(model, "loss_function", None))[1])
    try:
        from transformers.utils.generic import TransformersKwargs

        known.update(getattr(TransformersKwargs, "__annotations__", {}))
    except ImportError:  # pragma: no cover - older transformers
        pass
    return tuple(positional), frozenset(known)


def bind_arguments(positional: tuple[str, ...], args: tuple, kwargs: dict, model_name: str) -> dict:
    """``args`` named as the forward names its positional parameters, merged with ``kwargs``.

    Raises:
        TypeError: as Python does, for more positional arguments than the forward takes, or an
            argument given both by position and by name.
    """
    if len(args) > len(positional):
        raise TypeError(f"`{model_name}.forward` takes at most {len(positional)} positional arguments"
                        f" ({', '.join(f'`{n}`' for n in positional)}), got {len(args)}.")
    bound = dict(zip(positional, args))
    twice = sorted(set(bound) & set(kwargs))
    if twice:
        raise TypeError(f"`{model_name}.forward` got multiple values for {', '.join(f'`{n}`' for n in twice)}.")
    bound.update(kwargs)
    return bound


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_call(bound: dict, known: frozenset[str], supported: tuple[str, ...], model_name: str,
               trainable: Callable[[], bool]) -> bool:
    """Whether a call with the arguments ``bound`` (by name: :func:`bind_arguments`) runs the model's
    own forward on the host (the adapter's ``host_call``): it asks for what the pipeline does not
    compute (``use_cache=True``, ``cache``/``past_key_values``, ``inputs_embeds``, hidden states,
    attentions, ``logits_to_keep``...), e.g. every forward of ``generate()``; after refusing the calls
    that can run neither way.

    Raises:
        ValueError: for extra keys (arguments the model's forward does not know, see
            :func:`model_arguments`: say, the keys of a batch splatted in with ``self.model(**batch)``),
            naming them; for arguments the pipeline does not run, naming them, when gradients are
            enabled and ``trainable()`` (a host call has no pipelined backward).
    """
    extra = sorted(k for k, v in bound.items() if v is not None and k not in known and k not in supported)
    if extra:
        names = ", ".join(f"`{k}`" for k in extra)
        raise ValueError(
            f"The pipelined `{model_name}` was called with {names}: extra keys, not arguments of `{model_name}.forward`"
            " (say, keys of a batch passed as `self.model(**batch)`). The model's own forward passes unknown keys on"
            " through `**kwargs` (to the attention and the loss, which ignore most of them); RoundPipe runs the model"
            " as a sequence of layers, cannot pass them on, and refuses them rather than drop them unseen."
            f" HINT: call the model with its arguments only, e.g. `self.model(**{{k: v for k, v in batch.items() if k not in"
            f" {tuple(extra)!r}}})`, or leave these keys out of the batch."
        )
    unsupported = unsupported_arguments(bound, supported)
    if unsupported and torch.is_grad_enabled() and trainable():
        raise ValueError(
            f"The pipelined `{model_name}` cannot run"
            f" {', '.join(f'`{k}={describe(bound[k])}`' for k in unsupported)} with gradients: its stages compute the"
            " logits and the loss only. Calls with such arguments (a KV cache, `inputs_embeds`, hidden states,"
            " attentions, `logits_to_keep`, `shift_labels`...) run the model's own forward un-pipelined on the host,"
            f" without a backward. Pipelined are {', '.join(f'`{k}`' for k in supported)}, and"
            f" {', '.join(f'`{k}`' for k in NOOP_KWARGS)} at their defaults. HINT: call it under `torch.no_grad()`"
            " (as `generate()` does), or leave these arguments out of the training call."
        )
    return bool(unsupported)


def turn_off_checkpointing(model: nn.Module) -> Callable[[], None] | None:
    """Turn Hugging Face gradient (activation) checkpointing of ``model`` off; returns what turns it
    back on exactly as it was (each module's flag and checkpoint function, and the input-gradient
    hook ``disable`` removes), or ``None`` when it was off."""
    flags = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func", _MISSING))
             for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    if not any(on for _, on, _ in flags):
        return None
    hook_on = _hook_active(getattr(model, "_require_grads_hook", None))
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()

    def restore() -> None:
        for module, on, func in flags:
            module.gradient_checkpointing = on
            if func is _MISSING:
                module.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                module._gradient_checkpointing_func = func
        if hook_on and not _hook_active(getattr(model, "_require_grads_hook", None)):
            model.enable_input_require_grads()

    return restore


_MISSING = object()


def _hook_active(handle: Any) -> bool:
    table = handle.hooks_dict_ref() if handle is not None and hasattr(handle, "hooks_dict_ref") else None
    return table is not None and handle.id in table


def _is_noop(value: Any, allowed: tuple) -> bool:
    """``value`` is ``None`` or equal, with the same type, to the argument's default (``allowed[1]``)."""
    default = allowed[1]
    return value is None or (type(value) is type(default) and value == default)


def unsupported_arguments(kwargs: dict, supported: tuple[str, ...] = SUPPORTED) -> list[str]:
    """Names of the arguments given (not ``None``, not at their no-op value) that the pipeline cannot run."""
    return sorted(k for k, v in kwargs.items() if k not in supported and v is not None
                  and not (k in NOOP_KWARGS and _is_noop(v, NOOP_KWARGS[k])))
