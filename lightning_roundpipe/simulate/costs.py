"""The simulator's cost model: seconds and bytes of each op of a
:class:`~lightning_roundpipe.schedule.program.StreamProgram`, from :class:`LayerProfile` s and a
:class:`HardwareModel`. The rules (compute from the stage's layers, recompute, fused tail, ZB-H1's
split backward, weight binding, device speeds, dequantisation at a residency's first bind; transfer
bytes and fixed hop costs) are stated in :mod:`~lightning_roundpipe.simulate.engine`'s module docstring,
which times the program with them (RoundPipe paper, arXiv 2604.27085, section 5.4).

Pure Python: no torch, no Lightning, no devices.
"""

from __future__ import annotations

from typing import Sequence

from lightning_roundpipe.partition.profile import HardwareModel, LayerProfile
from lightning_roundpipe.schedule.program import Op, OpKind, StreamProgram

__all__ = ["OpCostModel"]

_UPLOADS = (OpKind.H2D, OpKind.GH2D)
ACTIVATIONS = (OpKind.H2D, OpKind.GH2D, OpKind.D2H)
"""The ops that move an activation (or its gradient) between a device and the host."""


class OpCostModel:
    """Durations (s) and bytes of one program's ops (the rules: :mod:`~lightning_roundpipe.simulate.engine`'s
    module docstring, *Compute* and *Transfers*)."""

    def __init__(self, program: StreamProgram, profiles: Sequence[LayerProfile], hardware: HardwareModel | None,
                 comm_s_per_hop: float | None, weight_grad_fraction: float,
                 microbatch_weights: Sequence[float] | None = None) -> None:
        plan = program.plan
        self.hardware, self.comm_s_per_hop, self.weight_grad_fraction = hardware, comm_s_per_hop, weight_grad_fraction
        self.device_speeds = plan._meta.get("device_speeds") or (1.0,) * plan.num_devices
        self.microbatch_weights = None if microbatch_weights is None else [float(w) for w in microbatch_weights]
        self.stages = plan.stages
        self.activation_bytes = [p.activation_bytes for p in profiles]
        self.last_layer = len(profiles) - 1
        self.forward_s = [sum(profiles[i].forward_s for i in spec.layers) for spec in plan.stages]
        # bound baselines (never executed by the runtime) keep the LM head's activations, as Megatron-LM
        # and the paper's artifact do; the runtime never recomputes it either (it sits in the fused tail)
        head = max((spec.layers.stop for spec in plan.stages), default=0) - 1
        bound = bool(plan._meta.get("weight_binding", False))
        self.recompute_s = [sum(profiles[i].forward_s for i in spec.layers if not (bound and i == head))
                            for spec in plan.stages]
        self.backward_s = [sum(profiles[i].backward_s for i in spec.layers) for spec in plan.stages]
        # packed frozen weights dequantised when a residency first binds them (fp8, frozen_weights="nf4"): the
        # first compute op of each run of one stage's ops on a device's compute stream (one residency)
        self.bind_s = [sum(profiles[i].bind_s for i in spec.layers) for spec in plan.stages]
        self.binds: set[Op] = set()
        if any(self.bind_s):
            for per in program.streams:
                previous = None
                for op in per["compute"]:
                    if op.stage_index != previous:
                        self.binds.add(op)
                    previous = op.stage_index
        self.split_stages = {op.stage_index for per in program.streams for op in per["compute"] if op.kind is OpKind.W}
        self.hop_ends: set[Op] = set()
        if comm_s_per_hop is not None:
            for consumer, producers in program.deps.items():
                if consumer.kind in _UPLOADS:
                    for producer in producers:
                        if producer.kind is OpKind.D2H:
                            self.hop_ends.update((consumer, producer))

    def _weight(self, op: Op) -> float:
        """Relative size of ``op``'s microbatch (1.0 without ``microbatch_weights``)."""
        if self.microbatch_weights is None or op.microbatch_index is None:
            return 1.0
        return self.microbatch_weights[op.microbatch_index]

    def compute_s(self, op: Op) -> float:
        bind = self.bind_s[op.stage_index] if op in self.binds else 0.0
        return self._weight(op) * self._compute_s(op) + bind

    def _compute_s(self, op: Op) -> float:
        stage = op.stage_index
        kind = op.kind
        if kind is OpKind.F:
            return self.forward_s[stage]
        if kind is OpKind.R:
            return self.recompute_s[stage]
        if kind is OpKind.X:
            return self.forward_s[stage] + self.backward_s[stage]
        if kind is OpKind.W:
            return self.weight_grad_fraction * self.backward_s[stage]
        share = 1.0 - self.weight_grad_fraction if stage in self.split_stages else 1.0
        return share * self.backward_s[stage]

    def transfer_bytes(self, op: Op) -> int:
        """Bytes ``op`` moves: ``op.nbytes`` when the lowering knows them, else the activation at the
        layer boundary the op crosses."""
        if op.nbytes is not None:
            return int(op.nbytes)
        if op.kind is OpKind.DROP:
            return 0
        layers = self.stages[op.stage_index].layers
        if op.kind is OpKind.H2D:
            boundary = layers.start  # the stage's input (or the saved input it recomputes from)
        elif op.kind is OpKind.GH2D or self.stages[op.stage_index].kind == "forward":
            boundary = layers.stop  # gradient of, or activation at, the stage's output
        else:
            boundary = layers.start  # input gradient of a backward stage
        return int(self._weight(op) * self.activation_bytes[min(boundary, self.last_layer)])

    def fixed_transfer_s(self, op: Op) -> float | None:
        """Seconds of a transfer that does not depend on the link's state, ``None`` when it is
        bytes over the link's rate at its start."""
        if op.kind is OpKind.DROP:
            return 0.0
        if op.kind in ACTIVATIONS:
            if self.comm_s_per_hop is not None:
                return self.comm_s_per_hop / 2.0 if op in self.hop_ends else 0.0
        if self.hardware is None:
            return 0.0
        return None
