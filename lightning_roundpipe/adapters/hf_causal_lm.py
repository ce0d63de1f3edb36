"""Hugging Face decoder-only causal LMs (the families of ``FAMILIES``), also under PEFT.

Layer sequence (issue 2, DESIGN.md section 2):

- layer 0, *prefix*: token embedding and position ids;
- layers 1..N: one per decoder layer;
- layer N+1, *tail*: final norm, LM head and, when ``labels`` are given, the loss. The loss of a
  microbatch is its summed token loss divided by the number of label tokens of the **whole batch**
  (``num_items_in_batch``), so the sum over microbatches equals the full-batch loss exactly, also
  with unequal microbatches and padding.

**What crosses a stage boundary** (DESIGN.md section 4): the carry between layers holds the hidden
states ``(batch, seq, hidden)`` (the only entry with a gradient), the attention mask as the model
got it (``(batch, seq)``, or ``None``), the position ids (``(batch or 1, seq)`` int64), and the
entries only the tail or the routing reads (labels, ``num_items_in_batch``, the mixture-of-experts
scalars), and the attention layout (``sequence_layout``: padded, packed or plain causal) decided on the
host from the CPU-side mask and positions before upload (:func:`sequence_layout`). The 4D attention masks (full and sliding-window, ``O(seq^2)``) and the rotary ``cos``/
``sin`` tables are *derived carry entries* (:class:`HFDerivedCarry`): the first decoder layer of
each stage that reads one builds it on its device with transformers' own
``masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask`` and the model's
``rotary_emb``, exactly as the model's forward builds them.

The family table is data: a new family whose model class follows the same
``model.embed_tokens / model.layers / model.norm / lm_head`` layout is one entry in ``FAMILIES``
(:mod:`~lightning_roundpipe.adapters.hf_families` adds Gemma 2/3, Phi-3, OLMo 2, Granite, the
mixture-of-experts families and the generic entry). An entry's optional keys replace one piece:
``prefix(body, config)``, ``decoder(layer, layer_type, derived)``, ``tail_kwargs(config)``
(extra :class:`HFTail` arguments), ``tail_norm(norm, config)`` (the module the tail normalises with),
``check(model)`` (raises for configurations it cannot pipeline), ``moe(model)`` (mixture-of-experts
parts, :mod:`~lightning_roundpipe.adapters.hf_moe`); and two flags of the derived entries:
``rotary_per_layer_type`` (one rotary table per layer type, ``rotary_emb(h, position_ids, layer_type)``:
Gemma 3) and ``mask_positions`` (``False``: the masks are built without the position ids, as GPT-OSS
builds them: no packed-sequence detection).
"""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any

import torch
from torch import nn

from lightning_roundpipe.adapters import chunked_loss
from lightning_roundpipe.adapters.base import DerivedCarry, LayerSequence, module_uses_rng
from lightning_roundpipe.adapters.hf_calls import (NOOP_KWARGS, SUPPORTED, bind_arguments, check_call, describe,
                                                   model_arguments, turn_off_checkpointing, unsupported_arguments)

#: ``config.model_type`` -> family notes. Every entry uses the standard layout
#: ``<causal lm>.model.{embed_tokens, rotary_emb, layers, norm}`` and ``<causal lm>.lm_head``;
#: ``hf_families`` adds more entries on import (the package imports it).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"sliding_window_attr": None},
    "qwen2": {"sliding_window_attr": None},
    "qwen3": {"sliding_window_attr": None},
    "mistral": {"sliding_window_attr": "sliding_window"},
}

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


def _mask_call(fn, config, inputs_embeds, attention_mask, position_ids, **extra):
    params = inspect.signature(fn).parameters
    kw = {"config": config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask, "position_ids": position_ids}
    if "cache" in params:
        kw["cache"] = None
    elif "past_key_values" in params:
        kw["past_key_values"] = None
    if "cache_position" in params:
        kw["cache_position"] = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
    return fn(**kw, **extra)


#: carry key of the attention layout decided on the host (:func:`sequence_layout`)
LAYOUT_KEY = "sequence_layout"
#: the layouts :func:`sequence_layout` decides between
LAYOUTS = ("causal", "padded", "packed", "given")


def sequence_layout(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, packing: bool) -> str:
    """The attention layout of a batch, decided on the host from its CPU-side 2D mask and positions
    before upload (DESIGN.md section 4: the data-dependent decisions transformers' mask builders make
    with ``bool(tensor)`` on the device, made once here and carried as data), as the model's own
    forward decides it for the whole batch:

    - ``"padded"``: a 2D ``attention_mask`` with a masked token: the explicit mask (transformers'
      ``_ignore_causal_mask_sdpa`` keeps it); decided again per microbatch after the split
      (:func:`microbatch_layout`), so a microbatch without padding takes the causal path;
    - ``"packed"``: no mask, and the position ids restart inside a row (several sequences packed in
      one row, as ``DataCollatorWithFlattening`` makes them: transformers' ``find_packed_sequence_indices``
      finds more than one sequence); only with ``packing``, where the model's forward looks for
      packed sequences (no KV cache: ``use_cache=False``; a family that passes position ids to its
      mask builders);
    - ``"given"``: a mask that is not 2D (a prepared 4D mask), used as it is;
    - ``"causal"``: otherwise (no mask or one without masked tokens, and no packed rows): a plain
      causal mask (sdpa: none, ``is_causal``).

    Args:
        attention_mask: the call's mask (``(batch, seq)``, ``None``, or 4D), on the host.
        position_ids: the call's position ids (``(batch or 1, seq)`` int64, or ``None``), on the host.
        packing: whether the model's forward would detect packed sequences in this call.
    """
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            return "given"
        return "causal" if bool(attention_mask.all()) else "padded"
    if packing and position_ids is not None and position_ids.dim() == 2:
        from transformers.masking_utils import find_packed_sequence_indices

        if find_packed_sequence_indices(position_ids) is not None:
            return "packed"
    return "causal"


def microbatch_layout(carry: dict) -> dict:
    """A microbatch's own attention layout (``LayerSequence.prepare_microbatch``), on the host after
    the split: a microbatch of a padded batch whose rows hold no padding takes the plain causal path,
    and the reverse, exactly as transformers' mask builder decides for those rows alone (the model
    called on the microbatch by hand: sdpa's ``is_causal`` instead of an explicit mask; both give the
    same attention, their low-precision rounding differs). Packed and prepared (4D) layouts keep the
    whole batch's decision."""
    layout, mask = carry.get(LAYOUT_KEY), carry.get("attention_mask")
    if layout in ("causal", "padded") and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        carry = dict(carry)
        carry[LAYOUT_KEY] = "causal" if bool(mask.all()) else "padded"
    return carry


def _packed_sequence_ids(position_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """Per token, the index of the packed sequence it belongs to inside its row (``(rows, seq)``):
    a new sequence starts wherever the position does not follow the one before by 1, as
    transformers' ``find_packed_sequence_indices`` counts them; on the positions' device, without
    its host-side check."""
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    return starts.cumsum(-1).expand(rows, -1)


#: the transformers mask builder of each attention type
_MASK_BUILDERS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}


class HFDerivedCarry(DerivedCarry):
    """Derived carry entries of an HF decoder: per attention type its 4D mask, and the rotary tables.

    Entries: ``"mask/<layer type>"`` (``"mask/full_attention"``, ``"mask/sliding_attention"``): what
    ``create_causal_mask`` / ``create_sliding_window_causal_mask`` return for the carry's hidden
    states (shape, dtype, device), its 2D ``attention_mask`` and its ``position_ids``, as the
    model's forward calls them for the whole batch, with the layout the host decided before upload
    (the carry's ``sequence_layout``, :func:`sequence_layout`), so no device op reads a mask's or a
    position's value: ``"padded"`` builds the explicit mask (``allow_is_causal_skip=False``),
    ``"packed"`` the causal mask within each packed sequence (``and_mask_function`` of
    transformers' ``packed_sequence_mask_function``), ``"causal"`` the mask of no mask and no positions: a ``(batch, 1, seq, seq)`` bool mask (sdpa), a float mask of the
    hidden states' dtype with its minimum at masked positions (eager), ``None`` where the
    attention needs none (sdpa without padding), or the carried mask itself when it is 4D.
    ``"rotary"``: ``(cos, sin)``, each ``(batch or 1, seq, head_dim)`` in the hidden states'
    dtype, from the model's ``rotary_emb``; with ``rotary_per_layer_type``, ``"rotary/<layer type>"``
    per type instead (``rotary_emb(h, position_ids, layer_type)``).

    Args:
        rotary_emb: the model's ``model.rotary_emb`` (a submodule: its ``inv_freq`` is uploaded
            with every stage that reads the tables).
        config: the model config (``_attn_implementation``, ``sliding_window``).
        layer_types: the attention type of every decoder layer.
        rotary_per_layer_type: one rotary table per layer type (Gemma 3).
        mask_positions: pass the position ids to the mask builders (packed-sequence detection
            when there is no attention mask); ``False`` where the model's forward does not (GPT-OSS).

    Raises:
        ValueError: for a layer type without a transformers mask builder.
    """

    def __init__(self, rotary_emb: nn.Module, config: Any, layer_types: list[str], *,
                 rotary_per_layer_type: bool = False, mask_positions: bool = True) -> None:
        types = sorted(set(layer_types))
        unknown = [t for t in types if t not in _MASK_BUILDERS]
        if unknown:
            raise ValueError(f"RoundPipe cannot build the attention mask of layer type(s) {unknown}; supported are"
                             f" {sorted(_MASK_BUILDERS)}. HINT: train this model with the default strategy.")
        rotary = [f"rotary/{t}" for t in types] if rotary_per_layer_type else ["rotary"]
        # the masks and tables read the hidden states' shape, dtype and device only (not their values)
        super().__init__(tuple(f"mask/{t}" for t in types) + tuple(rotary), sources=("attention_mask", "position_ids", LAYOUT_KEY),
                         anchor="position_ids", shape_sources=("hidden_states",))
        self.rotary_emb = rotary_emb
        self.config = config
        self.rotary_per_layer_type = rotary_per_layer_type
        self.mask_positions = mask_positions

    def build(self, carry: dict, name: str) -> Any:
        h, pos = carry["hidden_states"], carry["position_ids"]
        kind, _, layer_type = name.partition("/")
        if kind == "mask":
            from transformers import masking_utils

            fn = getattr(masking_utils, _MASK_BUILDERS[layer_type])
            mask = carry.get("attention_mask")
            layout = carry.get(LAYOUT_KEY)
            if layout is None:  # a carry made without `prepare`: transformers decides on the device
                return _mask_call(fn, self.config, h, mask, pos if self.mask_positions else None)
            if layout == "padded":  # the host saw masked tokens in this microbatch: the explicit mask
                return _mask_call(fn, self.config, h, mask, pos, allow_is_causal_skip=False)
            if layout == "packed":  # each token attends within its own packed sequence
                ids = _packed_sequence_ids(pos, h.shape[0])
                return _mask_call(fn, self.config, h, None, None,
                                  and_mask_function=masking_utils.packed_sequence_mask_function(ids))
            return _mask_call(fn, self.config, h, mask if layout == "given" else None, None)
        if layer_type:
            return self.rotary_emb(h, pos, layer_type)
        return self.rotary_emb(h, pos)

    def mask(self, carry: dict, layer_type: str) -> Any:
        """The 4D mask of ``layer_type`` layers for ``carry``."""
        return self.get(carry, f"mask/{layer_type}")

    def rotary(self, carry: dict, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of ``layer_type`` layers for ``carry``."""
        return self.get(carry, f"rotary/{layer_type}" if self.rotary_per_layer_type else "rotary")


class HFPrefix(nn.Module):
    """Token embedding and position ids: ``{input_ids, attention_mask, position_ids, ...}`` ->
    ``{hidden_states, attention_mask, position_ids, ...}`` (``position_ids``: the given ones, else
    ``arange(seq)`` of shape ``(1, seq)`` as the model's forward makes them; the other entries
    pass through)."""

    def __init__(self, embed_tokens: nn.Module, config: Any) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.config = config

    def forward(self, carry: dict) -> dict:
        h = self.scale_embeddings(self.embed_tokens(carry["input_ids"]))
        pos = carry.get("position_ids")
        if pos is None:
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        out = {k: v for k, v in carry.items() if k != "input_ids"}
        out.update(hidden_states=h, position_ids=pos)
        return out

    def scale_embeddings(self, h: torch.Tensor) -> torch.Tensor:
        """Families that scale the embeddings outside the embedding module override this."""
        return h


class HFDecoderLayer(nn.Module):
    """One decoder layer; reads the mask of its attention type and its rotary table from the
    derived carry entries (:class:`HFDerivedCarry`), built once per stage."""

    def __init__(self, layer: nn.Module, mask_type: str, derived: HFDerivedCarry) -> None:
        super().__init__()
        self.layer = layer
        self.mask_type = mask_type
        self.derived = derived

    def forward(self, carry: dict) -> dict:
        h = self.layer(
            carry["hidden_states"],
            attention_mask=self.derived.mask(carry, self.mask_type),
            position_ids=carry["position_ids"],
            position_embeddings=self.derived.rotary(carry, self.mask_type),
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


def boundary_carry_bytes(prepare: Any, hidden_size: int, kwargs: dict, dtype: torch.dtype,
                         num_microbatches: int = 1) -> int:
    """Bytes one stage boundary's carries hold, all microbatches together (what crosses each hop
    device -> host -> device, and what the host saves there), for a call with ``kwargs``.

    The carry of every decoder boundary is the prefix's output: ``prepare``'s carry with
    ``input_ids`` replaced by the hidden states ``(rows, seq, hidden_size)`` of ``dtype`` and the
    position ids ``(1, seq)`` int64 made when none were given, cut into microbatches as the runtime
    cuts it (entries without the batch dimension, such as ``num_items_in_batch``, go to every
    microbatch). No entry is ``O(seq^2)``: the 4D masks and the rotary tables are derived entries.

    Args:
        prepare: the layer sequence's ``prepare``.
        hidden_size: the model's hidden size.
        kwargs: the call's keyword arguments (``input_ids`` of shape ``(batch, seq)``...).
        dtype: the hidden states' dtype (the compute dtype).
        num_microbatches: microbatches the batch is cut into.
    """
    from lightning_roundpipe.runtime.execution.microbatch import split_microbatches

    carry = dict(prepare((), kwargs))
    rows, seq = carry.pop("input_ids").shape
    carry["hidden_states"] = torch.empty((rows, seq, hidden_size), dtype=dtype, device="meta")
    microbatches, _ = split_microbatches(carry, num_microbatches)
    total = 0
    for mb in microbatches:
        if mb.get("position_ids") is None:
            mb["position_ids"] = torch.empty((1, seq), dtype=torch.int64, device="meta")
        total += sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(mb)
                     if isinstance(t, torch.Tensor))
    return total


def hf_causal_lm_adapter(model: nn.Module) -> LayerSequence:
    """Layer sequence of a supported HF causal LM (``model`` may be PEFT-wrapped).

    The pipelined forward accepts ``input_ids`` (int64, ``(batch, seq)``), optional
    ``attention_mask`` (``(batch, seq)``), ``position_ids`` and ``labels`` (int64, ``(batch, seq)``,
    -100 for ignored positions), by name or by position as the model's forward names them, and
    returns a ``CausalLMOutputWithPast`` with ``logits`` (``(batch, seq, vocab)``) and, with labels,
    the scalar ``loss``; with ``return_dict=False`` (``None``: ``config.return_dict``) its
    ``to_tuple()``: ``(loss, logits)``, ``(loss,)`` on the fused path. The other arguments the model
    knows run its own forward on the host without gradients and are refused with them; extra keys
    are refused (:mod:`~lightning_roundpipe.adapters.hf_calls`). Hugging Face gradient checkpointing
    is turned off; the sequence's ``restore`` turns it back on as it was.

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
    # RoundPipe already recomputes every backward stage; HF checkpointing inside a stage would
    # recompute twice and does not survive the stage's own recomputation
    restore = turn_off_checkpointing(inner)
    if restore is not None:
        warnings.warn("RoundPipe turned off Hugging Face gradient checkpointing while it runs the model: backward"
                      " stages already recompute their layers from the saved stage input. It is turned back on, as it"
                      " was, when the strategy tears down (after `fit`, `validate`, `test` or `predict`).")
    cfg = inner.config
    body = inner.model
    n = cfg.num_hidden_layers
    layer_types = list(getattr(cfg, "layer_types", None) or [])
    if not layer_types:
        sw_attr = entry.get("sliding_window_attr")
        sliding = sw_attr is not None and getattr(cfg, sw_attr, None) is not None
        layer_types = ["sliding_attention" if sliding else "full_attention"] * n
    moe = entry["moe"](inner) if entry.get("moe") is not None else None
    mask_positions = entry.get("mask_positions", True)
    derived = HFDerivedCarry(body.rotary_emb, cfg, layer_types, rotary_per_layer_type=entry.get("rotary_per_layer_type", False),
                             mask_positions=mask_positions)
    make_decoder = entry.get("decoder") or HFDecoderLayer
    if moe is not None:
        make_decoder = moe.decoder
    decoder = [make_decoder(body.layers[i], layer_types[i], derived) for i in range(n)]
    make_prefix = entry.get("prefix") or (lambda body_, config: HFPrefix(body_.embed_tokens, config))
    layers: list[nn.Module] = [make_prefix(body, cfg)]
    layers += decoder
    tail_kwargs = entry["tail_kwargs"](cfg) if entry.get("tail_kwargs") is not None else {}
    norm = entry["tail_norm"](body.norm, cfg) if entry.get("tail_norm") is not None else body.norm
    tail = HFTail(norm, inner.lm_head, inner.loss_function, cfg.vocab_size, **tail_kwargs)
    layers.append(moe.tail(tail) if moe is not None else tail)
    names = ["prefix(embed,positions)"] + [f"layers.{i}" for i in range(n)] + ["tail(norm,lm_head,loss)"]
    supported = SUPPORTED + (moe.kwargs if moe is not None else ())
    positional, known = model_arguments(inner)
    model_name = type(inner).__name__
    # `return_dict=False` of the call being run: `prepare` sets it, `finalize` reads it; both run in the
    # calling thread, `prepare` first (the engine's forward), so a thread's flag is its current call's
    call_format = threading.local()

    def is_host_call(args: tuple, kwargs: dict) -> bool:
        return check_call(bind_arguments(positional, args, kwargs, model_name), known, supported, model_name,
                          lambda: any(p.requires_grad for p in inner.parameters()))

    def prepare(args: tuple, kwargs: dict) -> dict:
        kwargs = bind_arguments(positional, args, kwargs, model_name)
        # `None` is "not given" for every argument (PEFT passes `inputs_embeds=None` and friends)
        unsupported = unsupported_arguments(kwargs, supported)
        if unsupported:  # the engine runs such calls on the host (`check_call`); this is for a direct `prepare`
            raise ValueError(
                f"The pipelined causal LM does not support {', '.join(f'`{k}={describe(kwargs[k])}`' for k in unsupported)}."
                f" Supported: {', '.join(f'`{k}`' for k in supported)}, and"
                f" {', '.join(f'`{k}`' for k in NOOP_KWARGS)} at their defaults. HINT: without gradients such calls"
                " (generation with a KV cache, `inputs_embeds`, hidden states, attentions) run un-pipelined on the host."
            )
        input_ids = kwargs.get("input_ids")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"`input_ids` must be an int tensor of shape (batch, seq), got {type(input_ids).__name__}"
                             f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else ''}.")
        return_dict = kwargs.get("return_dict")  # None: the config's, as HF's `can_return_tuple` reads it
        call_format.as_tuple = not (getattr(cfg, "return_dict", True) if return_dict is None else return_dict)
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        carry = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}
        # decided here, on the host, before upload: no device op reads a mask's or a position's value
        use_cache = getattr(cfg, "use_cache", False) if kwargs.get("use_cache") is None else kwargs["use_cache"]
        carry[LAYOUT_KEY] = sequence_layout(mask, positions, mask_positions and not use_cache)
        labels = kwargs.get("labels")
        if labels is not None:
            carry["labels"] = labels
            # label tokens of the whole batch after the causal shift (as transformers' ForCausalLMLoss counts them)
            n = kwargs.get("num_items_in_batch")
            carry["num_items_in_batch"] = (labels[..., 1:] != -100).sum() if n is None else torch.as_tensor(n)
        if moe is not None:
            moe.prepare(carry, kwargs)
        return carry

    def output(merged: dict) -> Any:
        if moe is not None:
            return moe.finalize(merged)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        from lightning_roundpipe.adapters.hf_outputs import FusedCausalLMOutput

        if "logits" not in merged:  # the fused path: the loss only
            return FusedCausalLMOutput(loss=merged.get("loss"))
        return CausalLMOutputWithPast(loss=merged.get("loss"), logits=merged.get("logits"))

    def finalize(merged: dict) -> Any:
        out = output(merged)
        # `return_dict=False`: the tuple of the output's values that are not None, as HF's `to_tuple`
        return out.to_tuple() if getattr(call_format, "as_tuple", False) else out

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
        host_call=is_host_call,
        derived=derived,
        boundary_bytes=lambda kwargs, dtype, num_microbatches=1: boundary_carry_bytes(
            prepare, cfg.hidden_size, kwargs, dtype, num_microbatches),
        restore=restore,
        prepare_microbatch=microbatch_layout,
    )
