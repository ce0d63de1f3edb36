"""Hugging Face decoder-only causal LMs (the families of ``FAMILIES``), also under PEFT.

Layer sequence (issue 2, DESIGN.md section 2):

- layer 0, *prefix*: token embedding, position ids, rotary embedding and the attention mask(s);
- layers 1..N: one per decoder layer;
- layer N+1, *tail*: final norm, LM head and, when ``labels`` are given, the loss. The loss of a
  microbatch is its summed token loss divided by the number of label tokens of the **whole batch**
  (``num_items_in_batch``), so the sum over microbatches equals the full-batch loss exactly, also
  with unequal microbatches and padding.

The family table is data: a new family whose model class follows the same
``model.embed_tokens / model.layers / model.norm / lm_head`` layout is one entry in ``FAMILIES``
(:mod:`~lightning_roundpipe.adapters.hf_families` adds Gemma 2/3, Phi-3, OLMo 2, Granite, the
mixture-of-experts families and the generic entry). An entry's optional keys replace one piece:
``prefix(body, config, mask_types)``, ``decoder(layer, layer_type, config)``, ``tail_kwargs(config)``
(extra :class:`HFTail` arguments), ``tail_norm(norm, config)`` (the module the tail normalises with), ``check(model)`` (raises for configurations it cannot pipeline),
``moe(model)`` (mixture-of-experts parts, :mod:`~lightning_roundpipe.adapters.hf_moe`).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn

from lightning_roundpipe.adapters import chunked_loss
from lightning_roundpipe.adapters.base import LayerSequence, module_uses_rng

#: ``config.model_type`` -> family notes. Every entry uses the standard layout
#: ``<causal lm>.model.{embed_tokens, rotary_emb, layers, norm}`` and ``<causal lm>.lm_head``;
#: ``hf_families`` adds more entries on import (the package imports it).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"sliding_window_attr": None},
    "qwen2": {"sliding_window_attr": None},
    "qwen3": {"sliding_window_attr": None},
    "mistral": {"sliding_window_attr": "sliding_window"},
}

#: arguments accepted at their no-op values only (anything else changes the output and is rejected)
_NOOP_KWARGS = {"use_cache": (None, False), "return_dict": (None, True), "output_attentions": (None, False),
                "output_hidden_states": (None, False), "logits_to_keep": (None, 0)}
_SUPPORTED = ("input_ids", "attention_mask", "position_ids", "labels", "num_items_in_batch")


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside PEFT wrappers (``PeftModel`` / ``LoraModel``), else ``model``."""
    get_base = getattr(model, "get_base_model", None)  # PeftModel
    if callable(get_base) and type(model).__module__.startswith("peft"):
        return get_base()
    if type(model).__module__.startswith("peft") and isinstance(getattr(model, "model", None), nn.Module):
        return model.model  # a tuner such as LoraModel
    return model


def missing_pieces(model: nn.Module) -> list[str]:
    """The pieces of the standard decoder-only layout ``model`` (PEFT-unwrapped) lacks:
    ``lm_head``, ``model.embed_tokens``, ``model.layers`` (an ``nn.ModuleList``), ``model.norm``,
    ``model.rotary_emb``; empty when it has them all."""
    inner = unwrap_peft(model)
    body = getattr(inner, "model", None)
    missing = [] if isinstance(getattr(inner, "lm_head", None), nn.Module) else ["lm_head"]
    for name, kind in (("embed_tokens", nn.Module), ("layers", nn.ModuleList), ("norm", nn.Module),
                       ("rotary_emb", nn.Module)):
        if not isinstance(getattr(body, name, None), kind):
            missing.append(f"model.{name}")
    return missing


def family_of(model: nn.Module) -> str | None:
    """The ``FAMILIES`` entry of ``model`` (PEFT-unwrapped): its ``config.model_type`` when listed,
    ``"generic"`` for another Hugging Face causal LM with the standard layout, else ``None``."""
    inner = unwrap_peft(model)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if not isinstance(model_type, str) or missing_pieces(inner):
        return None
    if model_type in FAMILIES:
        return model_type
    is_lm = type(inner).__name__.endswith("ForCausalLM") and callable(getattr(inner, "loss_function", None))
    return "generic" if is_lm and "generic" in FAMILIES else None


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` (or the model inside its PEFT wrappers) is a supported HF causal LM."""
    return family_of(model) is not None


def _mask_call(fn, config, inputs_embeds, attention_mask, position_ids):
    params = inspect.signature(fn).parameters
    kw = {"config": config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask, "position_ids": position_ids}
    if "cache" in params:
        kw["cache"] = None
    if "past_key_values" in params:
        kw["past_key_values"] = None
    if "cache_position" in params:
        kw["cache_position"] = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
    return fn(**kw)


class HFPrefix(nn.Module):
    """Embedding, position ids, rotary embedding and attention masks."""

    def __init__(self, embed_tokens: nn.Module, rotary_emb: nn.Module, config: Any, mask_types: set[str]) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.config = config
        self.mask_types = mask_types

    def forward(self, carry: dict) -> dict:
        from transformers import masking_utils

        h = self.embed_tokens(carry["input_ids"])
        pos = carry.get("position_ids")
        if pos is None:
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        masks = {}
        h = self.scale_embeddings(h)
        if "full_attention" in self.mask_types:
            masks["full_attention"] = _mask_call(masking_utils.create_causal_mask, self.config, h, carry.get("attention_mask"), pos)
        if "sliding_attention" in self.mask_types:
            masks["sliding_attention"] = _mask_call(
                masking_utils.create_sliding_window_causal_mask, self.config, h, carry.get("attention_mask"), pos
            )
        out = {k: v for k, v in carry.items() if k not in ("input_ids", "attention_mask")}
        out.update(hidden_states=h, position_ids=pos, position_embeddings=self.rotary(h, pos), masks=masks)
        return out

    def scale_embeddings(self, h: torch.Tensor) -> torch.Tensor:
        """Families that scale the embeddings outside the embedding module override this."""
        return h

    def rotary(self, h: torch.Tensor, pos: torch.Tensor) -> Any:
        """``(cos, sin)``, or a dict by layer type for families with one rotary table per type."""
        return self.rotary_emb(h, pos)


class HFDecoderLayer(nn.Module):
    """One decoder layer; reads the mask of its attention type from the carry."""

    def __init__(self, layer: nn.Module, mask_type: str) -> None:
        super().__init__()
        self.layer = layer
        self.mask_type = mask_type

    def forward(self, carry: dict) -> dict:
        rotary = carry["position_embeddings"]
        h = self.layer(
            carry["hidden_states"],
            attention_mask=carry["masks"].get(self.mask_type),
            position_ids=carry["position_ids"],
            position_embeddings=rotary[self.mask_type] if isinstance(rotary, dict) else rotary,
            use_cache=False,
        )
        if isinstance(h, tuple):  # transformers < 5 returns a tuple
            h = h[0]
        return {**carry, "hidden_states": h}


class HFTail(nn.Module):
    """Final norm, LM head and (with labels) the loss normalised over the whole batch's label tokens.

    With labels, inside :func:`~lightning_roundpipe.adapters.chunked_loss.loss_only` (the fused tail of
    the RoundPipe executor), the logits are computed, reduced and back-propagated ``loss_chunk_tokens``
    tokens at a time and not returned (:func:`~lightning_roundpipe.adapters.chunked_loss.chunked_causal_lm_loss`);
    otherwise the full ``(batch, seq, vocab)`` logits are returned and the model's own loss function
    reads them.

    Args:
        norm: the final norm.
        lm_head: the LM head (may be tied to the embedding, may be PEFT-wrapped).
        loss_function: the model's ``loss_function`` (``ForCausalLMLoss`` for the supported families).
        vocab_size: logits per token.
        logit_softcap: Gemma 2 style soft-capping right after the LM head,
            ``logits = logit_softcap * tanh(logits / logit_softcap)``; ``None``: none.
        logits_scale: the logits are divided by it after the LM head (Granite's ``logits_scaling``); 1.0: none.
        loss_chunk_tokens: tokens per chunk of the chunked loss; ``None``: the most tokens whose
            logits take at most 256 MiB in the compute dtype; 0: never chunk (full logits always).

    Raises:
        ValueError: for a non-positive ``logit_softcap`` or ``logits_scale``, or a negative ``loss_chunk_tokens``.
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Module, loss_function: Any, vocab_size: int, *,
                 logit_softcap: float | None = None, logits_scale: float = 1.0,
                 loss_chunk_tokens: int | None = None) -> None:
        super().__init__()
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"`logit_softcap` must be > 0 or None, got {logit_softcap!r}.")
        if not logits_scale > 0:
            raise ValueError(f"`logits_scale` must be > 0, got {logits_scale!r}.")
        if loss_chunk_tokens is not None and (not isinstance(loss_chunk_tokens, int) or loss_chunk_tokens < 0):
            raise ValueError(f"`loss_chunk_tokens` must be an int >= 0 or None, got {loss_chunk_tokens!r}."
                             " HINT: 0 turns chunking off, None picks 256 MiB of logits per chunk.")
        self.norm = norm
        self.lm_head = lm_head
        self._loss_function = loss_function
        self.vocab_size = vocab_size
        self.logit_softcap = logit_softcap
        self.logits_scale = float(logits_scale)
        self.loss_chunk_tokens = loss_chunk_tokens

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head, then the logits scaling and soft-capping of the family: ``(..., hidden) -> (..., vocab)``."""
        logits = self.lm_head(hidden)
        if self.logits_scale != 1.0:
            logits = logits / self.logits_scale
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def chunk_tokens(self, hidden: torch.Tensor) -> int:
        """Tokens per chunk for ``hidden`` (0: chunking off)."""
        if self.loss_chunk_tokens is not None:
            return self.loss_chunk_tokens
        return chunked_loss.default_chunk_tokens(self.vocab_size, chunked_loss.logits_itemsize(hidden, self.lm_head))

    def forward(self, carry: dict) -> dict:
        hidden = self.norm(carry["hidden_states"])
        labels = carry.get("labels")
        num_items = carry.get("num_items_in_batch")
        if labels is not None and chunked_loss.LOSS_ONLY.get():
            chunk = self.chunk_tokens(hidden)
            if chunk > 0:
                loss = chunked_loss.chunked_causal_lm_loss(hidden, self.logits, labels, num_items, chunk_tokens=chunk,
                                                           recompute=not module_uses_rng(self.lm_head))
                return {"loss": loss}
        logits = self.logits(hidden)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = self._loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size,
                                              num_items_in_batch=num_items)
        return out


def _is_noop(value: Any, allowed: tuple) -> bool:
    """``value`` is ``None`` or equal, with the same type, to the argument's default (``allowed[1]``)."""
    default = allowed[1]
    return value is None or (type(value) is type(default) and value == default)


def _unsupported(kwargs: dict, supported: tuple[str, ...] = _SUPPORTED) -> list[str]:
    """Names of the arguments given (not ``None``, not at their no-op value) that the pipeline cannot run."""
    return sorted(k for k, v in kwargs.items() if k not in supported and v is not None
                  and not (k in _NOOP_KWARGS and _is_noop(v, _NOOP_KWARGS[k])))


def host_call(args: tuple, kwargs: dict, supported: tuple[str, ...] = _SUPPORTED) -> bool:
    """Whether a call runs the model's own forward on the host: it asks for what the pipeline does not
    compute (``use_cache=True``, ``cache``/``past_key_values``, ``inputs_embeds``, hidden states,
    attentions, ``logits_to_keep``...), e.g. every forward of ``generate()``."""
    return bool(_unsupported(kwargs, supported))


def hf_causal_lm_adapter(model: nn.Module) -> LayerSequence:
    """Layer sequence of a supported HF causal LM (``model`` may be PEFT-wrapped).

    The pipelined forward accepts ``input_ids`` (int64, ``(batch, seq)``), optional
    ``attention_mask`` (``(batch, seq)``), ``position_ids`` and ``labels`` (int64, ``(batch, seq)``,
    -100 for ignored positions), and returns a ``CausalLMOutputWithPast`` with ``logits``
    (``(batch, seq, vocab)``) and, with labels, the scalar ``loss``.

    Mixture-of-experts families also accept ``output_router_logits`` and return a
    ``MoeCausalLMOutputWithPast`` (``aux_loss``: the load-balancing loss when it is on).

    Raises:
        ValueError: when the model is not a supported family (see ``FAMILIES``), naming the pieces
            of the standard layout it lacks; a family's ``check`` for configurations it cannot pipeline.
    """
    inner = unwrap_peft(model)
    family = family_of(inner)
    if family is None:
        missing = missing_pieces(inner)
        raise ValueError(
            f"`{type(inner).__name__}` is not a supported Hugging Face causal LM (model types {sorted(FAMILIES)},"
            " or any decoder-only `...ForCausalLM` with the layout `model.embed_tokens`, `model.layers`, `model.norm`,"
            " `model.rotary_emb`, `lm_head`)" + (f": it has no {', '.join(f'`{m}`' for m in missing)}." if missing else ".")
        )
    entry = FAMILIES[family]
    if entry.get("check") is not None:
        entry["check"](inner)
    if getattr(inner, "is_activation_checkpointing", None) or (
        not hasattr(inner, "is_activation_checkpointing") and getattr(inner, "is_gradient_checkpointing", False)
    ):
        # RoundPipe already recomputes every backward stage; HF checkpointing inside a stage would
        # recompute twice and does not survive the stage's own recomputation
        (getattr(inner, "activation_checkpointing_disable", None) or inner.gradient_checkpointing_disable)()
        warnings.warn("RoundPipe turned off Hugging Face gradient checkpointing: backward stages already recompute"
                      " their layers from the saved stage input.")
    cfg = inner.config
    body = inner.model
    n = cfg.num_hidden_layers
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    if not layer_types:
        sw_attr = entry.get("sliding_window_attr")
        sliding = sw_attr is not None and getattr(cfg, sw_attr, None) is not None
        layer_types = ["sliding_attention" if sliding else "full_attention"] * n
    moe = entry["moe"](inner) if entry.get("moe") is not None else None
    make_decoder = entry.get("decoder") or (lambda layer, layer_type, config: HFDecoderLayer(layer, layer_type))
    if moe is not None:
        make_decoder = moe.decoder
    decoder = [make_decoder(body.layers[i], layer_types[i], cfg) for i in range(n)]
    make_prefix = entry.get("prefix") or (lambda body_, config, mask_types: HFPrefix(body_.embed_tokens, body_.rotary_emb,
                                                                                     config, mask_types))
    layers: list[nn.Module] = [make_prefix(body, cfg, set(layer_types))]
    layers += decoder
    tail_kwargs = entry["tail_kwargs"](cfg) if entry.get("tail_kwargs") is not None else {}
    norm = entry["tail_norm"](body.norm, cfg) if entry.get("tail_norm") is not None else body.norm
    tail = HFTail(norm, inner.lm_head, inner.loss_function, cfg.vocab_size, **tail_kwargs)
    layers.append(moe.tail(tail) if moe is not None else tail)
    names = ["prefix(embed,rotary,mask)"] + [f"layers.{i}" for i in range(n)] + ["tail(norm,lm_head,loss)"]
    supported = _SUPPORTED + (moe.kwargs if moe is not None else ())

    def prepare(args: tuple, kwargs: dict) -> dict:
        if args:
            kwargs = {"input_ids": args[0], **kwargs}
            if len(args) > 1:
                raise TypeError("The pipelined causal LM takes `input_ids` as its only positional argument; pass the rest by name.")
        # `None` is "not given" for every argument (PEFT passes `inputs_embeds=None` and friends)
        unsupported = _unsupported(kwargs, supported)
        if unsupported:  # the engine runs such calls on the host (`host_call`); this is for a direct `prepare`
            raise ValueError(
                f"The pipelined causal LM does not support {', '.join(f'`{k}={kwargs[k]!r}`' for k in unsupported)}."
                f" Supported: {', '.join(f'`{k}`' for k in supported)}, and"
                f" {', '.join(f'`{k}`' for k in _NOOP_KWARGS)} at their defaults. HINT: without gradients such calls"
                " (generation with a KV cache, `inputs_embeds`, hidden states, attentions) run un-pipelined on the host."
            )
        input_ids = kwargs.get("input_ids")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"`input_ids` must be an int tensor of shape (batch, seq), got {type(input_ids).__name__}"
                             f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else ''}.")
        carry = {"input_ids": input_ids, "attention_mask": kwargs.get("attention_mask"),
                 "position_ids": kwargs.get("position_ids")}
        labels = kwargs.get("labels")
        if labels is not None:
            carry["labels"] = labels
            # label tokens of the whole batch after the causal shift (as transformers' ForCausalLMLoss counts them)
            n = kwargs.get("num_items_in_batch")
            carry["num_items_in_batch"] = (labels[..., 1:] != -100).sum() if n is None else torch.as_tensor(n)
        if moe is not None:
            moe.prepare(carry, kwargs)
        return carry

    def finalize(merged: dict) -> Any:
        if moe is not None:
            return moe.finalize(merged)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        from lightning_roundpipe.adapters.hf_outputs import FusedCausalLMOutput

        if "logits" not in merged:  # the fused path: the loss only
            return FusedCausalLMOutput(loss=merged.get("loss"))
        return CausalLMOutputWithPast(loss=merged.get("loss"), logits=merged.get("logits"))

    return LayerSequence(
        target=inner,
        layers=layers,
        layer_names=names,
        grad_keys=moe.grad_keys if moe is not None else ("hidden_states",),
        prepare=prepare,
        finalize=finalize,
        family=cfg.model_type,
        loss_key="loss",
        has_loss=lambda carry: carry.get("labels") is not None,
        additive_scalars=True,
        routing=moe.routing_spec(layer_offset=1) if moe is not None else None,
        host_call=lambda args, kwargs: host_call(args, kwargs, supported),
    )
