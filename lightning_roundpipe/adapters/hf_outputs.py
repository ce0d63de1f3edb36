"""What a fused-path training call of a Hugging Face causal LM returns: :class:`FusedCausalLMOutput`
(:class:`FusedMoeCausalLMOutput` for the mixture-of-experts families).

A module of its own so that ``transformers`` is imported only when a Hugging Face model is pipelined.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

_FUSED_HINT = ("RoundPipe's fused path returned the loss only: a training call with `labels` runs the forward"
               " stages, the fused tail (last layers, LM head and loss) and the backward stages inside the forward,"
               " so the logits stay on the devices and are not returned. HINT: `RoundPipeStrategy(fused_loss=False)`"
               " returns logits from training calls (the LM head is then recomputed in the backward); evaluation"
               " calls and calls without `labels` return logits either way.")


class FusedOutputError(AttributeError):
    """Reading ``logits`` from the output of a fused-path training call (:class:`FusedCausalLMOutput`).

    An ``AttributeError``, so ``hasattr(output, "logits")`` is ``False`` and ``getattr(output, "logits",
    None)`` is ``None``; the message says why and what to change."""


class _LossOnly:
    """``logits`` of a fused-path output: reading it raises :class:`FusedOutputError` (mixed into the HF
    output classes below)."""

    @property  # type: ignore[override]
    def logits(self) -> torch.Tensor:
        raise FusedOutputError(_FUSED_HINT)

    @logits.setter
    def logits(self, value: Any) -> None:
        if value is not None:
            raise FusedOutputError("A fused-path output holds no logits; it cannot be given any.")

    def __getitem__(self, key: Any) -> Any:
        if key == "logits":
            raise FusedOutputError(_FUSED_HINT)
        return super().__getitem__(key)

    def __reduce__(self) -> tuple:
        return _rebuild_fused, (type(self), dict(self.items()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.items())})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and dict(self.items()) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]


class FusedCausalLMOutput(_LossOnly, CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` of a fused-path training call: ``loss`` only.

    ``output.logits`` (and ``output["logits"]``) raise :class:`FusedOutputError` with the explanation
    and the HINT ``RoundPipeStrategy(fused_loss=False)``. ``loss``, ``keys()`` (``["loss"]``),
    ``to_tuple()``, ``output[0]``, ``dict(output)``, ``repr``, equality, pickling and
    ``dataclasses.fields`` (which leaves ``logits`` out, so Lightning's ``apply_to_collection`` and
    ``dataclasses.asdict`` skip it) do not read it. Built by the inherited dataclass ``__init__``
    (``FusedCausalLMOutput(loss=loss)``); ``logits`` may only be given as ``None``.
    """


class FusedMoeCausalLMOutput(_LossOnly, MoeCausalLMOutputWithPast):
    """``MoeCausalLMOutputWithPast`` of a fused-path training call (Qwen3-MoE, GPT-OSS): ``loss`` and
    ``aux_loss`` (the load-balancing loss's value) only; ``logits`` as :class:`FusedCausalLMOutput`."""


# `dataclasses.fields()` leaves `logits` out (the generated `__init__` still accepts `logits=None`)
for _cls, _base in ((FusedCausalLMOutput, CausalLMOutputWithPast), (FusedMoeCausalLMOutput, MoeCausalLMOutputWithPast)):
    _cls.__dataclass_fields__ = {k: v for k, v in _base.__dataclass_fields__.items() if k != "logits"}


def _rebuild_fused(cls: type, values: dict) -> Any:
    return cls(**values)
