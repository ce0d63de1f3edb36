"""Shape presets of the models of the RoundPipe paper's evaluation (arXiv 2604.27085, section 5).

Config values only (the fields of the models' Hugging Face ``config.json``), written here so that a
plan can be made with no network and no weights. :func:`preset_config` returns a plain dict (what the
cost model reads); :func:`preset_hf_config` builds the matching ``transformers`` config object
locally (used to cross-check the arithmetic against a meta-device model).
"""

from __future__ import annotations

import copy
from typing import Any

_QWEN3_COMMON: dict[str, Any] = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}

#: name -> ``config.json`` fields. Names are lower case; :func:`preset_config` also accepts the
#: paper's spelling (``Qwen3-32B``).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": {
        **_QWEN3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "llama3.1-8b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # openai/gpt-oss-20b's config.json (the MoE experts are stored in MXFP4 there; fine-tuning, as the
    # paper's run, holds them in the compute dtype like every other weight)
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "attention_bias": True,
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "max_position_embeddings": 131072,
        "initial_context_length": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-32b": {
        **_QWEN3_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "qwen3-235b-a22b": {
        **_QWEN3_COMMON,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
}

_ALIASES = {
    "qwen3-1.7b": "qwen3-1.7b", "qwen3_1.7b": "qwen3-1.7b",
    "llama3.1-8b": "llama3.1-8b", "llama-3.1-8b": "llama3.1-8b", "meta-llama-3.1-8b": "llama3.1-8b",
    "qwen3-32b": "qwen3-32b",
    "gpt-oss-20b": "gpt-oss-20b", "gpt_oss_20b": "gpt-oss-20b", "openai/gpt-oss-20b": "gpt-oss-20b",
    "qwen3-235b-a22b": "qwen3-235b-a22b", "qwen3-235b-a22b-lora": "qwen3-235b-a22b", "qwen3-235b": "qwen3-235b-a22b",
}

#: Display names (the paper's spelling, also the column names of the CSVs in ``lightning_roundpipe/simulate/data``).
DISPLAY_NAMES = {
    "qwen3-1.7b": "Qwen3-1.7B", "llama3.1-8b": "Llama3.1-8B", "gpt-oss-20b": "GPT-OSS-20B", "qwen3-32b": "Qwen3-32B",
    "qwen3-235b-a22b": "Qwen3-235B-A22B",
}


def preset_names() -> list[str]:
    """The canonical preset names, smallest model first."""
    return list(PRESETS)


def canonical_preset_name(name: str) -> str:
    """Normalise ``name`` (case, ``Llama-3.1-8B`` / ``llama3.1-8b``) to a key of :data:`PRESETS`.

    Raises:
        ValueError: for an unknown name, listing the valid ones.
    """
    key = str(name).strip().lower().replace(" ", "")
    key = _ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(
            f"Unknown model preset `{name}`; valid presets: {preset_names()}."
            " HINT: pass a local Hugging Face config.json instead (`--model PATH` / `ModelShape.from_config`)."
        )
    return key


def preset_config(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's ``config.json`` fields (a plain dict, ``name`` added as ``_name_or_path``).

    Raises:
        ValueError: for an unknown name, listing the valid ones.
    """
    key = canonical_preset_name(name)
    cfg = copy.deepcopy(PRESETS[key])
    cfg["_name_or_path"] = DISPLAY_NAMES[key]
    return cfg


def preset_hf_config(name: str, **overrides: Any):
    """The preset as a ``transformers`` config object, built locally (no network).

    Args:
        name: a preset name (see :func:`preset_names`).
        **overrides: config fields to change, e.g. ``num_hidden_layers=2`` for a cheap meta-device check
            (a per-layer ``layer_types`` list follows the new layer count, keeping its pattern).

    Raises:
        ValueError: for an unknown name.
    """
    from transformers import AutoConfig  # local: the plan command must not pay for this import

    cfg = preset_config(name)
    cfg.update(overrides)
    layers = cfg["num_hidden_layers"]
    if "layer_types" in cfg and "layer_types" not in overrides and len(cfg["layer_types"]) != layers:
        pattern = cfg["layer_types"]  # a shorter (or longer) model keeps the per-layer pattern
        cfg["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    model_type = cfg.pop("model_type")
    for k in ("architectures", "torch_dtype", "_name_or_path"):
        cfg.pop(k, None)
    return AutoConfig.for_model(model_type, **cfg)
