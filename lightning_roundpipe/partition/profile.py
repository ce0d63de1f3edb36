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
    """

    flops_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_duplex_bytes_per_s: float | None = None
    memory_bytes: int = 24 * 2**30

    def __post_init__(self) -> None:
        for field_name in ("flops_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s", "memory_bytes"):
            v = getattr(self, field_name)
            if not v > 0:
                raise ValueError(f"`HardwareModel.{field_name}` must be > 0, got {v!r}.")

    @property
    def duplex_h2d_bytes_per_s(self) -> float:
        return self.h2d_bytes_per_s if self.h2d_duplex_bytes_per_s is None else self.h2d_duplex_bytes_per_s
