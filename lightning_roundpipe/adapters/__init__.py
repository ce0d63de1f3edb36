"""Adapters: models -> layer sequences (HF decoder-only registry as data; ``nn.Sequential``)."""

from __future__ import annotations

from torch import nn

from lightning_roundpipe.adapters.base import LayerSequence, module_uses_rng
from lightning_roundpipe.adapters.hf_causal_lm import FAMILIES, hf_causal_lm_adapter, is_hf_causal_lm, unwrap_peft
from lightning_roundpipe.adapters.sequential import sequential_adapter


def is_supported(model: nn.Module) -> bool:
    """Whether :func:`make_layer_sequence` accepts ``model``."""
    return isinstance(model, nn.Sequential) or is_hf_causal_lm(model)


def make_layer_sequence(model: nn.Module) -> LayerSequence:
    """The :class:`LayerSequence` of ``model``.

    Supported: Hugging Face decoder-only causal LMs of the families in ``FAMILIES`` (Llama, Qwen2,
    Qwen3, Mistral), also wrapped by PEFT (LoRA); and ``nn.Sequential`` (one layer per child).

    Raises:
        TypeError: for any other model, naming the supported families and the ``nn.Sequential`` route.
    """
    if isinstance(model, nn.Sequential):
        return sequential_adapter(model)
    if is_hf_causal_lm(model):
        return hf_causal_lm_adapter(model)
    raise TypeError(
        f"RoundPipe cannot pipeline a `{type(model).__name__}`: supported are Hugging Face causal LMs with"
        f" `config.model_type` in {sorted(FAMILIES)} (also wrapped by PEFT), and `nn.Sequential`."
        " HINT: express your model as an `nn.Sequential` of layers whose inputs and outputs have the batch on dim 0,"
        " or point `RoundPipeStrategy(module=...)` at such a submodule."
    )


__all__ = ["FAMILIES", "LayerSequence", "is_supported", "make_layer_sequence", "module_uses_rng", "unwrap_peft"]
