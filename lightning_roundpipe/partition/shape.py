"""The model's shape read from a Hugging Face config (:class:`ModelShape`) and the LoRA setting
(:class:`LoRASpec`): the inputs of the cost model (:mod:`lightning_roundpipe.partition.costmodel`), pure
arithmetic on the config, no torch.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

#: ``model_type`` s whose config the arithmetic understands (llama-style layout: q/k/v/o projections,
#: gated MLP or MoE experts, RMSNorm). Others are tried with the same keys.
KNOWN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")
_QK_NORM_TYPES = ("qwen3", "qwen3_moe")
#: GPT-OSS: bias on the output projection too, a learned sink logit per head, biases on the router
#: and on every expert's projections.
_GPT_OSS_TYPES = ("gpt_oss",)
_LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The numbers of a decoder-only causal LM that set its per-layer cost (from ``config.json``)."""

    name: str
    """Label for tables (``_name_or_path`` or the preset name)."""
    model_type: str
    """Hugging Face ``model_type`` (``qwen3``, ``llama``, ``qwen3_moe``...)."""
    hidden_size: int
    """Width of the residual stream, elements."""
    intermediate_size: int
    """Width of the dense gated MLP, elements (unused by MoE layers)."""
    num_hidden_layers: int
    """Number of decoder layers ``N``."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Elements per attention head."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding weight (it is still uploaded by both the prefix and the tail stage)."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head (Qwen3)."""
    attention_bias: bool = False
    """Biases on the q/k/v projections (Qwen2)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (``k`` of top-k)."""
    moe_intermediate_size: int = 0
    """Width of one expert's gated MLP, elements."""
    moe_layers: tuple[bool, ...] = ()
    """Per decoder layer, whether its MLP is the MoE block (empty: all dense)."""
    attention_output_bias: bool = False
    """A bias on the attention's output projection too (GPT-OSS)."""
    attention_sinks: bool = False
    """A learned sink logit per attention head (GPT-OSS)."""
    expert_bias: bool = False
    """Biases on the router and on every expert's projections (GPT-OSS)."""
    sliding_window: int = 0
    """Keys a sliding-window attention layer sees per query, tokens (0: none)."""
    sliding_layers: tuple[bool, ...] = ()
    """Per decoder layer, whether it attends within ``sliding_window`` only (``layer_types``)."""

    @property
    def num_layers(self) -> int:
        """Entries of the layer sequence: prefix + decoder layers + tail."""
        return self.num_hidden_layers + 2

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based) has the MoE MLP."""
        return bool(self.moe_layers) and self.moe_layers[index]

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> "ModelShape":
        """Read the shape from a ``transformers`` config object or a ``config.json`` dict.

        A multimodal config's ``text_config`` is used when present.

        Raises:
            ValueError: a required field is missing or not positive (named, with the model type).
            TypeError: ``config`` is neither a mapping nor a config object.
        """
        if hasattr(config, "to_dict") and not isinstance(config, Mapping):
            config = config.to_dict()
        if not isinstance(config, Mapping):
            raise TypeError(
                f"`config` must be a transformers config object or a dict of config.json fields, got"
                f" {type(config).__name__}. HINT: `ModelShape.load('path/to/config.json')`."
            )
        cfg = dict(config)
        if isinstance(cfg.get("text_config"), Mapping) and "hidden_size" not in cfg:
            cfg = {**cfg["text_config"], "_name_or_path": cfg.get("_name_or_path", "")}
        model_type = str(cfg.get("model_type", "unknown"))

        def integer(key: str) -> int:
            value = cfg[key]
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or value != int(value)):
                raise ValueError(f"Config field `{key}` must be a whole number for model_type `{model_type}`, got"
                                 f" {value!r}. HINT: check the config.json against the model's own.")
            return int(value)

        def optional(key: str, *alts: str) -> int:
            """The first of ``key, *alts`` the config sets (not null, not 0), else 0."""
            for k in (key, *alts):
                if cfg.get(k):
                    return integer(k)
            return 0

        def need(key: str, *alts: str) -> int:
            for k in (key, *alts):
                if cfg.get(k) is not None:
                    v = integer(k)
                    if v <= 0:
                        raise ValueError(f"Config field `{k}` must be > 0 for model_type `{model_type}`, got {v}.")
                    return v
            raise ValueError(
                f"Config of model_type `{model_type}` lacks `{key}`"
                + (f" (or {', '.join(f'`{a}`' for a in alts)})" if alts else "")
                + f". The cost model reads llama-style decoder configs ({', '.join(KNOWN_MODEL_TYPES)}); HINT: pass"
                " the `config.json` of a Hugging Face decoder-only causal LM."
            )

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv = optional("num_key_value_heads") or heads
        if kv < 1 or heads % kv:
            raise ValueError(f"Config field `num_key_value_heads` = {kv} must divide `num_attention_heads` = {heads}"
                             f" (model_type `{model_type}`: each key/value head serves a group of query heads)."
                             " HINT: check the config.json against the model's own.")
        head_dim = optional("head_dim") or hidden // heads
        layers = need("num_hidden_layers")
        experts = optional("num_experts", "num_local_experts", "n_routed_experts")
        moe_layers: tuple[bool, ...] = ()
        moe_inter = 0
        if experts > 0:
            step = optional("decoder_sparse_step") or 1
            mlp_only = set(cfg.get("mlp_only_layers") or ())
            moe_layers = tuple((i not in mlp_only) and (i + 1) % step == 0 for i in range(layers))
            moe_inter = optional("moe_intermediate_size", "intermediate_size")
            if moe_inter <= 0:
                raise ValueError(f"MoE config of model_type `{model_type}` lacks `moe_intermediate_size`.")
        sliding = tuple(str(t) == "sliding_attention" for t in (cfg.get("layer_types") or ())[:layers])
        window = optional("sliding_window") if any(sliding) else 0
        gpt_oss = model_type in _GPT_OSS_TYPES
        return cls(
            name=name or str(cfg.get("_name_or_path") or model_type),
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=optional("intermediate_size") if experts else need("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type in _QK_NORM_TYPES,
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            num_experts=experts,
            num_experts_per_tok=optional("num_experts_per_tok") if experts else 0,
            moe_intermediate_size=moe_inter,
            moe_layers=moe_layers,
            attention_output_bias=gpt_oss and bool(cfg.get("attention_bias", True)),
            attention_sinks=gpt_oss,
            expert_bias=gpt_oss and experts > 0,
            sliding_window=window,
            sliding_layers=sliding if window else (),
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ModelShape":
        """Read a local ``config.json`` (a file, or a folder holding one).

        Raises:
            FileNotFoundError: no such file / no ``config.json`` in the folder.
            ValueError: the file is not JSON or lacks required fields.
        """
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        if not os.path.isfile(p):
            raise FileNotFoundError(f"No Hugging Face config at `{path}` (looked for `{p}`). HINT: pass a config.json file or its folder.")
        try:
            with open(p, encoding="utf-8") as fh:
                data = json.load(fh)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"`{p}` is not valid JSON: {e}. HINT: pass a Hugging Face `config.json` (file or"
                             " folder).") from e
        if not isinstance(data, dict):
            raise ValueError(f"`{p}` holds a JSON {type(data).__name__}, not an object of config fields. HINT: pass a"
                             " Hugging Face `config.json` (file or folder).")
        default_name = os.path.basename(os.path.dirname(os.path.abspath(p))) or p
        return cls.from_config(data, name=data.get("_name_or_path") or default_name)


@dataclass(frozen=True, kw_only=True)
class LoRASpec:
    """LoRA fine-tuning: the base is frozen, only rank-``rank`` adapters train."""

    rank: int = 16
    """Adapter rank ``r``; an adapter on an ``in x out`` projection has ``r * (in + out)`` weights."""
    target_modules: tuple[str, ...] = _LORA_DEFAULT_TARGETS
    """Projections that get an adapter. Experts of MoE layers (fused 3-D weights) get none."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"`LoRASpec.rank` must be >= 1, got {self.rank}.")
