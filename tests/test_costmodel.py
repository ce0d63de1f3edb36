"""The cost model: FLOPs and bytes per layer from a Hugging Face config, no weights allocated."""

from __future__ import annotations

import csv
import json
import pathlib
import re

import pytest

from lightning_roundpipe.partition import (
    CostModel,
    HardwareModel,
    LoRASpec,
    ModelShape,
    meta_param_counts,
    model_profiles,
    preset_config,
    preset_hf_config,
    preset_names,
)
from lightning_roundpipe.simulate import paper_data_path

CSV = paper_data_path("paper_layer_timings_4090.csv")  # packaged with lightning_roundpipe
# paper CSV row -> (preset, LoRA)
CSV_ROWS = {
    "Qwen3-1.7B": ("qwen3-1.7b", False),
    "Llama3.1-8B": ("llama3.1-8b", False),
    "Qwen3-32B": ("qwen3-32b", False),
    "Qwen3-235B-A22B-LoRA": ("qwen3-235b-a22b", True),
}
RTX4090_FP16 = HardwareModel(flops_per_s=330e12, h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, memory_bytes=24 * 2**30)
#: modelled per-layer times must be within this relative error of the paper's measurements
TOLERANCE = 0.20


def _paper_rows() -> dict[str, dict[str, str]]:
    text = [line for line in CSV.read_text().splitlines() if line and not line.startswith("#")]
    return {row["model"]: row for row in csv.DictReader(text)}


def test_presets_have_the_papers_shapes():
    assert preset_names() == ["qwen3-1.7b", "llama3.1-8b", "gpt-oss-20b", "qwen3-32b", "qwen3-235b-a22b"]
    # GPT-OSS-20B: 20.9B per its model card (21B, 3.6B active), 24 layers of width 2880
    expect = {"qwen3-1.7b": (28, 2048, 1.72e9), "llama3.1-8b": (32, 4096, 8.03e9), "gpt-oss-20b": (24, 2880, 20.91e9),
              "qwen3-32b": (64, 5120, 32.8e9), "qwen3-235b-a22b": (94, 4096, 235.1e9)}
    for name, (layers, hidden, params) in expect.items():
        shape = ModelShape.from_config(preset_config(name))
        assert (shape.num_hidden_layers, shape.hidden_size) == (layers, hidden)
        costs = CostModel().layer_costs(shape, seq_len=16, microbatch_size=1)
        assert len(costs) == layers + 2 and costs[0].kind == "prefix" and costs[-1].kind == "tail"
        total = sum(c.param_count for c in costs) - (costs[0].param_count if shape.tie_word_embeddings else 0)
        assert total == pytest.approx(params, rel=0.01)


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match=r"valid presets: \['qwen3-1.7b'"):
        preset_config("gpt-5")
    assert preset_config("Qwen3-32B")["hidden_size"] == 5120


@pytest.mark.parametrize("name", ["qwen3-1.7b", "llama3.1-8b", "gpt-oss-20b", "qwen3-32b", "qwen3-235b-a22b"])
def test_arithmetic_matches_meta_device_model(name):
    """Parameter counts per layer equal those of the real transformers class built on the meta device."""
    cfg = preset_hf_config(name, num_hidden_layers=2)
    arithmetic = [c.param_count for c in CostModel().layer_costs(ModelShape.from_config(cfg), seq_len=8, microbatch_size=1)]
    assert arithmetic == meta_param_counts(cfg)
    # the transformers object and the dict give the same shape
    assert ModelShape.from_config(cfg).hidden_size == preset_config(name)["hidden_size"]


@pytest.mark.parametrize("row_name", list(CSV_ROWS))
def test_per_layer_times_close_to_paper_rtx4090(row_name):
    row = _paper_rows()[row_name]
    preset, lora = CSV_ROWS[row_name]
    mp = model_profiles(preset_config(preset), RTX4090_FP16, seq_len=2048, microbatch_size=4,
                        lora=LoRASpec() if lora else None)
    assert len(mp.profiles) == int(row["num_layers"]) + 2
    assert mp.shape.vocab_size == int(row["vocab_size"]) and mp.shape.hidden_size == int(row["hidden_size"])
    layer, tail = mp.profiles[1], mp.profiles[-1]
    pairs = {
        "fwd_ms_per_layer": layer.forward_s, "bwd_ms_per_layer": layer.backward_s,
        "lm_head_fwd_ms": tail.forward_s, "lm_head_bwd_ms": tail.backward_s,
    }
    for key, modelled_s in pairs.items():
        paper_ms = float(row[key])
        assert modelled_s * 1e3 == pytest.approx(paper_ms, rel=TOLERANCE), (row_name, key)
    # one activation hop GPU -> CPU -> GPU: the paper measured about 21 GB/s effective
    assert layer.activation_bytes / 21e9 * 1e3 == pytest.approx(float(row["comm_ms_per_hop"]), rel=0.15)


def test_backward_is_about_twice_forward_in_flops():
    shape = ModelShape.from_config(preset_config("llama3.1-8b"))
    costs = CostModel().layer_costs(shape, seq_len=2048, microbatch_size=4)
    dec = costs[1]
    assert dec.backward_gemm_flops == pytest.approx(2 * dec.forward_gemm_flops)
    assert 2.0 <= dec.backward_flops / dec.forward_flops <= 2.2  # attention backward is 2.5x its forward
    # 2 FLOPs per weight per token in the projections and MLP
    assert dec.forward_gemm_flops == pytest.approx(2 * 8192 * (dec.param_count - 2 * 4096))


def test_moe_counts_active_experts_only():
    shape = ModelShape.from_config(preset_config("qwen3-235b-a22b"))
    assert shape.num_experts == 128 and shape.num_experts_per_tok == 8 and all(shape.moe_layers)
    dec = CostModel().layer_costs(shape, seq_len=2048, microbatch_size=4)[1]
    assert dec.forward_expert_flops == pytest.approx(2 * 8192 * 8 * 3 * 4096 * 1536)
    assert dec.param_count > 2.4e9  # all 128 experts are uploaded
    # mixtral-style key and mlp_only_layers / decoder_sparse_step
    cfg = dict(preset_config("qwen3-235b-a22b"), num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert ModelShape.from_config(cfg).moe_layers == (False, True, False, False)


def test_sliding_window_layers_attend_within_the_window():
    """GPT-OSS alternates sliding-window (128 keys) and full causal attention layers: the attention
    FLOPs of a sliding layer are those of the keys each query sees, counted one query at a time."""
    shape = ModelShape.from_config(preset_config("gpt-oss-20b"))
    assert shape.sliding_window == 128 and shape.sliding_layers == (True, False) * 12
    assert shape.num_experts == 32 and shape.num_experts_per_tok == 4 and all(shape.moe_layers)
    s, b = 2048, 4
    costs = CostModel().layer_costs(shape, seq_len=s, microbatch_size=b)
    sliding, full = costs[1], costs[2]
    per_key = 2 * 2 * b * shape.num_attention_heads * shape.head_dim  # QK^T and PV, multiply-add
    keys_sliding = sum(min(p + 1, 128) for p in range(s))
    keys_causal = sum(p + 1 for p in range(s))
    assert sliding.forward_attention_flops == pytest.approx(per_key * keys_sliding, rel=0.01)
    assert full.forward_attention_flops == pytest.approx(per_key * keys_causal, rel=0.01)
    assert sliding.backward_attention_flops == pytest.approx(2.5 * sliding.forward_attention_flops)
    # a window as long as the sequence is plain causal attention
    short = CostModel().layer_costs(shape, seq_len=128, microbatch_size=b)
    assert short[1].forward_attention_flops == pytest.approx(short[2].forward_attention_flops)


def test_lora_trains_tiny_adapters_and_skips_frozen_backward():
    full = model_profiles(preset_config("qwen3-32b"), RTX4090_FP16, seq_len=2048, microbatch_size=4)
    lora = model_profiles(preset_config("qwen3-32b"), RTX4090_FP16, seq_len=2048, microbatch_size=4, lora=LoRASpec(rank=16))
    trainable = sum(p.grad_bytes for p in lora.profiles)
    assert 0 < trainable < 0.01 * sum(p.param_bytes for p in lora.profiles)
    assert lora.profiles[0].backward_s == 0.0 and lora.profiles[0].grad_bytes == 0  # frozen embedding of token ids
    assert lora.profiles[-1].grad_bytes == 0 and lora.profiles[-1].backward_s > 0  # LM head: input gradient only
    assert lora.profiles[1].backward_s < 0.7 * full.profiles[1].backward_s
    assert sum(p.grad_bytes for p in full.profiles) == sum(p.param_bytes for p in full.profiles)
    with pytest.raises(ValueError, match="rank"):
        LoRASpec(rank=0)


def test_saved_activations_grow_with_sequence():
    shape = ModelShape.from_config(preset_config("qwen3-1.7b"))
    unchunked = CostModel(loss_chunk_bytes=None)
    a = unchunked.layer_costs(shape, seq_len=1024, microbatch_size=1)
    b = unchunked.layer_costs(shape, seq_len=2048, microbatch_size=1)
    for x, y in zip(a, b):
        assert y.saved_activation_bytes == 2 * x.saved_activation_bytes
    # unchunked, the tail keeps the logits and their gradient: 8 + 2 bytes per bf16 logit by default
    assert b[-1].saved_activation_bytes >= 2048 * 151936 * 10
    # chunked (the default): one chunk of 256 MiB of bf16 logits = 883 tokens
    c = CostModel().layer_costs(shape, seq_len=2048, microbatch_size=1)
    assert c[:-1] == b[:-1]
    assert c[-1].saved_activation_bytes - 883 * 151936 * 10 == b[-1].saved_activation_bytes - 2048 * 151936 * 10


def test_load_config_json_file_folder_and_text_config(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ModelShape.load(tmp_path).head_dim == 16
    assert ModelShape.load(tmp_path / "config.json").num_layers == 5
    wrapped = {"model_type": "llava", "text_config": cfg}
    assert ModelShape.from_config(wrapped).hidden_size == 64
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelShape.load(tmp_path / "nope")
    bad = dict(cfg)
    del bad["vocab_size"]
    with pytest.raises(ValueError, match="`vocab_size`"):
        ModelShape.from_config(bad)
    with pytest.raises(TypeError, match="`config`"):
        ModelShape.from_config(42)


def test_bad_workload_and_efficiency():
    shape = ModelShape.from_config(preset_config("qwen3-1.7b"))
    with pytest.raises(ValueError, match="`seq_len`"):
        CostModel().layer_costs(shape, seq_len=0, microbatch_size=1)
    with pytest.raises(ValueError, match="gemm_efficiency"):
        CostModel(gemm_efficiency=1.5)


def test_partition_package_never_imports_lightning():
    root = pathlib.Path(__file__).resolve().parents[1] / "lightning_roundpipe" / "partition"
    for path in root.glob("*.py"):
        src = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+lightning(\.|\s|$)", src, re.M), path
        assert ".cuda" not in src and "device(\"cuda" not in src, path
