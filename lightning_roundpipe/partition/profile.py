"""Per-layer costs and the hardware they run on: the partitioner's and the simulator's inputs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """Cost of one layer of the layer sequence for one microbatch.

    Attributes:
        forward_s: one forward of one microbatch, seconds.
        backward_s: its backward, seconds, without recomputation (a backward stage with full
            recomputation costs ``forward_s + backward_s``).
        param_bytes: bytes of the layer's weights in the compute dtype (what one upload moves).
        activation_bytes: bytes of the layer's input for one microbatch (what a stage boundary before
            this layer saves and moves between devices).
        trainable_param_bytes: bytes of the weights that receive gradients (D2H per backward stage);
            defaults to ``param_bytes``; 0 for a frozen layer (LoRA base without adapters).
        name: label for tables and error messages.
    """

    forward_s: float
    backward_s: float
    param_bytes: int
    activation_bytes: int
    trainable_param_bytes: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        for field_name in ("forward_s", "backward_s", "param_bytes", "activation_bytes"):
            v = getattr(self, field_name)
            if v < 0:
                raise ValueError(f"`LayerProfile.{field_name}` must be >= 0, got {v!r} for layer {self.name!r}.")

    @property
    def grad_bytes(self) -> int:
        """Bytes of gradients sent D2H after the layer's backward stage."""
        return self.param_bytes if self.trainable_param_bytes is None else self.trainable_param_bytes

    @property
    def recompute_backward_s(self) -> float:
        """Cost inside a backward stage: recomputation plus backward, seconds."""
        return self.forward_s + self.backward_s


@dataclass(frozen=True, kw_only=True)
class SharedWeight:
    """A weight that several layers of the sequence use (an embedding tied to the LM head).

    Each of those layers' :class:`LayerProfile` counts it, as each layer's stage uploads it; a stage
    that holds several of them uploads (and sends back the gradient of) it once.

    Attributes:
        layers: the layer indices that use the weight (two or more).
        param_bytes: bytes one upload of it moves (as counted in each layer's ``param_bytes``).
        grad_bytes: bytes of its gradient sent D2H (as counted in each layer's ``grad_bytes``; 0 if frozen).
    """

    layers: tuple[int, ...]
    param_bytes: int
    grad_bytes: int = 0

    def excess(self, stage: range) -> int:
        """How many times too often a sum of per-layer figures over ``stage`` counts the weight."""
        return max(0, sum(1 for i in set(self.layers) if i in stage) - 1)


#: Host memory bandwidth assumed for planning without a run, bytes/s: a dual-socket server with 8
#: channels of DDR4-3200 per socket has a theoretical peak of 2 x 8 x 25.6 GB/s = 409.6 GB/s; an
#: optimizer pass streaming over tens of GB across both NUMA nodes sustains about half of it.
#: (The RoundPipe paper does not name its host; this is the class of server an 8x RTX 4090 box is.)
DEFAULT_HOST_MEMORY_BYTES_PER_S = 200e9
#: Bytes of host memory traffic per trainable parameter of one fp32 Adam step as the runtime runs it:
#: read the master, its gradient and both moments (16), write the master and both moments (12),
#: then refresh the compute copy (read the fp32 master 4, write a 16-bit copy 2).
ADAM_HOST_TRAFFIC_BYTES_PER_PARAM = 34
#: Bytes :func:`optimizer_step_bytes` counts per trainable parameter of fp32 Adam: the master and
#: its two moments, ``4 x (1 + 2)``.
ADAM_COUNTED_BYTES_PER_PARAM = 12
#: Default :attr:`HardwareModel.host_optimizer_bytes_per_s`: the counted bytes (master + state)
#: per second that :data:`DEFAULT_HOST_MEMORY_BYTES_PER_S` sustains, ``200e9 x 12 / 34`` (about
#: 70.6 GB/s; an 8B-parameter model's step takes about 1.4 s).
DEFAULT_HOST_OPTIMIZER_BYTES_PER_S = (DEFAULT_HOST_MEMORY_BYTES_PER_S * ADAM_COUNTED_BYTES_PER_PARAM
                                      / ADAM_HOST_TRAFFIC_BYTES_PER_PARAM)


def optimizer_step_bytes(trainable_params: int, master_bytes: int = 4, states: int = 2) -> int:
    """Bytes one optimizer step touches as :attr:`HardwareModel.host_optimizer_bytes_per_s` counts
    them: the trainable master weights and their optimizer state, ``trainable_params x master_bytes
    x (1 + states)`` (fp32 Adam: 12 bytes per parameter).

    Raises:
        ValueError: a negative count or a non-positive ``master_bytes``.
    """
    if trainable_params < 0 or master_bytes < 1 or states < 0:
        raise ValueError(f"`trainable_params` and `states` must be >= 0 and `master_bytes` >= 1, got"
                         f" {trainable_params!r}, {states!r}, {master_bytes!r}.")
    return int(trainable_params) * int(master_bytes) * (1 + int(states))


#: Bytes per trainable parameter that a staleness correction of ``optimizer="async"`` adds to one
#: optimizer step, in the unit :func:`optimizer_step_bytes` counts (fp32 Adam: 12): its measured host
#: time as a share of the ``OPT`` op (clipping + ``AdamW(fused=True)`` + bf16 refresh) times 12, by
#: ``python benchmarks/staleness_cost.py`` (16 M parameters, 1 thread; docs/usage.md, *Sync or async?*).
STALENESS_CORRECTION_BYTES_PER_PARAM = {"weight_prediction": 7.5, "delay_compensation": 10.0,
                                        "gradient_extrapolation": 8.2}


def staleness_correction_bytes(trainable_params: int, correction: str | None) -> int:
    """Bytes (as :func:`optimizer_step_bytes` counts them) the staleness ``correction`` adds to one
    asynchronous optimizer step (:data:`STALENESS_CORRECTION_BYTES_PER_PARAM`; 0 for ``None``).

    Raises:
        ValueError: an unknown ``correction``.
    """
    if correction is None:
        return 0
    if correction not in STALENESS_CORRECTION_BYTES_PER_PARAM:
        raise ValueError(f"`staleness_correction` must be one of {[None, *STALENESS_CORRECTION_BYTES_PER_PARAM]},"
                         f" got {correction!r}. HINT: None for the paper's one-step-stale update.")
    return int(round(int(trainable_params) * STALENESS_CORRECTION_BYTES_PER_PARAM[correction]))


@dataclass(frozen=True, kw_only=True)
class HardwareModel:
    """One device and its link to host memory.

    Attributes:
        flops_per_s: sustained compute throughput of one device, FLOP/s (e.g. 165e12 for a 4090 in bf16).
        h2d_bytes_per_s: host-to-device bandwidth when only uploads run, bytes/s.
        d2h_bytes_per_s: device-to-host bandwidth, bytes/s.
        h2d_duplex_bytes_per_s: host-to-device bandwidth while downloads run at the same time, bytes/s
            (PCIe 4.0 on the paper's servers: 11-16 GB/s); defaults to ``h2d_bytes_per_s``.
        memory_bytes: device memory usable for weights and activations, bytes.
        host_optimizer_bytes_per_s: the host's optimizer rate: bytes of trainable master weights
            and optimizer state (:func:`optimizer_step_bytes`) one optimizer step gets through per
            second, clipping and the compute-copy refresh included; measured by the runtime during
            the profiled steps; ``None``: :data:`DEFAULT_HOST_OPTIMIZER_BYTES_PER_S`.
    """

    flops_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_duplex_bytes_per_s: float | None = None
    memory_bytes: int = 24 * 2**30
    host_optimizer_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        for field_name in ("flops_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s", "memory_bytes"):
            v = getattr(self, field_name)
            if not v > 0:
                raise ValueError(f"`HardwareModel.{field_name}` must be > 0, got {v!r}.")
        rate = self.host_optimizer_bytes_per_s
        if rate is not None and not 0 < rate < float("inf"):
            raise ValueError(f"`HardwareModel.host_optimizer_bytes_per_s` must be a finite number > 0 or None"
                             f" (bytes/s), got {rate!r}.")

    @property
    def optimizer_bytes_per_s(self) -> float:
        """:attr:`host_optimizer_bytes_per_s`, or the documented default."""
        rate = self.host_optimizer_bytes_per_s
        return DEFAULT_HOST_OPTIMIZER_BYTES_PER_S if rate is None else rate

    @property
    def duplex_h2d_bytes_per_s(self) -> float:
        return self.h2d_bytes_per_s if self.h2d_duplex_bytes_per_s is None else self.h2d_duplex_bytes_per_s
