"""Frozen weight formats for plans made without a run (issue 33 item 3): the bytes a frozen matmul weight
takes on the host and on the link in each format, and what dequantising it costs on the device.

The runtime holds the frozen matmul weights of a LoRA base (2-D ``nn.Linear`` weights with
``requires_grad=False``: attention and dense MLP projections, an untied LM head; not norms, biases,
embeddings, routers, or the fused 3-D expert weights of a Hugging Face MoE block) in one of these
formats, uploads them as they are held (packed) and dequantises them on the device:

- ``bf16``: the compute dtype (``compute_dtype_bytes`` per parameter; 2 under ``bf16-mixed``).
- ``fp8`` (``frozen_weights="fp8"``, :mod:`lightning_roundpipe.runtime.host.fp8`): ``float8_e4m3fn``
  codes, padded to 16 bytes, then one fp32 scale per output channel: ``pad16(rows x cols) + 4 x rows``.
  The runtime dequantises a stage's fp8 weights when its layers first bind them in a residency and holds
  the copies (compute dtype) until the stage's last compute op, with one fp32 transient of the largest.
- ``nf4`` (``frozen_weights="nf4"``, or a model loaded with ``BitsAndBytesConfig(load_in_4bit=True)``):
  bitsandbytes' blockwise 4-bit layout (``bitsandbytes.functional.quantize_4bit``, blocksize 64), every
  tensor of which travels with the weight. For ``n = rows x cols`` and ``blocks = ceil(n / 64)``:

  - without double quantisation: packed codes ``ceil(n / 2)`` (uint8, two per byte), one fp32 absmax per
    block ``4 x blocks``, the 16-entry fp32 code table (64): ``0.5625`` bytes per parameter for large ``n``;
  - with double quantisation (``bnb_4bit_use_double_quant=True``, QLoRA's recipe; bitsandbytes'
    ``compress_statistics``): the absmax quantised to uint8 (``blocks``), its fp32 offset (4), a
    second-level fp32 absmax per 256 blocks (``4 x ceil(blocks / 256)``) and the 256-entry fp32 code of
    the second level (1024): ``0.5 + 1/64 + 4/16384 = 0.5159`` bytes per parameter for large ``n``
    (QLoRA, Dettmers et al. 2023, section 3: 4.127 bits per parameter).

  ``fp4`` has the same layout. ``frozen_weights="nf4"`` (NF4, double quantisation) is dequantised as fp8
  is, once per residency with ``dequantize_4bit`` into the compute dtype, the copies held while the stage
  computes. A model *loaded* in 4 bits runs bitsandbytes' ``Linear4bit``, which dequantises the whole weight
  (compute dtype) inside every matmul that uses it, in the forward and again in the backward of each
  microbatch, and frees it after the matmul: a device holds one such copy at a time
  (:attr:`FrozenFormat.loaded`).
- ``int8`` (a model loaded with ``load_in_8bit=True``, bitsandbytes' ``Linear8bitLt``): int8 codes and
  one fp32 scale per output row (``int8_vectorwise_quant``): ``rows x cols + 4 x rows``. Its forward
  multiplies in int8; its backward dequantises the weight (compute dtype) for the input gradient.

``tests/test_frozen_plan.py`` checks these byte counts against the tensors bitsandbytes 0.50.2 makes.
Pure: no torch, no device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from lightning_roundpipe.partition.profile import LayerProfile

#: ``--frozen-weights`` values a plan accepts, in the order the comparison prints them.
FROZEN_FORMATS = ("bf16", "fp8", "nf4", "int8")
#: the formats `roundpipe plan --lora --frozen-weights X` compares side by side (int8 is only for models
#: loaded in 8 bits, so it is planned when asked for, not compared)
COMPARED_FORMATS = ("bf16", "fp8", "nf4")
#: bitsandbytes' 4-bit blocksize (``quantize_4bit``'s default, the one ``Linear4bit`` uses)
NF4_BLOCKSIZE = 64
#: blocks of first-level absmax per second-level block under double quantisation (bitsandbytes' ``quantize_4bit``)
NF4_NESTED_BLOCKSIZE = 256
#: bytes of the 16-entry fp32 code table of nf4/fp4 and of the 256-entry fp32 code of the second level
NF4_CODE_BYTES, NESTED_CODE_BYTES = 16 * 4, 256 * 4
_FP8_ALIGN = 16


def _pad(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


def packed_weight_bytes(fmt: str, rows: int, cols: int, *, compute_dtype_bytes: int = 2,
                        double_quant: bool = True, blocksize: int = NF4_BLOCKSIZE) -> int:
    """Bytes a frozen ``rows x cols`` matmul weight (``rows`` output channels) takes on the host and on the
    link in ``fmt`` (the module docstring's formulas; ``nf4`` and ``fp4`` alike).

    Raises:
        ValueError: an unknown ``fmt`` or a non-positive size.
    """
    if rows < 1 or cols < 1:
        raise ValueError(f"`rows` and `cols` must be >= 1, got {rows} x {cols}.")
    numel = rows * cols
    if fmt == "bf16":
        return numel * compute_dtype_bytes
    if fmt == "fp8":
        return _pad(numel, _FP8_ALIGN) + 4 * rows
    if fmt == "int8":
        return numel + 4 * rows
    if fmt in ("nf4", "fp4"):
        blocks = -(-numel // blocksize)
        codes = -(-numel // 2)
        if not double_quant:
            return codes + 4 * blocks + NF4_CODE_BYTES
        nested = -(-blocks // NF4_NESTED_BLOCKSIZE)
        return codes + blocks + 4 + 4 * nested + NESTED_CODE_BYTES + NF4_CODE_BYTES
    raise ValueError(f"`fmt` must be one of {list(FROZEN_FORMATS) + ['fp4']}, got {fmt!r}.")


@dataclass(frozen=True, kw_only=True)
class FrozenFormat:
    """How a plan holds the frozen matmul weights of a LoRA base (see the module docstring).

    Attributes:
        name: ``bf16`` (the compute dtype), ``fp8``, ``nf4`` or ``int8``.
        double_quant: nf4 with double quantisation (QLoRA's recipe; what ``frozen_weights="nf4"`` makes).
        loaded: nf4 loaded so by transformers (``BitsAndBytesConfig(load_in_4bit=True)``: bitsandbytes'
            ``Linear4bit`` computes, dequantising per matmul) rather than converted by ``frozen_weights="nf4"``
            (dequantised once when a stage binds it, as fp8). ``int8`` is always loaded.
        experts: count the fused 3-D expert weights of MoE layers as converted too. The runtime does not
            convert them (neither ``frozen_weights`` nor transformers' bitsandbytes loading touch a
            parameter that is not an ``nn.Linear`` weight), so plans leave this ``False``; it exists to
            say what converting them would give.
    """

    name: str = "bf16"
    double_quant: bool = True
    loaded: bool = False
    experts: bool = False

    def __post_init__(self) -> None:
        check_frozen_format(self.name)

    @property
    def dequantises(self) -> str:
        """When the device dequantises, as the runtime does: ``""`` (bf16: never); ``"bind"`` (fp8 and
        ``frozen_weights="nf4"``: each weight once when a stage's residency first binds it, to the compute
        dtype, the copies held until the stage's last compute op); ``"matmul"`` (bitsandbytes' modules of a
        model loaded in 4 or 8 bits: one weight inside each matmul, freed after it; nf4 in the forward and
        again in the backward of every microbatch, int8 in the backward)."""
        if self.name == "bf16":
            return ""
        return "matmul" if self.name == "int8" or (self.name == "nf4" and self.loaded) else "bind"

    def weight_bytes(self, rows: int, cols: int, compute_dtype_bytes: int) -> int:
        """:func:`packed_weight_bytes` of one ``rows x cols`` weight in this format."""
        return packed_weight_bytes(self.name, rows, cols, compute_dtype_bytes=compute_dtype_bytes,
                                   double_quant=self.double_quant)

    def dequant_passes(self, backward: bool) -> int:
        """Dequantisations of a weight per microbatch in a forward (``backward=False``; a recompute is one) or
        a backward, for :attr:`dequantises` ``"matmul"``: nf4 1 and 1, int8 0 and 1 (its forward multiplies in
        int8); 0 for the other formats (theirs happen once per residency, :attr:`dequantises`)."""
        if self.dequantises != "matmul":
            return 0
        return 1 if self.name == "nf4" else int(backward)


def check_frozen_format(value: object, flag: str = "--frozen-weights") -> str:
    """``value`` if it names a frozen weight format (:data:`FROZEN_FORMATS`).

    Raises:
        ValueError: any other value, with the valid ones and a HINT (Lightning's style).
    """
    if isinstance(value, str) and value in FROZEN_FORMATS:
        return value
    near = value.strip().lower() if isinstance(value, str) else None
    if near in ("none", "null", "bfloat16", "fp16", "float16", "16"):
        near = "bf16"
    hint = (f"did you mean `{flag} {near}`?" if near in FROZEN_FORMATS else
            "`bf16` keeps the frozen base in the compute dtype, `fp8` holds it in fp8 with per-channel scales, `nf4`"
            " in bitsandbytes' 4-bit NormalFloat (QLoRA), `int8` is a model loaded in 8 bits.")
    raise ValueError(f"`{flag}` must be one of {list(FROZEN_FORMATS)}, got {value!r}. HINT: {hint}")


def dequant_seconds(packed_bytes: int, numel: int, compute_dtype_bytes: int, memory_bytes_per_s: float) -> float:
    """Seconds one dequantisation of a weight of ``numel`` parameters held in ``packed_bytes`` takes on a
    device (``frozen_weights="nf4"`` and fp8: once per residency; a loaded ``Linear4bit``: per matmul). The
    kernel is bound by device memory (bitsandbytes' ``kDequantizeBlockwise`` reads the packed
    codes and absmax and writes the compute dtype, a table lookup and a multiply per element; fp8's is a
    cast and a multiply), so ``(packed_bytes + numel x compute_dtype_bytes) / memory_bytes_per_s``, the
    device's memory bandwidth (:attr:`~lightning_roundpipe.partition.costmodel.CostModel.device_memory_bytes_per_s`:
    an RTX 4090's 1008 GB/s gives about 42 us for a 4096 x 4096 nf4 weight). ``benchmarks/nf4_dequant.py``
    measures the rate of bitsandbytes' CPU backend (what a CPU virtual device runs)."""
    return (packed_bytes + numel * compute_dtype_bytes) / memory_bytes_per_s


@dataclass(frozen=True, kw_only=True)
class FrozenLayerBytes:
    """What one layer's converted frozen weights add on the device beside their packed upload, bytes.

    Attributes:
        dequantised_bytes: copies held while the layer's stage computes (fp8, ``frozen_weights="nf4"``: the
            compute-dtype copies the runtime makes when the layer first binds them, freed after the stage's
            last compute op).
        transient_bytes: the largest copy held for one op (fp8: the fp32 transient of its largest weight's
            dequantisation; nf4 and int8 loaded so: bitsandbytes' compute-dtype copy of its largest weight
            inside a matmul; ``frozen_weights="nf4"`` of a base in the compute dtype: none, bitsandbytes
            dequantises into the copy it keeps).
    """

    dequantised_bytes: int = 0
    transient_bytes: int = 0


def converted_shapes(cost: Any, fmt: FrozenFormat) -> list[tuple[int, int, int]]:
    """``(count, rows, cols)`` of the weights of a layer (a
    :class:`~lightning_roundpipe.partition.costmodel.LayerCost`) held in ``fmt``: its frozen matmul weights,
    and the fused expert weights too with ``fmt.experts`` (each fused tensor as one weight)."""
    experts = [(1, count * rows, cols) for count, rows, cols in cost.frozen_expert_shapes] if fmt.experts else []
    return [*cost.frozen_matmul_shapes, *experts]


def converted_bytes(costs: Sequence[Any], fmt: FrozenFormat, compute_dtype_bytes: int) -> tuple[int, int]:
    """``(parameters, host bytes)`` of the weights of ``costs`` held in ``fmt`` (``(0, 0)`` for ``bf16``)."""
    if fmt.name == "bf16":
        return 0, 0
    shapes = [shape for cost in costs for shape in converted_shapes(cost, fmt)]
    return (sum(count * rows * cols for count, rows, cols in shapes),
            sum(count * fmt.weight_bytes(rows, cols, compute_dtype_bytes) for count, rows, cols in shapes))


def _layer(cost: Any, fmt: FrozenFormat, dtype_bytes: int, memory_bytes_per_s: float
           ) -> tuple[int, int, float, FrozenLayerBytes]:
    """For one layer: its converted parameters (elements), their packed bytes, the seconds of dequantising
    all of them once, and what their dequantisation holds on the device."""
    numel = packed = largest = 0
    seconds = 0.0
    for count, rows, cols in converted_shapes(cost, fmt):
        one = fmt.weight_bytes(rows, cols, dtype_bytes)
        numel += count * rows * cols
        packed += count * one
        seconds += count * dequant_seconds(one, rows * cols, dtype_bytes, memory_bytes_per_s)
        largest = max(largest, rows * cols)
    if fmt.dequantises == "matmul":  # bitsandbytes' modules: one weight's copy inside a matmul
        held = FrozenLayerBytes(transient_bytes=largest * dtype_bytes)
    else:  # the runtime's copies of the stage's weights; fp8 through one fp32 transient, nf4 straight into the copy
        held = FrozenLayerBytes(dequantised_bytes=numel * dtype_bytes,
                                transient_bytes=4 * largest if fmt.name == "fp8" else 0)
    return numel, packed, seconds, held


def apply_format(costs: Sequence[Any], profiles: Sequence[LayerProfile], fmt: FrozenFormat, dtype_bytes: int,
                 memory_bytes_per_s: float) -> tuple[tuple[LayerProfile, ...], tuple[FrozenLayerBytes, ...],
                                                     tuple[float, ...]]:
    """The profiles of ``costs``' layers with their converted weights in ``fmt``: ``param_bytes`` packed,
    the dequantisation seconds in ``bind_s`` (:attr:`FrozenFormat.dequantises` ``"bind"``) or in
    ``forward_s`` / ``backward_s`` (``"matmul"``); per layer the device bytes (:class:`FrozenLayerBytes`)
    and the seconds of one dequantisation of all its converted weights. Unchanged profiles and empty
    tuples when nothing is converted (bf16, or no frozen weights)."""
    if fmt.name == "bf16" or not any(cost.frozen_matmul_shapes for cost in costs):
        return tuple(profiles), (), ()
    layers = [_layer(cost, fmt, dtype_bytes, memory_bytes_per_s) for cost in costs]
    out = tuple(
        LayerProfile(forward_s=p.forward_s + fmt.dequant_passes(False) * seconds,
                     backward_s=p.backward_s + (fmt.dequant_passes(True) * seconds if cost.backward_has_work else 0.0),
                     param_bytes=p.param_bytes - numel * dtype_bytes + packed, activation_bytes=p.activation_bytes,
                     trainable_param_bytes=p.trainable_param_bytes, name=p.name,
                     bind_s=seconds if fmt.dequantises == "bind" else 0.0)
        for cost, p, (numel, packed, seconds, _) in zip(costs, profiles, layers))
    return out, tuple(held for *_, held in layers), tuple(seconds for _, _, seconds, _ in layers)
