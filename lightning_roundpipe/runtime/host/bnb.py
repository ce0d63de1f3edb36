"""bitsandbytes frozen weights on RoundPipe devices (issue 33, DESIGN.md section 12).

Two ways a frozen matmul weight is held packed in 4 or 8 bits:

- **loaded so** (the QLoRA recipe: ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))``
  or ``load_in_8bit=True``): a ``bitsandbytes.nn.Linear4bit`` whose ``weight`` is a ``Params4bit`` (NF4 or FP4,
  with or without double quantisation) or a ``Linear8bitLt`` whose ``weight`` is an ``Int8Params`` (LLM.int8()).
  The module runs as it is on the devices: each device binds a ``Params4bit`` (``Int8Params`` and a
  ``MatmulLtState``) made of views of the stage's uploaded buffer, so every tensor of the quantisation state is
  on the device the layer runs on and bitsandbytes' own kernels compute (its CUDA kernels on GPUs, its CPU
  backend on CPU virtual devices);
- **converted** (``frozen_weights="nf4"``): a plain ``nn.Linear`` weight (fp32/bf16/fp16) quantised once, when
  the strategy takes the model, with ``bitsandbytes.functional.quantize_4bit`` (NF4, blocksize
  :data:`NF4_BLOCKSIZE`, double quantisation of the absmax); the device dequantises it with
  ``bitsandbytes.functional.dequantize_4bit`` when its layer first binds in a residency (what ``Linear4bit``
  computes: dequantise, then matmul), to the compute dtype.

Host layout of one such weight: one ``uint8`` block (pinned on CUDA) holding each tensor (a *piece*) at a
16-byte-aligned offset: ``data`` (the packed codes: ``uint8`` pairs of 4-bit codes, or ``int8``), and for
4 bits ``absmax`` (fp32 per block of ``blocksize`` codes, or ``uint8`` codes of it when double-quantised),
``code`` (the 16-entry fp32 table), and when double-quantised ``offset`` (fp32, 0-dim), ``absmax2`` and
``code2`` (the nested state's fp32 absmax and 256-entry table); for 8 bits ``SCB`` (fp32 row scales). A
stage's ``LOAD`` copies the block, so the packed codes and their whole quantisation state travel together.
For a loaded weight the module's own tensors become views of the block (the same ``Params4bit`` /
``QuantState`` / ``Int8Params`` objects, the same values); nothing is dequantised on the host.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_roundpipe.runtime.host.pinned import is_pinned, pinned_bytes

NF4_BLOCKSIZE = 64
"""Codes per absmax of ``frozen_weights="nf4"`` (bitsandbytes' and QLoRA's default)."""

NF4_DOUBLE_QUANT = True
"""``frozen_weights="nf4"`` quantises the absmax again (8-bit codes per block of 256, QLoRA's "double
quantisation"): 0.127 instead of 0.5 bits per parameter for the scales."""

_ALIGN = 16


def _bnb() -> Any | None:
    """The ``bitsandbytes`` module when it is imported (no weight of it exists otherwise), else ``None``."""
    return sys.modules.get("bitsandbytes")


def require_bnb(what: str) -> Any:
    """Import ``bitsandbytes``.

    Raises:
        ImportError: it is not installed.
    """
    try:
        import bitsandbytes
    except ImportError as error:  # pragma: no cover - the test extra installs it
        raise ImportError(f"RoundPipe needs `bitsandbytes` for {what}. HINT: `pip install 'lightning-roundpipe[qlora]'`"
                          " (bitsandbytes 0.50), or leave `frozen_weights` unset.") from error
    return bitsandbytes


@dataclass(frozen=True)
class Piece:
    """One tensor of a packed weight's host block: byte offset, dtype and shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass
class PackedWeight:
    """A frozen weight held packed (see the module docstring).

    Attributes:
        kind: ``"4bit"`` (NF4/FP4 codes, ``Params4bit``) or ``"int8"`` (``Int8Params``).
        shape: the weight's logical shape ``(out_features, in_features)``.
        pieces: name -> :class:`Piece` in the block.
        total_bytes: the block's bytes (what one upload moves).
        meta: the non-tensor quantisation state (4 bits: ``blocksize``, ``quant_type``, ``dtype``,
            ``nested_blocksize``, ``nested_dtype``, ``quant_storage``; 8 bits: ``threshold``, ``use_pool``).
        converted: made by ``frozen_weights="nf4"`` from a plain weight (dequantised when bound), else loaded
            so (the bitsandbytes module computes).
        swaps: loaded weights: ``(holder, attribute, original tensor's pinnedness)`` of each tensor that now views
            the block (restored by :func:`release_host`).
    """

    kind: str
    shape: tuple[int, int]
    pieces: dict[str, Piece]
    total_bytes: int
    meta: dict[str, Any]
    converted: bool = False
    swaps: list[tuple[Any, str, str]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Parameters of the logical weight."""
        return self.shape[0] * self.shape[1]


def packed_kind(module: nn.Module, name: str, param: torch.Tensor) -> str | None:
    """``"4bit"`` or ``"int8"`` when ``param`` is the frozen, quantised ``weight`` of a bitsandbytes
    ``Linear4bit`` / ``Linear8bitLt`` (``module``), else ``None``.

    Raises:
        ValueError: a ``Params4bit`` already repacked by bitsandbytes for CPU inference (its AVX512 layout).
    """
    bnb = _bnb()
    if bnb is None or name != "weight" or param.requires_grad:
        return None
    if isinstance(param, bnb.nn.Params4bit) and param.bnb_quantized and param.quant_state is not None:
        if getattr(param.quant_state, "packing_format_for_cpu", False):
            raise ValueError(
                f"RoundPipe cannot stream the 4-bit `{type(module).__name__}` weight of shape {tuple(param.quant_state.shape)}:"
                " bitsandbytes repacked it for CPU inference (an `eval()` forward on the host). HINT: load the model"
                " again, or run it in `train()` mode on the host before `fit`.")
        return "4bit"
    if isinstance(param, bnb.nn.Int8Params) and param.dtype == torch.int8 and _int8_scales(module, param) is not None:
        return "int8"
    return None


def _int8_scales(module: nn.Module, param: torch.Tensor) -> torch.Tensor | None:
    scales = getattr(param, "SCB", None)
    state = getattr(module, "state", None)
    return scales if scales is not None else getattr(state, "SCB", None)


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Piece], int]:
    pieces, total = {}, 0
    for name, tensor in tensors.items():
        pieces[name] = Piece(total, tensor.dtype, tuple(tensor.shape))
        total += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    return pieces, max(total, _ALIGN)


def _fill(tensors: dict[str, torch.Tensor], pin: bool) -> tuple[torch.Tensor, dict[str, Piece], int]:
    pieces, total = _layout(tensors)
    block = pinned_bytes(total, pin=pin)
    block.zero_()
    views = split(block, pieces)
    with torch.no_grad():
        for name, tensor in tensors.items():
            views[name].copy_(tensor.detach())
    return block, pieces, total


def split(block: torch.Tensor, pieces: dict[str, Piece]) -> dict[str, torch.Tensor]:
    """The typed views of a packed weight's ``uint8`` ``block`` (host, or a device buffer's slice), by piece name."""
    return {name: block[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape) for name, p in pieces.items()}


def _quant_state_tensors(state: Any) -> dict[str, torch.Tensor]:
    out = {"absmax": state.absmax, "code": state.code}
    if state.nested:
        out.update(offset=state.offset.reshape(()).to(torch.float32), absmax2=state.state2.absmax,
                   code2=state.state2.code)
    return out


def _quant_meta(state: Any, quant_storage: torch.dtype) -> dict[str, Any]:
    meta = {"blocksize": state.blocksize, "quant_type": state.quant_type, "dtype": state.dtype,
            "quant_storage": quant_storage}
    if state.nested:
        meta.update(nested_blocksize=state.state2.blocksize, nested_dtype=state.state2.dtype)
    return meta


def hold_loaded(module: nn.Module, param: torch.Tensor, kind: str, pin: bool) -> tuple[torch.Tensor, PackedWeight]:
    """Copy a loaded bitsandbytes weight (``kind`` from :func:`packed_kind`) and its quantisation state into one
    host block (pinned when ``pin``) and point the module's tensors at it (same objects, same values: the
    original storages are freed unless referenced elsewhere). Returns the block and its :class:`PackedWeight`."""
    if kind == "4bit":
        state = param.quant_state
        tensors = {"data": param.data, **_quant_state_tensors(state)}
        meta = _quant_meta(state, param.quant_storage)
        shape = tuple(int(s) for s in state.shape)
        holders = {"data": [(param, "data")], "absmax": [(state, "absmax")], "code": [(state, "code")]}
        if state.nested:
            holders.update(offset=[], absmax2=[(state.state2, "absmax")], code2=[(state.state2, "code")])
    else:
        lt_state = getattr(module, "state", None)
        scales = _int8_scales(module, param)
        tensors = {"data": param.data, "SCB": scales}
        meta = {"threshold": float(getattr(lt_state, "threshold", 0.0)), "use_pool": bool(getattr(lt_state, "use_pool", False))}
        shape = tuple(int(s) for s in param.shape)
        holders = {"data": [(param, "data")], "SCB": []}
        for holder in (param, lt_state):
            if holder is not None and getattr(holder, "SCB", None) is scales:
                holders["SCB"].append((holder, "SCB"))
        if lt_state is not None and getattr(lt_state, "CB", None) is not None:
            holders["data"].append((lt_state, "CB"))
    block, pieces, total = _fill(tensors, pin)
    packed = PackedWeight(kind, shape, pieces, total, meta)
    views = split(block, pieces)
    for name, where in holders.items():
        for holder, attribute in where:
            setattr(holder, attribute, views[name])
            packed.swaps.append((holder, attribute, name))
    return block, packed


def release_host(block: torch.Tensor, packed: PackedWeight) -> None:
    """At the end of the run: the loaded weight's tensors leave the (pinned) block for their own ordinary
    memory, same values (a no-op where the block is not pinned: the views keep it)."""
    if not is_pinned(block):
        return
    copies = {name: view.clone() for name, view in split(block, packed.pieces).items()}
    for holder, attribute, name in packed.swaps:
        setattr(holder, attribute, copies[name])
    packed.swaps.clear()


def quantise_nf4(weight: torch.Tensor, pin: bool) -> tuple[torch.Tensor, PackedWeight]:
    """``frozen_weights="nf4"``: quantise the 2-D ``weight`` (``(out, in)``, floating point) with
    ``bitsandbytes.functional.quantize_4bit`` (NF4, blocksize :data:`NF4_BLOCKSIZE`, double quantisation
    :data:`NF4_DOUBLE_QUANT`) into one host block (pinned when ``pin``). Transients: one fp32-sized copy at most
    (bitsandbytes' CPU quantiser reads fp32/bf16/fp16 directly)."""
    bnb = require_bnb('`frozen_weights="nf4"`')
    source = weight.detach().contiguous()
    with torch.no_grad():
        codes, state = bnb.functional.quantize_4bit(source, blocksize=NF4_BLOCKSIZE,
                                                    compress_statistics=NF4_DOUBLE_QUANT, quant_type="nf4")
    block, pieces, total = _fill({"data": codes, **_quant_state_tensors(state)}, pin)
    return block, PackedWeight("4bit", (int(weight.shape[0]), int(weight.shape[1])), pieces, total,
                               _quant_meta(state, torch.uint8), converted=True)


def quant_state(views: dict[str, torch.Tensor], packed: PackedWeight) -> Any:
    """A ``bitsandbytes.functional.QuantState`` of a 4-bit weight made of ``views`` (:func:`split`, on any device)."""
    bnb = require_bnb("4-bit weights")
    meta = packed.meta
    nested = None
    if "absmax2" in views:
        nested = bnb.functional.QuantState(absmax=views["absmax2"], code=views["code2"],
                                           blocksize=meta["nested_blocksize"], dtype=meta["nested_dtype"])
    return bnb.functional.QuantState(absmax=views["absmax"], shape=torch.Size(packed.shape), code=views["code"],
                                     blocksize=meta["blocksize"], quant_type=meta["quant_type"], dtype=meta["dtype"],
                                     offset=views.get("offset"), state2=nested)


def dequantise_nf4(views: dict[str, torch.Tensor], packed: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A converted weight back in ``dtype``: ``bitsandbytes.functional.dequantize_4bit`` of its codes and
    state (``views``, on the device that computes; outside autocast, no autograd history), shape ``packed.shape``."""
    bnb = require_bnb("4-bit weights")
    with torch.no_grad(), torch.autocast(views["data"].device.type, enabled=False):
        out = bnb.functional.dequantize_4bit(views["data"], quant_state(views, packed))
        return out if out.dtype == dtype else out.to(dtype)


def device_weight(views: dict[str, torch.Tensor], packed: PackedWeight) -> tuple[torch.Tensor, Any]:
    """What a replica binds for a loaded weight whose block landed in ``views`` (:func:`split` of the stage's
    device buffer): ``(Params4bit, None)`` with its ``QuantState`` of device views, or ``(Int8Params,
    MatmulLtState)`` whose ``CB``/``SCB`` are the device views (the ``Linear8bitLt``'s ``state`` for this
    residency: bitsandbytes' forward reads and writes the module's state, and its backward keeps it)."""
    bnb = require_bnb("bitsandbytes weights")
    meta = packed.meta
    if packed.kind == "4bit":
        weight = bnb.nn.Params4bit(views["data"], requires_grad=False, quant_state=quant_state(views, packed),
                                   blocksize=meta["blocksize"], compress_statistics="absmax2" in views,
                                   quant_type=meta["quant_type"], quant_storage=meta["quant_storage"],
                                   bnb_quantized=True)
        return weight, None
    weight = bnb.nn.Int8Params(views["data"], requires_grad=False, has_fp16_weights=False, CB=None, SCB=views["SCB"])
    state = bnb.MatmulLtState()
    state.CB, state.SCB = views["data"], views["SCB"]
    state.threshold, state.use_pool, state.has_fp16_weights = meta["threshold"], meta["use_pool"], False
    return weight, state


def working_dtype(module: nn.Module, compute_dtype: torch.dtype | None, master_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the dequantised working copy bitsandbytes makes of a loaded weight on the device (the
    module's ``compute_dtype``, else the stage's compute dtype, else fp32): for the memory model."""
    dtype = getattr(module, "compute_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return compute_dtype if compute_dtype is not None else torch.float32
