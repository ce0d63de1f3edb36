"""FLOPs of a training step and the devices' peak FLOP/s, for model FLOPs utilisation (MFU).

Formula (PaLM, Chowdhery et al. 2022, appendix B; the 2/4 split of forward and backward as in
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters using
Megatron-LM", section 5.1): a matrix multiply with ``N`` weights costs ``2N`` FLOPs per token
forward, ``2N`` for the input gradient and ``2N`` for the weight gradient; attention scores and
their weighted sum cost ``4 d T`` per token and layer forward (``d``: heads x head dim, ``T``:
sequence length; PaLM's full ``T``, causal masking not subtracted) and twice that backward. So one
training token costs

    model FLOPs = 4 N + 2 N_trainable + 12 L d T

(``6N + 12LdT``, PaLM's formula, when every weight trains; LoRA: frozen weights need no weight
gradient). ``N`` counts the weights of matrix multiplies: every parameter of the pipelined model
except pure embedding lookups (an ``nn.Embedding`` weight not shared with a linear layer; a tied LM
head counts once). MFU = model FLOPs / (step seconds x devices x peak FLOP/s): recomputation is
not useful work and is left out (PaLM's definition); RoundPipe's recomputation (every backward
stage re-runs its layers' forward, except the fused tail) is counted apart as
:func:`recompute_flops` (hardware FLOPs = model + recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

__all__ = ["PEAK_FLOPS", "LayerFlops", "layer_flops", "peak_flops_per_s", "recompute_flops", "step_model_flops"]

#: Dense peak FLOP/s per GPU by (device-name fragment, math): ``"bf16"``/``"fp16"`` tensor cores
#: with fp32 accumulation, ``"tf32"`` tensor cores, ``"fp32"`` without. Sources: NVIDIA's product
#: datasheets and the Ada (RTX 4090) and Ampere (A100, RTX 3090) architecture whitepapers; dense
#: (no 2:4 sparsity). First matching fragment wins (more specific names first).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 PCIe": {"bf16": 756.0e12, "fp16": 756.0e12, "tf32": 378.0e12, "fp32": 51.2e12},
    "H100": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},  # SXM
    "A100": {"bf16": 312.0e12, "fp16": 312.0e12, "tf32": 156.0e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183.0e12, "fp32": 91.6e12},
    "RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "RTX 3090": {"bf16": 71.0e12, "fp16": 71.0e12, "tf32": 35.6e12, "fp32": 35.6e12},
}


def _math(dtype: torch.dtype | None) -> str:
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops_per_s(device: torch.device, compute_dtype: torch.dtype | None) -> float | None:
    """Dense peak FLOP/s of ``device`` for matrix multiplies in ``compute_dtype``.

    Args:
        device: a CUDA device (its ``torch.cuda.get_device_name`` is looked up in
            :data:`PEAK_FLOPS`); CPU devices have no entry.
        compute_dtype: the dtype the stages compute in (autocast or weights); fp32 uses the TF32
            entry when ``torch.get_float32_matmul_precision()`` is not ``"highest"``.

    Returns:
        FLOP/s, or ``None`` for a CPU or an unknown GPU (pass ``RoundPipeStrategy(peak_flops=...)``).
    """
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in PEAK_FLOPS.items():
        if fragment in name:
            return peaks[_math(compute_dtype)]
    return None


@dataclass(frozen=True)
class LayerFlops:
    """Per-layer sizes the FLOPs formula needs.

    Attributes:
        matmul_weights: ``N`` of the layer: weights of its matrix multiplies (see module doc).
        trainable_weights: the part of ``matmul_weights`` that trains (needs a weight gradient).
        attention_dim: ``d`` = heads x head dim of its self-attention, 0 for a layer without one.
    """

    matmul_weights: int
    trainable_weights: int
    attention_dim: int


def layer_flops(layers: Sequence[nn.Module]) -> list[LayerFlops]:
    """:class:`LayerFlops` of every layer of a layer sequence (a tied parameter counts in its first layer).

    The attention dim of a layer comes from a submodule named ``self_attn`` (Hugging Face decoder
    layers): its ``config.num_attention_heads`` x ``head_dim``.
    """
    linear = {id(p) for layer in layers for m in layer.modules() if not isinstance(m, nn.Embedding)
              for p in m.parameters(recurse=False)}
    lookup = {id(p) for layer in layers for m in layer.modules() if isinstance(m, nn.Embedding)
              for p in m.parameters(recurse=False)}
    seen: set[int] = set()
    out = []
    for layer in layers:
        weights = trainable = 0
        for p in layer.parameters():
            if id(p) in seen or (id(p) in lookup and id(p) not in linear):
                continue
            seen.add(id(p))
            weights += p.numel()
            trainable += p.numel() if p.requires_grad else 0
        dim = 0
        for name, m in layer.named_modules():
            if name.rsplit(".", 1)[-1] == "self_attn":
                cfg = getattr(m, "config", None)
                heads = getattr(cfg, "num_attention_heads", None)
                if heads:
                    dim = heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
                break
        out.append(LayerFlops(weights, trainable, dim))
    return out


def step_model_flops(layers: Sequence[LayerFlops], tokens: int, seq_len: int) -> float:
    """Model FLOPs of one training step on ``tokens`` tokens of sequences of ``seq_len``:
    ``tokens x (4 N + 2 N_trainable + 12 L d T)`` summed over layers (module docstring)."""
    per_token = sum(4 * lf.matmul_weights + 2 * lf.trainable_weights + 12 * lf.attention_dim * seq_len for lf in layers)
    return float(tokens) * per_token


def recompute_flops(layers: Sequence[LayerFlops], recomputed: Sequence[tuple[range, int]], seq_len: int) -> float:
    """FLOPs of recomputation: forward FLOPs (``2 N + 4 d T`` per token) of each ``(layers, tokens)``
    pair in ``recomputed`` (one per ``R`` op of the step: the stage's layers and its microbatch's tokens)."""
    total = 0.0
    for layer_range, tokens in recomputed:
        per_token = sum(2 * layers[i].matmul_weights + 4 * layers[i].attention_dim * seq_len for i in layer_range)
        total += float(tokens) * per_token
    return total
