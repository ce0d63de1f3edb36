"""Devices of unequal speed and memory (DESIGN.md section 12): relative speeds, per-device stage
memory, where each stage fits, and the dispatch policy the plan builders take.

RoundPipe's devices are stateless, so a faster device can take more stages and a larger one larger
stages. This module turns per-device figures (measured speeds and memory budgets, or a table of
known GPUs) into a :class:`~lightning_roundpipe.schedule.dispatch.DispatchPolicy`: the stage costs
the weighted rule balances come from the layer profiles (seconds on a device of speed 1), and the
devices a stage may run on from the partitioner's memory model (:func:`stage_memory`, within half
of the device's memory: the next stage is prefetched).

Pure: no torch, no Lightning, no devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from lightning_roundpipe.partition.partitioner import stage_memory
from lightning_roundpipe.partition.profile import LayerProfile
from lightning_roundpipe.schedule.dispatch import DISPATCH_RULES, DispatchPolicy
from lightning_roundpipe.schedule.plan import StageSpec

__all__ = ["KNOWN_GPUS", "GpuSpec", "MixedDevices", "gpu_spec", "relative_speeds", "stage_costs", "stage_devices"]

GiB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's figures for planning.

    Attributes:
        name: the product name.
        bf16_flops_per_s: dense peak of bf16 tensor-core math with fp32 accumulation (what
            mixed-precision training uses), FLOP/s.
        memory_bytes: device memory, bytes.
    """

    name: str
    bf16_flops_per_s: float
    memory_bytes: int


KNOWN_GPUS: dict[str, GpuSpec] = {
    "4090": GpuSpec("RTX 4090", 165.2e12, 24 * GiB),
    "4080": GpuSpec("RTX 4080", 97.5e12, 16 * GiB),
    "3090": GpuSpec("RTX 3090", 71.0e12, 24 * GiB),
    "3080": GpuSpec("RTX 3080", 59.5e12, 10 * GiB),
    "3060": GpuSpec("RTX 3060", 25.5e12, 12 * GiB),
}
"""Consumer GPUs ``roundpipe plan --devices`` knows by name (``4090``, ``rtx4090``, ``RTX 4090``).

Dense bf16 tensor throughput with fp32 accumulation (no 2:4 sparsity) and memory, from NVIDIA's
architecture whitepapers: *NVIDIA Ada GPU Architecture* (2022), appendix table of the GeForce RTX
4090 (165.2 TFLOP/s, 24 GB GDDR6X) and RTX 4080 (97.5 TFLOP/s, 16 GB); *NVIDIA Ampere GA102 GPU
Architecture* (2020), appendix table of the GeForce RTX 3090 (71 TFLOP/s, 24 GB GDDR6X) and RTX 3080
(59.5 TFLOP/s, 10 GB). The RTX 3060 (GA106, 12 GB model) is not in a whitepaper table; its figure is
derived the same way: 28 SMs x 4 third-generation tensor cores x 128 dense FP16 FMA per clock x 2
FLOP x 1.777 GHz boost = 51 TFLOP/s with fp16 accumulation, halved for fp32 accumulation on GeForce
cards as the GA102 table shows for the RTX 3090 (142 vs 71): 25.5 TFLOP/s. The same RTX 4090 and
RTX 3090 figures are :data:`~lightning_roundpipe.runtime.tuning.flops.PEAK_FLOPS`'s."""


def gpu_spec(name: str) -> GpuSpec | None:
    """The :data:`KNOWN_GPUS` entry for ``name`` (case, spaces, ``-``/``_`` and an ``rtx`` prefix
    ignored: ``"4090"``, ``"RTX-4090"``, ``"rtx 4090"``), ``None`` for an unknown name."""
    key = "".join(ch for ch in name.lower() if ch not in " -_")
    key = key[3:] if key.startswith("rtx") else key
    return KNOWN_GPUS.get(key)


def relative_speeds(values: Sequence[float]) -> tuple[float, ...]:
    """``values`` (FLOP/s, or any throughput) over the largest of them: the fastest device 1.0.

    Raises:
        ValueError: an empty ``values`` or one that is not a finite number > 0.
    """
    values = list(values)
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
                             for v in values):
        raise ValueError(f"Device speeds must be finite numbers > 0, got {values!r}.")
    top = max(values)
    return tuple(float(v) / top for v in values)


def stage_costs(profiles: Sequence[LayerProfile], stages: Sequence[StageSpec]) -> tuple[float, ...]:
    """Per stage (by ``stage_index``), compute seconds of one microbatch on a device of speed 1:
    forward stages ``sum(forward_s)``, backward stages and the fused tail ``sum(forward_s +
    backward_s)`` (recompute, or the tail's own forward, plus backward)."""
    out = [0.0] * (max(s.stage_index for s in stages) + 1)
    for spec in stages:
        if spec.kind == "forward":
            out[spec.stage_index] = sum(profiles[i].forward_s for i in spec.layers)
        else:
            out[spec.stage_index] = sum(profiles[i].recompute_backward_s for i in spec.layers)
    return tuple(out)


def stage_devices(profiles: Sequence[LayerProfile], stages: Sequence[StageSpec],
                  stage_budgets: Sequence[int | None], saved_activation_bytes: Sequence[int] | None = None,
                  ) -> tuple[tuple[int, ...], ...]:
    """Per stage (by ``stage_index``), the devices whose per-stage budget holds it
    (:func:`~lightning_roundpipe.partition.partitioner.stage_memory`: weights, gradients and
    activations of one microbatch).

    Args:
        profiles: one :class:`LayerProfile` per layer.
        stages: the plan's stages.
        stage_budgets: per device, bytes one stage may use (half of its memory), ``None``: unlimited.
        saved_activation_bytes: as :func:`~lightning_roundpipe.partition.auto_partition`.

    Raises:
        ValueError: a stage that fits no device, naming it, its bytes and the largest budget.
    """
    out: list[tuple[int, ...]] = [()] * (max(s.stage_index for s in stages) + 1)
    for spec in stages:
        need = stage_memory(profiles, spec.layers, "forward" if spec.kind == "forward" else "backward",
                            saved_activation_bytes)
        fits = tuple(d for d, budget in enumerate(stage_budgets) if budget is None or need <= budget)
        if not fits:
            largest = max(b for b in stage_budgets if b is not None)
            raise ValueError(f"{spec.describe()} needs {need / GiB:.3f} GiB ({need} bytes) for one microbatch, more"
                             f" than any device's per-stage budget (largest {largest / GiB:.3f} GiB, half of its"
                             " memory: the next stage is prefetched). HINT: cut the stages finer, or lower the"
                             " microbatch size or sequence length.")
        out[spec.stage_index] = fits
    return tuple(out)


@dataclass(frozen=True)
class MixedDevices:
    """Devices of unequal speed and memory, for the planner and the automatic choice.

    Attributes:
        speeds: per device, relative compute speed (finite, > 0; the fastest 1.0).
        stage_budgets: per device, bytes one stage may use (half of its memory), ``None`` entries
            unlimited; ``None``: no memory limits.
        saved_activation_bytes: per layer, what autograd keeps inside it in a backward stage (the
            memory model's, :func:`stage_memory`); ``None``: each layer's ``activation_bytes``.

    Raises:
        ValueError: a bad speed or budget, or budgets for another number of devices.
    """

    speeds: tuple[float, ...]
    stage_budgets: tuple[int | None, ...] | None = None
    saved_activation_bytes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speeds", tuple(float(v) for v in self.speeds))
        if self.saved_activation_bytes is not None:
            object.__setattr__(self, "saved_activation_bytes", tuple(int(v) for v in self.saved_activation_bytes))
        DispatchPolicy("round_robin", self.speeds)  # the speeds' checks
        if self.stage_budgets is not None:
            budgets = tuple(self.stage_budgets)
            if len(budgets) != len(self.speeds) or not all(
                    b is None or (isinstance(b, int) and not isinstance(b, bool) and b > 0) for b in budgets):
                raise ValueError(f"`stage_budgets` must hold one positive int (bytes) or None per device"
                                 f" ({len(self.speeds)}), got {self.stage_budgets!r}.")
            object.__setattr__(self, "stage_budgets", budgets)

    @property
    def num_devices(self) -> int:
        return len(self.speeds)

    @property
    def smallest_budget(self) -> int | None:
        """The smallest per-stage budget (what the round robin needs every stage to fit), ``None``: unlimited."""
        known = [b for b in (self.stage_budgets or ()) if b is not None]
        return min(known) if known else None

    @property
    def largest_budget(self) -> int | None:
        """The largest per-stage budget (the weighted rule places a stage on a device that holds it)."""
        budgets = self.stage_budgets or ()
        if not budgets or any(b is None for b in budgets):
            return None
        return max(budgets)

    @property
    def unequal(self) -> bool:
        """Whether the devices differ in speed or memory."""
        return len(set(self.speeds)) > 1 or len(set(self.stage_budgets or ())) > 1

    def policy(self, rule: str, stages: Sequence[StageSpec], profiles: Sequence[LayerProfile]) -> DispatchPolicy:
        """The :class:`~lightning_roundpipe.schedule.dispatch.DispatchPolicy` of ``rule`` for ``stages``:
        the round robin with these speeds; or the weighted rule with each stage's cost from
        ``profiles`` (:func:`stage_costs`) and the devices that hold it (:func:`stage_devices`).

        Raises:
            ValueError: an unknown ``rule``, or a stage that fits no device.
        """
        if rule not in DISPATCH_RULES:
            raise ValueError(f"`rule` must be one of {list(DISPATCH_RULES)}, got {rule!r}.")
        if rule == "round_robin":
            return DispatchPolicy("round_robin", self.speeds)
        allowed = (None if self.stage_budgets is None else
                   stage_devices(profiles, stages, self.stage_budgets, self.saved_activation_bytes))
        if allowed is not None and all(len(a) == self.num_devices for a in allowed):
            allowed = None
        return DispatchPolicy("weighted", self.speeds, stage_costs(profiles, stages), allowed)
