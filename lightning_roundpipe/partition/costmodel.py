"""Modelled layer profiles: FLOPs and bytes per layer from a Hugging Face config, no weights allocated.

The layer sequence is the one the adapters build (``adapters/hf_causal_lm.py``): entry 0 is the
*prefix* (token embedding, position ids), entries ``1..N`` are the decoder layers, entry
``N + 1`` is the *tail* (final norm, LM head, loss): ``L = num_hidden_layers + 2`` entries.

Everything is arithmetic on the config (:class:`~lightning_roundpipe.partition.shape.ModelShape`); :func:`meta_param_counts` builds the
model on torch's meta device to check the parameter counts. Times follow a roofline-style sum
(:class:`CostModel`): GEMM FLOPs / (efficiency x device FLOP/s) + attention FLOPs / (efficiency x
FLOP/s) + element-wise bytes / device memory bandwidth. A backward costs about 2x a forward in FLOPs
(input and weight gradients); with LoRA the frozen base needs only the input gradient (1x). The
default efficiencies are fitted to the paper's per-layer timings on an RTX 4090
(``lightning_roundpipe/simulate/data/paper_layer_timings_4090.csv``, fp16 with fp16 accumulation, 330 TFLOP/s peak);
``docs/partitioner.md`` lists how close the model gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from lightning_roundpipe.partition.frozen import (
    FrozenFormat,
    FrozenLayerBytes,
    apply_format,
    check_frozen_format,
    converted_bytes,
)
from lightning_roundpipe.partition.profile import HardwareModel, LayerProfile, SharedWeight

LayerKind = Literal["prefix", "decoder", "tail"]

from lightning_roundpipe.partition.shape import KNOWN_MODEL_TYPES, LoRASpec, ModelShape  # noqa: F401 (also imported from here)


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Modelled work of one entry of the layer sequence for one microbatch (hardware independent)."""

    name: str
    """``prefix``, ``decoder.<i>`` or ``tail``."""
    kind: LayerKind
    """Which part of the layer sequence."""
    param_count: int
    """Weights uploaded for this layer (base plus adapters), elements."""
    trainable_param_count: int
    """Weights that receive gradients, elements."""
    forward_gemm_flops: float
    """Dense matrix-multiply FLOPs of one forward (projections, dense MLP, router, LM head, adapters)."""
    forward_expert_flops: float = 0.0
    """MoE expert FLOPs of one forward (grouped GEMMs, fewer tokens each: lower efficiency)."""
    forward_attention_flops: float = 0.0
    """FLOPs of ``QK^T`` and ``PV`` (causal: half the square, as flash attention skips masked blocks)."""
    backward_gemm_flops: float = 0.0
    """Dense GEMM FLOPs of the backward without recomputation (2x forward; 1x for a frozen base)."""
    backward_expert_flops: float = 0.0
    """Expert GEMM FLOPs of the backward."""
    backward_attention_flops: float = 0.0
    """Attention backward FLOPs (2.5x forward: five matmuls against two)."""
    forward_elementwise_bytes: float = 0.0
    """Memory traffic of the eager element-wise ops of one forward (norms, rotary, residual, SwiGLU), bytes."""
    forward_fused_bytes: float = 0.0
    """Memory traffic of fused kernels of one forward (the compiled loss), bytes."""
    backward_has_work: bool = True
    """False when nothing needs a gradient through this layer (LoRA prefix: frozen embedding of token ids)."""
    activation_bytes: int
    """Bytes of the layer's input for one microbatch (what crosses a stage boundary)."""
    saved_activation_bytes: int
    """Bytes autograd keeps inside the layer for one microbatch while a backward stage recomputes and
    back-propagates it (for the tail: also one chunk of logits and their gradient, see ``CostModel.loss_chunk_bytes``)."""
    frozen_matmul_shapes: tuple[tuple[int, int, int], ...] = ()
    """With LoRA, the frozen matmul weights a ``frozen_weights`` format converts, ``(count, rows, cols)`` each
    (``nn.Linear`` weights ``(out_features, in_features)``: the attention and dense MLP projections, an untied
    LM head); empty for full fine-tuning (nothing frozen)."""
    frozen_expert_shapes: tuple[tuple[int, int, int], ...] = ()
    """With LoRA, the fused 3-D expert weights of a MoE layer, ``(experts, rows, cols)`` each (frozen, but
    not converted by the runtime: see :class:`~lightning_roundpipe.partition.frozen.FrozenFormat`)."""

    @property
    def forward_flops(self) -> float:
        """All FLOPs of one forward."""
        return self.forward_gemm_flops + self.forward_expert_flops + self.forward_attention_flops

    @property
    def backward_flops(self) -> float:
        """All FLOPs of one backward, without recomputation."""
        return self.backward_gemm_flops + self.backward_expert_flops + self.backward_attention_flops


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Turns FLOPs and bytes into seconds on a :class:`HardwareModel` (efficiencies are fractions of
    ``hardware.flops_per_s``).

    Defaults fitted to the paper's RTX 4090 per-layer timings with ``flops_per_s = 330e12`` (fp16 with
    fp16 accumulation, what the paper ran); with a bf16 peak of 165e12 the same efficiencies give
    about 2x longer layers.
    """

    gemm_efficiency: float = 0.75
    """Achieved share of peak FLOP/s for large dense GEMMs."""
    attention_efficiency: float = 0.4
    """Achieved share of peak FLOP/s for flash attention."""
    expert_gemm_efficiency: float = 0.3
    """Achieved share of peak FLOP/s for MoE expert GEMMs (about ``T * k / E`` tokens each, plus routing)."""
    device_memory_bytes_per_s: float = 1.0e12
    """Device memory (HBM/GDDR) bandwidth, bytes/s (RTX 4090: 1008 GB/s)."""
    elementwise_traffic_factor: float = 3.0
    """Multiplier on the counted element-wise traffic: eager PyTorch makes several passes per op
    (fp32 upcasts in RMSNorm, separate kernels for rotary and SwiGLU)."""
    loss_bytes_per_logit: int | None = None
    """Device bytes the fused tail holds per logit of a chunk at its peak. ``None`` (default): the
    runtime's chunked loss (:class:`lightning_roundpipe.adapters.chunked_loss.ChunkCrossEntropy`):
    the fp32 logits it saves and their fp32 gradient, 8 bytes, plus the compute-dtype logits'
    gradient when the compute dtype is narrower (``8 + dtype bytes``). A compiled cross-entropy
    that keeps no fp32 copy holds about 4; the eager Hugging Face loss about 16."""
    loss_chunk_bytes: int | None = 256 * 2**20
    """The fused tail computes the logits and the loss chunk by chunk over tokens, at most this many bytes
    of compute-dtype logits per chunk (the runtime's chunked loss,
    :mod:`lightning_roundpipe.adapters.chunked_loss`): the tail holds ``min(tokens, chunk tokens) * vocab
    * bytes_per_logit`` bytes for the loss, chunk tokens ``= loss_chunk_bytes // (vocab * dtype bytes)``.
    ``None``: unchunked (the whole microbatch's logits)."""
    causal_attention: bool = True
    """Count half of the ``s x s`` attention square (causal mask, skipped blocks)."""

    def __post_init__(self) -> None:
        for name in ("gemm_efficiency", "attention_efficiency", "expert_gemm_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"`CostModel.{name}` must be in (0, 1], got {v!r}.")
        if self.loss_bytes_per_logit is not None and (not isinstance(self.loss_bytes_per_logit, int)
                                                      or self.loss_bytes_per_logit < 1):
            raise ValueError(f"`CostModel.loss_bytes_per_logit` must be a positive int or None, got {self.loss_bytes_per_logit!r}.")
        if self.loss_chunk_bytes is not None and (not isinstance(self.loss_chunk_bytes, int) or self.loss_chunk_bytes < 1):
            raise ValueError(f"`CostModel.loss_chunk_bytes` must be a positive int or None, got {self.loss_chunk_bytes!r}.")
        if self.device_memory_bytes_per_s <= 0 or self.elementwise_traffic_factor < 0:
            raise ValueError("`CostModel.device_memory_bytes_per_s` must be > 0 and `elementwise_traffic_factor` >= 0.")

    def bytes_per_logit(self, compute_dtype_bytes: int) -> int:
        """Bytes per logit of the tail's loss chunk (``loss_bytes_per_logit``, or the runtime's figure)."""
        if self.loss_bytes_per_logit is not None:
            return self.loss_bytes_per_logit
        return 8 + (compute_dtype_bytes if compute_dtype_bytes < 4 else 0)

    def loss_chunk_tokens(self, vocab_size: int, compute_dtype_bytes: int) -> int:
        """Tokens per chunk of the chunked loss: ``loss_chunk_bytes // (vocab_size * compute_dtype_bytes)``
        (at least 1; the whole microbatch when ``loss_chunk_bytes`` is ``None``: returns 0 then)."""
        if self.loss_chunk_bytes is None:
            return 0
        return max(1, self.loss_chunk_bytes // (vocab_size * compute_dtype_bytes))

    # ------------------------------------------------------------------ FLOPs and bytes
    def layer_costs(
        self,
        shape: ModelShape,
        *,
        seq_len: int,
        microbatch_size: int,
        compute_dtype_bytes: int = 2,
        lora: LoRASpec | None = None,
    ) -> list[LayerCost]:
        """FLOPs and bytes of every entry of the layer sequence for one microbatch.

        Args:
            shape: the model.
            seq_len: tokens per sequence.
            microbatch_size: sequences per microbatch.
            compute_dtype_bytes: bytes of the compute dtype (2 for bf16/fp16, 4 for fp32).
            lora: train only adapters (frozen base) when given.

        Raises:
            ValueError: for a non-positive ``seq_len``, ``microbatch_size`` or ``compute_dtype_bytes``.
        """
        for n, v in (("seq_len", seq_len), ("microbatch_size", microbatch_size), ("compute_dtype_bytes", compute_dtype_bytes)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"`{n}` must be a positive int, got {v!r}.")
        s, b, B = seq_len, microbatch_size, compute_dtype_bytes
        T = s * b
        h, V = shape.hidden_size, shape.vocab_size
        nh, nkv, hd = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
        frozen = lora is not None
        grad_mult = 1.0 if frozen else 2.0  # dgrad only for a frozen base, dgrad + wgrad otherwise

        # -- prefix: embedding gather and rotary tables; no GEMM
        embed = V * h
        prefix = LayerCost(
            name="prefix", kind="prefix", param_count=embed, trainable_param_count=0 if frozen else embed,
            forward_gemm_flops=0.0, forward_elementwise_bytes=float(2 * T * h * B + 2 * T * hd * B),
            backward_has_work=not frozen, activation_bytes=T * 8, saved_activation_bytes=T * h * B + 2 * T * hd * B,
        )
        out = [prefix]

        # -- decoder layers
        proj = {"q_proj": (h, nh * hd), "k_proj": (h, nkv * hd), "v_proj": (h, nkv * hd), "o_proj": (nh * hd, h)}
        attn_params = (sum(i * o for i, o in proj.values()) + (nh + 2 * nkv) * hd * shape.attention_bias
                       + h * shape.attention_output_bias + nh * shape.attention_sinks)
        norm_params = 2 * h + (2 * hd if shape.qk_norm else 0)
        attn_core = 2 * 2 * b * nh * s * s * hd * (0.5 if self.causal_attention else 1.0)
        window = min(shape.sliding_window, s)
        # a sliding-window layer: query p sees min(p + 1, w) keys, about s w - w^2 / 2 in all (s^2 / 2 for w = s)
        sliding_core = 2 * 2 * b * nh * hd * (s * window - window * window / 2)
        for i in range(shape.num_hidden_layers):
            moe = shape.is_moe_layer(i)
            targets = dict(proj)
            layer_attn_core = sliding_core if shape.sliding_layers and shape.sliding_layers[i] else attn_core
            if moe:
                E, k, Im = shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size
                mlp_params = E * h + E * 3 * h * Im  # router + experts
                mlp_params += (E + E * (2 * Im + h)) * shape.expert_bias  # router bias, expert biases
                dense_active = attn_params + E * h
                expert_active = k * 3 * h * Im
                mlp_elems_per_tok = k * (3 * Im + 4 * h) + 2 * E  # SwiGLU per routed copy, gather/scatter, routing
                mlp_saved_per_tok = k * (h + 4 * Im) * B + E * 4
            else:
                I = shape.intermediate_size
                targets.update({"gate_proj": (h, I), "up_proj": (h, I), "down_proj": (I, h)})
                mlp_params = 3 * h * I
                dense_active, expert_active = attn_params + mlp_params, 0
                mlp_elems_per_tok = 3 * I
                mlp_saved_per_tok = (4 + 3) * I * B  # saved: gate, up, act(gate), product; backward working set: 3 gradients of width I
            adapters = 0
            frozen_shapes: tuple[tuple[int, int, int], ...] = ()
            expert_shapes: tuple[tuple[int, int, int], ...] = ()
            if lora is not None:
                adapters = sum(lora.rank * (fi + fo) for name, (fi, fo) in targets.items() if name in lora.target_modules)
                frozen_shapes = tuple((1, fo, fi) for fi, fo in targets.values())  # nn.Linear weights: (out, in)
                if moe:
                    Im = shape.moe_intermediate_size
                    expert_shapes = ((shape.num_experts, 2 * Im, h), (shape.num_experts, h, Im))
            params = attn_params + mlp_params + norm_params + adapters
            elems_per_tok = 10 * h + 4 * (nh + nkv) * hd + 2 * (nh + nkv) * hd + mlp_elems_per_tok
            saved = T * (4 * h + 2 * (nh + 2 * nkv) * hd + nh * hd) * B + T * nh * 4 + T * mlp_saved_per_tok
            out.append(LayerCost(
                name=f"decoder.{i}", kind="decoder", param_count=params,
                trainable_param_count=adapters if frozen else params,
                forward_gemm_flops=2.0 * T * (dense_active + adapters),
                forward_expert_flops=2.0 * T * expert_active,
                forward_attention_flops=layer_attn_core,
                backward_gemm_flops=2.0 * T * (grad_mult * dense_active + 2 * adapters),
                backward_expert_flops=grad_mult * 2.0 * T * expert_active,
                backward_attention_flops=2.5 * layer_attn_core,
                forward_elementwise_bytes=float(T * elems_per_tok * B),
                activation_bytes=T * h * B,
                saved_activation_bytes=int(saved),
                frozen_matmul_shapes=frozen_shapes,
                frozen_expert_shapes=expert_shapes,
            ))

        # -- tail: final norm, LM head, loss (fused kernel over the logits, chunk by chunk over tokens)
        head = V * h
        loss_tokens = T if self.loss_chunk_bytes is None else min(T, self.loss_chunk_tokens(V, B))
        out.append(LayerCost(
            name="tail", kind="tail", param_count=head + h, trainable_param_count=0 if frozen else head + h,
            forward_gemm_flops=2.0 * T * head, backward_gemm_flops=grad_mult * 2.0 * T * head,
            forward_elementwise_bytes=float(4 * T * h * B), forward_fused_bytes=float(T * V * 2 * B),
            activation_bytes=T * h * B, saved_activation_bytes=2 * T * h * B + loss_tokens * V * self.bytes_per_logit(B),
            # an untied frozen LM head is an nn.Linear weight; a tied one is the embedding's (never converted)
            frozen_matmul_shapes=((1, V, h),) if frozen and not shape.tie_word_embeddings else (),
        ))
        return out

    # ------------------------------------------------------------------ seconds
    def forward_s(self, cost: LayerCost, hardware: HardwareModel) -> float:
        """Seconds of one forward of ``cost``'s layer on ``hardware``."""
        F = hardware.flops_per_s
        return (
            cost.forward_gemm_flops / (self.gemm_efficiency * F)
            + cost.forward_expert_flops / (self.expert_gemm_efficiency * F)
            + cost.forward_attention_flops / (self.attention_efficiency * F)
            + (cost.forward_elementwise_bytes * self.elementwise_traffic_factor + cost.forward_fused_bytes)
            / self.device_memory_bytes_per_s
        )

    def backward_s(self, cost: LayerCost, hardware: HardwareModel) -> float:
        """Seconds of one backward of ``cost``'s layer, without recomputation (eager element-wise traffic 2x
        the forward's; a fused loss kernel writes the logits' gradient in one pass, 1x)."""
        if not cost.backward_has_work:
            return 0.0
        F = hardware.flops_per_s
        return (
            cost.backward_gemm_flops / (self.gemm_efficiency * F)
            + cost.backward_expert_flops / (self.expert_gemm_efficiency * F)
            + cost.backward_attention_flops / (self.attention_efficiency * F)
            + (2 * cost.forward_elementwise_bytes * self.elementwise_traffic_factor + cost.forward_fused_bytes)
            / self.device_memory_bytes_per_s
        )

    def profile(self, cost: LayerCost, hardware: HardwareModel, compute_dtype_bytes: int = 2) -> LayerProfile:
        """The :class:`LayerProfile` of one layer (bytes in the compute dtype)."""
        return LayerProfile(
            forward_s=self.forward_s(cost, hardware),
            backward_s=self.backward_s(cost, hardware),
            param_bytes=cost.param_count * compute_dtype_bytes,
            activation_bytes=cost.activation_bytes,
            trainable_param_bytes=cost.trainable_param_count * compute_dtype_bytes,
            name=cost.name,
        )


@dataclass(frozen=True, kw_only=True)
class ModelledProfiles:
    """A model's layer sequence with modelled costs: what ``auto_partition`` and the simulator read."""

    shape: ModelShape
    """The model."""
    costs: tuple[LayerCost, ...]
    """Hardware-independent FLOPs and bytes per layer."""
    profiles: tuple[LayerProfile, ...]
    """Seconds and bytes per layer on the given hardware."""
    seq_len: int
    """Tokens per sequence."""
    microbatch_size: int
    """Sequences per microbatch."""
    lora: LoRASpec | None = None
    """The LoRA setting, ``None`` for full fine-tuning."""
    cost_model: CostModel = field(default_factory=CostModel)
    """The efficiencies used."""
    shared_weights: tuple[SharedWeight, ...] = ()
    """The tied embedding / LM head weight, which the prefix's and the tail's profiles both count
    (pass to ``describe_stages``)."""
    compute_dtype_bytes: int = 2
    """Bytes of the compute dtype the profiles count weights and activations in."""
    frozen: FrozenFormat = field(default_factory=FrozenFormat)
    """How the frozen matmul weights of a LoRA base are held and uploaded (``bf16``: the compute dtype)."""
    frozen_layer_bytes: tuple[FrozenLayerBytes, ...] = ()
    """Per layer, the device bytes of its converted weights' dequantisation (empty: none converted; pass
    to :func:`~lightning_roundpipe.partition.memory.planner_stage_bytes`)."""
    dequant_s: tuple[float, ...] = ()
    """Per layer, seconds of dequantising its converted weights once (empty: none converted): in the
    profiles' ``bind_s`` (once per residency: fp8, ``frozen_weights="nf4"``), or in their ``forward_s`` and
    ``backward_s`` times :meth:`FrozenFormat.dequant_passes <lightning_roundpipe.partition.frozen.FrozenFormat.dequant_passes>`
    (per matmul: a model loaded in 4 or 8 bits)."""

    @property
    def tokens_per_microbatch(self) -> int:
        return self.seq_len * self.microbatch_size

    @property
    def converted_param_count(self) -> int:
        """Frozen parameters held in :attr:`frozen`'s format (0 for ``bf16``), elements."""
        return self.converted_bytes()[0]

    def converted_bytes(self) -> tuple[int, int]:
        """``(parameters, host bytes)`` of the frozen weights held in :attr:`frozen`'s format (``(0, 0)`` for
        ``bf16``); their bytes per parameter are what ``roundpipe/frozen_matmul_host_bytes_per_param(bytes)``
        measures in a run."""
        return converted_bytes(self.costs, self.frozen, self.compute_dtype_bytes)

    @property
    def frozen_expert_param_count(self) -> int:
        """Frozen parameters of fused 3-D MoE expert weights (with LoRA), elements: held in the compute dtype
        in every format unless :attr:`FrozenFormat.experts <lightning_roundpipe.partition.frozen.FrozenFormat.experts>`."""
        return sum(count * rows * cols for c in self.costs for count, rows, cols in c.frozen_expert_shapes)

    def host_weight_bytes(self) -> tuple[int, int]:
        """``(frozen, trainable)`` host bytes of the model's weights as the runtime holds them: the frozen
        parameters in the compute dtype, their converted matmul weights packed (:attr:`frozen`), a tied
        embedding / LM head once; per trainable parameter the paper's 20 bytes under mixed precision
        (compute copy 2, gradient slot 2, fp32 master 4, fp32 gradient 4, Adam's moments 8;
        ``lightning_roundpipe.runtime.host.memory``), 16 with an fp32 compute dtype (no copy, no slot)."""
        B = self.compute_dtype_bytes
        frozen = sum(p.param_bytes - c.trainable_param_count * B for c, p in zip(self.costs, self.profiles))
        trainable = sum(c.trainable_param_count for c in self.costs)
        for shared in self.shared_weights:  # counted in each of its layers' bytes, held once
            if shared.grad_bytes:
                trainable -= (len(shared.layers) - 1) * shared.param_bytes // B
            else:
                frozen -= (len(shared.layers) - 1) * shared.param_bytes
        return frozen, trainable * (20 if B < 4 else 16)

    @property
    def saved_activation_bytes(self) -> tuple[int, ...]:
        """Per layer, bytes autograd keeps inside it in a backward stage (pass to ``auto_partition``)."""
        return tuple(c.saved_activation_bytes for c in self.costs)


def model_profiles(
    model: ModelShape | Mapping[str, Any] | Any,
    hardware: HardwareModel,
    *,
    seq_len: int,
    microbatch_size: int,
    compute_dtype_bytes: int = 2,
    lora: LoRASpec | None = None,
    cost_model: CostModel | None = None,
    frozen_weights: FrozenFormat | str | None = None,
) -> ModelledProfiles:
    """Modelled :class:`LayerProfile` s of a model's layer sequence (``num_hidden_layers + 2`` entries).

    Args:
        model: a :class:`ModelShape`, a ``config.json`` dict or a ``transformers`` config object.
        hardware: device FLOP/s (and link bandwidths, unused here).
        seq_len: tokens per sequence.
        microbatch_size: sequences per microbatch.
        compute_dtype_bytes: 2 for bf16/fp16 weights and activations.
        lora: LoRA (frozen base, adapters train) when given.
        cost_model: efficiencies; the fitted defaults when ``None``.
        frozen_weights: the format of the frozen matmul weights (``"bf16"``, ``"fp8"``, ``"nf4"``, ``"int8"``
            or a :class:`~lightning_roundpipe.partition.frozen.FrozenFormat`; ``None``: ``bf16``, the compute
            dtype): each layer's ``param_bytes`` counts them packed, its ``bind_s`` (fp8, ``frozen_weights="nf4"``:
            once per residency) or its ``forward_s`` / ``backward_s`` (a model loaded in 4 or 8 bits: per matmul)
            the dequantisations (:func:`~lightning_roundpipe.partition.frozen.dequant_seconds` at
            ``cost_model.device_memory_bytes_per_s``), and :attr:`ModelledProfiles.frozen_layer_bytes` the
            device's dequantised copies. Without ``lora`` nothing is frozen and the format changes nothing.

    Raises:
        ValueError: an unknown ``frozen_weights`` (with the valid ones and a HINT).
    """
    shape = model if isinstance(model, ModelShape) else ModelShape.from_config(model)
    cm = cost_model or CostModel()
    fmt = frozen_weights if isinstance(frozen_weights, FrozenFormat) else FrozenFormat(
        name=check_frozen_format("bf16" if frozen_weights is None else frozen_weights, "frozen_weights"))
    costs = cm.layer_costs(shape, seq_len=seq_len, microbatch_size=microbatch_size,
                           compute_dtype_bytes=compute_dtype_bytes, lora=lora)
    profiles = tuple(cm.profile(c, hardware, compute_dtype_bytes) for c in costs)
    profiles, layer_bytes, dequant = apply_format(costs, profiles, fmt, compute_dtype_bytes, cm.device_memory_bytes_per_s)
    shared: tuple[SharedWeight, ...] = ()
    if shape.tie_word_embeddings:
        tied = shape.vocab_size * shape.hidden_size
        trained = costs[0].trainable_param_count >= tied and costs[-1].trainable_param_count >= tied
        shared = (SharedWeight(layers=(0, len(costs) - 1), param_bytes=tied * compute_dtype_bytes,
                               grad_bytes=tied * compute_dtype_bytes if trained else 0),)
    return ModelledProfiles(shape=shape, costs=tuple(costs), profiles=profiles, seq_len=seq_len,
                            microbatch_size=microbatch_size, lora=lora, cost_model=cm, shared_weights=shared,
                            compute_dtype_bytes=compute_dtype_bytes, frozen=fmt, frozen_layer_bytes=layer_bytes,
                            dequant_s=dequant)


def meta_param_counts(config: Any) -> list[int]:
    """Parameter counts per layer-sequence entry, from the real model class built on the meta device.

    No memory is allocated for weights. The tail counts the LM head also when it is tied to the
    embedding (both stages upload it). Used to check :meth:`CostModel.layer_costs`.

    Args:
        config: a ``transformers`` config object or a ``config.json`` dict (with ``model_type``).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, Mapping):
        cfg = dict(config)
        model_type = cfg.pop("model_type")
        for k in ("architectures", "torch_dtype", "_name_or_path"):
            cfg.pop(k, None)
        config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    def n(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    inner = model.model
    counts = [n(inner.embed_tokens)]
    counts += [n(layer) for layer in inner.layers]
    counts.append(n(inner.norm) + model.lm_head.weight.numel())
    return counts


def sum_params(costs: Sequence[LayerCost]) -> int:
    """Total weights of the layer sequence, elements (a tied embedding counted once per use)."""
    return sum(c.param_count for c in costs)
