"""Frozen matmul weights in fp8 (``frozen_weights="fp8"``; issue 21 item 2, DESIGN.md section 12).

A frozen matmul weight (the LoRA base: a 2-D ``nn.Linear`` weight, or a Hugging Face ``Conv1D``
weight, with ``requires_grad=False``) is held on the host as ``float8_e4m3fn`` codes with one fp32
scale per output channel, uploaded as those bytes (1 per parameter instead of 2 in bf16, plus 4 per
output channel) and dequantised on the device, in the stage's compute dtype, right before its layer
first runs. Per output channel ``c`` (a row of an ``nn.Linear`` weight ``(out, in)``, a column of a
``Conv1D`` weight ``(in, out)``)::

    scale[c]   = amax(|w[c, :]|) / 448            (fp32; 1.0 for an all-zero channel)
    codes[c, :] = fp8_e4m3fn(clamp(fp32(w[c, :]) / scale[c], -448, 448))
    w'[c, :]    = dtype(fp32(codes[c, :]) * scale[c])

448 is e4m3's largest finite value, so every channel uses e4m3's whole range: an element within a
factor 2**14 of its channel's largest magnitude is rounded to at most 2**-4 relative error (3 mantissa
bits), a smaller one (a subnormal code) to at most ``2**-10 * scale`` absolute.

Host layout of one converted weight: one ``uint8`` block, ``[codes (numel bytes), padding to 16,
scales (4 bytes per output channel)]``; the parameter's ``.data`` is the codes' view of it, and the
block is what a stage's ``LOAD`` copies, so the codes and their scales travel together. Only torch
ops are used (no fp8 matmul): any device that can convert fp8 to fp32 dequantises.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
"""The storage dtype of the converted weights: e4m3 without infinities (``torch.float8_e4m3fn``)."""

FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
"""Largest finite e4m3fn value (448): the amax of every output channel maps to it."""

SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""Dtypes a weight is converted from (other dtypes, already quantised ones included, are left as they are)."""

CHUNK_ELEMENTS = 2**22
"""Elements converted at a time (4 Mi: about 36 MiB of transients), so the conversion of a large
weight needs little memory beyond the weight and its fp8 block."""

_ALIGN = 16


def _pad(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _channel_dim(module: nn.Module, name: str, param: torch.Tensor) -> int | None:
    """The output-channel dim of ``param`` when it is a frozen matmul weight of ``module``, else ``None``."""
    if name != "weight" or param.requires_grad or param.dim() != 2 or param.dtype not in SOURCE_DTYPES:
        return None
    if isinstance(module, nn.Linear):
        return 0  # (out_features, in_features)
    cls = type(module)
    is_conv1d = cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")
    if is_conv1d and getattr(module, "nf", None) == param.shape[1]:
        return 1  # transformers' Conv1D (GPT-2): (nx, nf), y = x @ w + b
    return None


def fp8_candidates(layers: Sequence[nn.Module]) -> dict[int, int]:
    """The frozen matmul weights of ``layers``: ``id`` of the parameter -> its output-channel dim.

    A parameter qualifies when it does not require grad, is 2-D, has a dtype of :data:`SOURCE_DTYPES`
    and every module that registers it is an ``nn.Linear`` (channel dim 0) or a transformers
    ``Conv1D`` (channel dim 1) holding it as its ``weight``. Norm weights, biases, embeddings (a weight
    tied between an embedding and the LM head too) and trainable weights (LoRA's A/B, a trained head)
    do not.
    """
    found: dict[int, int] = {}
    other: set[int] = set()
    for layer in layers:
        for module in layer.modules():
            for name, param in module._parameters.items():
                if param is None:
                    continue
                dim = _channel_dim(module, name, param)
                if dim is None or found.get(id(param), dim) != dim:
                    other.add(id(param))
                else:
                    found[id(param)] = dim
    return {key: dim for key, dim in found.items() if key not in other}


def describe_frozen(layers: Sequence[nn.Module]) -> str:
    """What the frozen parameters of ``layers`` are, by module type and name (``'LlamaRMSNorm.weight x 11,
    Embedding.weight x 1'``; tied parameters once), for the message that nothing was converted."""
    seen: set[int] = set()
    kinds: Counter[str] = Counter()
    for layer in layers:
        for module in layer.modules():
            for name, param in module._parameters.items():
                if param is None or param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                kinds[f"{type(module).__name__}.{name}"] += 1
    return ", ".join(f"{kind} x {count}" for kind, count in kinds.most_common()) or "none"


def block_layout(shape: torch.Size | tuple[int, int], channel_dim: int) -> tuple[int, int, tuple[int, int]]:
    """``(scale offset, block bytes, scale shape)`` of a weight of ``shape`` (see the module docstring):
    the codes take ``numel`` bytes from offset 0, the scales ``4 x channels`` bytes from the scale
    offset (16-byte aligned); the scale shape broadcasts over the weight."""
    rows, cols = int(shape[0]), int(shape[1])
    scale_offset = _pad(rows * cols)
    channels = (rows, cols)[channel_dim]
    scale_shape = (channels, 1) if channel_dim == 0 else (1, channels)
    return scale_offset, scale_offset + 4 * channels, scale_shape


def split_block(block: torch.Tensor, shape: torch.Size | tuple[int, int],
                channel_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(codes, scale)`` views of a converted weight's ``uint8`` ``block`` (host or device):
    codes ``float8_e4m3fn`` of ``shape``, scale fp32 of the broadcasting scale shape."""
    scale_offset, total, scale_shape = block_layout(shape, channel_dim)
    numel = int(shape[0]) * int(shape[1])
    codes = block[:numel].view(FP8_DTYPE).view(tuple(shape))
    scale = block[scale_offset:total].view(torch.float32).view(scale_shape)
    return codes, scale


def _row_chunks(rows: int, cols: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def quantise_into(weight: torch.Tensor, channel_dim: int, codes: torch.Tensor, scale: torch.Tensor,
                  name: str = "a weight") -> None:
    """Write the per-channel fp8 codes and scales of the 2-D ``weight`` (formula in the module
    docstring), :data:`CHUNK_ELEMENTS` at a time.

    Args:
        weight: the weight, any of :data:`SOURCE_DTYPES`, shape ``(rows, cols)``.
        channel_dim: 0 (a scale per row: ``nn.Linear``) or 1 (per column: ``Conv1D``).
        codes: ``float8_e4m3fn`` output, ``weight``'s shape.
        scale: fp32 output, ``(rows, 1)`` or ``(1, cols)``.
        name: the weight, for the error message.

    Raises:
        ValueError: ``weight`` holds an infinity or NaN (no finite scale exists).
    """
    rows, cols = weight.shape
    chunks = _row_chunks(rows, cols)
    with torch.no_grad():
        if channel_dim == 0:
            amax = torch.cat([weight[a:b].abs().amax(dim=1).to(torch.float32) for a, b in chunks]) if rows else \
                torch.zeros(0)
            amax = amax.view(rows, 1)
        else:
            amax = torch.zeros(1, cols)
            for a, b in chunks:
                torch.maximum(amax, weight[a:b].abs().amax(dim=0, keepdim=True).to(torch.float32), out=amax)
        if not bool(torch.isfinite(amax).all()):
            raise ValueError(f"RoundPipe cannot hold {name} of shape {tuple(weight.shape)} in fp8: it holds an infinity"
                             " or NaN. HINT: check the checkpoint the model was loaded from, or pass `frozen_weights=None`.")
        scale.copy_(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))
        for a, b in chunks:
            part = scale[a:b] if channel_dim == 0 else scale
            codes[a:b].copy_((weight[a:b].to(torch.float32) / part).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))


def dequantise(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dtype(fp32(codes) * scale)``: a converted weight back in ``dtype`` (on the device of ``codes``,
    outside autocast, without autograd history)."""
    with torch.no_grad(), torch.autocast(codes.device.type, enabled=False):
        return codes.to(torch.float32).mul_(scale).to(dtype)


def dequantise_into(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, channel_dim: int) -> None:
    """:func:`dequantise` into ``out`` (``codes``' shape, its own dtype), :data:`CHUNK_ELEMENTS` at a time
    (the host's conversion back when the strategy tears down)."""
    rows, cols = codes.shape
    with torch.no_grad():
        for a, b in _row_chunks(rows, cols):
            part = scale[a:b] if channel_dim == 0 else scale
            out[a:b].copy_(codes[a:b].to(torch.float32).mul_(part).to(out.dtype))
