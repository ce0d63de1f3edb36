"""Adapters: models -> layer sequences (HF decoder-only registry as data; ``nn.Sequential``)."""

from __future__ import annotations

from torch import nn

from lightning_roundpipe.adapters.base import LayerSequence, module_uses_rng
from lightning_roundpipe.adapters import hf_families  # noqa: F401 (adds its entries to FAMILIES)
from lightning_roundpipe.adapters.hf_causal_lm import (FAMILIES, hf_causal_lm_adapter, is_hf_causal_lm, missing_pieces,
                                                        unwrap_peft)
from lightning_roundpipe.adapters.sequential import sequential_adapter


def is_supported(model: nn.Module) -> bool:
    """Whether :func:`make_layer_sequence` accepts ``model``."""
    return isinstance(model, nn.Sequential) or is_hf_causal_lm(model)


def make_layer_sequence(model: nn.Module) -> LayerSequence:
    """The :class:`LayerSequence` of ``model``.

    Supported: Hugging Face decoder-only causal LMs of the families in ``FAMILIES`` (Llama, Qwen2,
    Qwen3, Mistral, Gemma 2/3, Phi-3, OLMo 2, Granite, Qwen3-MoE, GPT-OSS) and any other with the
    standard layout (the generic entry), also wrapped by PEFT (LoRA); and ``nn.Sequential`` (one
    layer per child).

    Raises:
        TypeError: for any other model, naming the supported families, the pieces of the standard
            layout a Hugging Face model lacks, and the ``nn.Sequential`` route.
    """
    if isinstance(model, nn.Sequential):
        return sequential_adapter(model)
    if is_hf_causal_lm(model):
        return hf_causal_lm_adapter(model)
    inner = unwrap_peft(model)
    missing = missing_pieces(inner) if hasattr(inner, "config") else []
    lacks = (f" It looks like a Hugging Face model but has no {', '.join(f'`{m}`' for m in missing)}"
             " (the generic decoder-only entry needs `model.embed_tokens`, `model.layers`, `model.norm`,"
             " `model.rotary_emb` and `lm_head`)." if missing else "")
    raise TypeError(
        f"RoundPipe cannot pipeline a `{type(model).__name__}`: supported are Hugging Face causal LMs with"
        f" `config.model_type` in {sorted(FAMILIES)} or the standard decoder-only layout (also wrapped by PEFT),"
        f" and `nn.Sequential`.{lacks}"
        " HINT: express your model as an `nn.Sequential` of layers whose inputs and outputs have the batch on dim 0,"
        " or point `RoundPipeStrategy(module=...)` at such a submodule."
    )


__all__ = ["FAMILIES", "LayerSequence", "is_supported", "make_layer_sequence", "module_uses_rng", "unwrap_peft"]
