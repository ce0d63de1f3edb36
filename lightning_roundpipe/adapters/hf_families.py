"""More decoder families as data (issue 10 item 3), added to ``FAMILIES`` on import.

Each entry names only what differs from the standard layout (see
:mod:`~lightning_roundpipe.adapters.hf_causal_lm`); the layers themselves are Hugging Face's:

- **Gemma 2** (``gemma2``): embeddings scaled by ``sqrt(hidden_size)`` inside
  ``Gemma2...ScaledWordEmbedding`` (the prefix calls the module, so nothing to add); attention
  soft-capping (``attn_logit_softcapping``) inside the attention; sliding and full layers by
  ``config.layer_types``; the final logits soft-capped (``final_logit_softcapping``: the tail's
  ``logit_softcap``).
- **Gemma 3** (text, ``gemma3_text``): as Gemma 2 (``Gemma3TextScaledWordEmbedding``), plus one
  rotary table per layer type (local and global ``rope_parameters``): each stage builds the tables
  of the types its layers read (``rotary_per_layer_type``). ``use_bidirectional_attention`` is rejected.
- **Phi-3** (``phi3``: fused ``qkv_proj``/``gate_up_proj`` inside the layers), **OLMo 2**
  (``olmo2``: norms after attention and MLP inside the layers): the standard layout.
- **Granite** (``granite``): embeddings times ``embedding_multiplier`` (the model's forward does it:
  so does the prefix); ``residual_multiplier`` and ``attention_multiplier`` inside the layers; logits
  divided by ``logits_scaling``, done on the normed hidden states before the (bias-free) LM head,
  ``W (h / s) = (W h) / s`` up to rounding.
- **Qwen3-MoE**, **GPT-OSS**: mixture of experts with routing replay and the load-balancing loss
  (:mod:`~lightning_roundpipe.adapters.hf_moe`); GPT-OSS builds its masks without the position ids
  (``mask_positions``), as its forward does.
- **generic**: any other ``...ForCausalLM`` with ``model.embed_tokens``, ``model.layers``,
  ``model.norm``, ``model.rotary_emb`` and ``lm_head``, run as a Llama-like model: correct when its
  forward does nothing beyond that layout (a warning says it is not verified); refused with an
  error naming the attribute when the config sets a known extra computation (``logit_scale``,
  ``embedding_multiplier``...) or experts; a model lacking a piece gets an error naming it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from lightning_roundpipe.adapters.hf_causal_lm import FAMILIES, HFPrefix
from lightning_roundpipe.adapters.hf_moe import moe_parts


class GranitePrefix(HFPrefix):
    """Granite: the embeddings times ``config.embedding_multiplier`` (as ``GraniteModel.forward``)."""

    def scale_embeddings(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.config.embedding_multiplier


class ScaledNorm(nn.Module):
    """``norm(h) / divisor``: Granite's ``logits_scaling`` moved in front of the bias-free LM head."""

    def __init__(self, norm: nn.Module, divisor: float) -> None:
        super().__init__()
        self.norm = norm
        self.divisor = divisor

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h) / self.divisor


def _prefix(cls):
    return lambda body, config: cls(body.embed_tokens, config)


def _softcap(config: Any) -> dict:
    return {"logit_softcap": getattr(config, "final_logit_softcapping", None)}


def _check_gemma3(model: nn.Module) -> None:
    if getattr(model.config, "use_bidirectional_attention", False):
        raise ValueError("RoundPipe pipelines causal Gemma 3 only: `config.use_bidirectional_attention=True` is not"
                         " supported. HINT: train it with the default strategy.")


def _check_granite(model: nn.Module) -> None:
    if getattr(model.lm_head, "bias", None) is not None:
        raise ValueError("RoundPipe's Granite entry divides by `logits_scaling` before the LM head, which needs a"
                         " bias-free `lm_head`.")


def _granite_norm(norm: nn.Module, config: Any) -> nn.Module:
    return ScaledNorm(norm, float(config.logits_scaling))


#: config attributes that mark a mixture-of-experts model (the generic entry cannot replay its routing)
_EXPERT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


#: config attributes of computations some families' forward does outside the standard layout
#: (logit and embedding scaling, soft-capping): the generic entry would silently leave them out
_FORWARD_EXTRAS = ("logit_scale", "logits_scaling", "embedding_multiplier", "final_logit_softcapping", "scale_emb",
                   "dim_model_base", "lm_head_multiplier", "embedding_scale", "logits_scale")


def _generic_check(model: nn.Module) -> None:
    cfg = model.config
    extras = [a for a in _FORWARD_EXTRAS if getattr(cfg, a, None) is not None]
    if extras:
        raise ValueError(
            f"`{type(model).__name__}` (model type `{cfg.model_type}`) has no RoundPipe entry, and its config sets"
            f" {', '.join(f'`config.{a}`' for a in extras)}, a computation outside the standard decoder-only layout"
            " that the generic entry would leave out. HINT: add an entry to `lightning_roundpipe.adapters.FAMILIES`"
            " (see `adapters/hf_families.py`: Granite's and Gemma's show the pieces), or train with the default strategy.")
    experts = [a for a in _EXPERT_ATTRS if isinstance(getattr(cfg, a, None), int) and getattr(cfg, a) > 0]
    routers = sorted({type(m).__name__ for m in model.model.layers.modules() if type(m).__name__.endswith("Router")})
    if experts or routers:
        raise ValueError(
            f"`{type(model).__name__}` is a mixture-of-experts model without a RoundPipe entry"
            f" ({', '.join([f'`config.{a}`' for a in experts] + [f'`{r}`' for r in routers])}): the generic entry cannot"
            " replay its routing in recomputation nor add its load-balancing loss. Supported MoE model types:"
            f" {sorted(k for k, v in FAMILIES.items() if v.get('moe') is not None)}. HINT: add a `RouterSpec` to"
            " `lightning_roundpipe.adapters.hf_moe.ROUTERS` and an entry with `moe` to `FAMILIES`.")
    warnings.warn(f"RoundPipe pipelines `{type(model).__name__}` (model type `{model.config.model_type}`) through its"
                  " generic decoder-only entry (embed_tokens -> layers -> norm -> lm_head, no other computation in the"
                  " model's forward); this family is not verified. HINT: compare a step with the default strategy, or"
                  " add an entry to `lightning_roundpipe.adapters.FAMILIES`.")


FAMILIES.update({
    "gemma2": {"sliding_window_attr": None, "tail_kwargs": _softcap},
    "gemma3_text": {"sliding_window_attr": None, "tail_kwargs": _softcap, "rotary_per_layer_type": True,
                    "check": _check_gemma3},
    "phi3": {"sliding_window_attr": "sliding_window"},
    "olmo2": {"sliding_window_attr": None},
    "granite": {"sliding_window_attr": None, "prefix": _prefix(GranitePrefix), "tail_norm": _granite_norm,
                "check": _check_granite},
    "qwen3_moe": {"sliding_window_attr": "sliding_window", "moe": moe_parts},
    "gpt_oss": {"sliding_window_attr": None, "moe": moe_parts, "mask_positions": False},
    "generic": {"sliding_window_attr": "sliding_window", "check": _generic_check},
})
