"""The planner's longest sequence for a given set of stages and a device memory (issue 10, item 5).

Memory of a device while it runs stage ``k`` (round robin: stage ``k`` runs on device ``k mod D``, and
the device prefetches the weights of its next stage while ``k`` computes). The runtime keeps every
device's stage weights in a pool of two slots, each as large as the largest stage
(:mod:`lightning_roundpipe.runtime.backends.pool`), so:

    peak(k) = stage_memory(k) - param_bytes(k) + slots * max_j param_bytes(j) + transfer_pool

(``slots`` = 2, or 1 when no device runs more than one stage). ``transfer_pool`` (given the number
of microbatches) is the device's pool of upload destinations: the runtime gives every stage input
and incoming gradient of the step's program a slot (:func:`~lightning_roundpipe.schedule.buffers.device_slots`,
reused only where the program orders it), every device the same slots, each as large as the
largest boundary it holds (:func:`transfer_pool_bytes`); the stage's own input is then counted
twice (in ``stage_memory`` too), a small overestimate.

with :func:`~lightning_roundpipe.partition.partitioner.stage_memory` (weights, gradients, saved
activations, stage input and output of one microbatch) for backward stages and the fused tail, and
weights plus the largest layer input and output for forward stages. The longest sequence is the
largest ``seq_len`` for which ``max_k peak(k) <= device_memory_bytes``: memory grows with the
sequence, so a doubling search and a bisection find it (the same search as ``roundpipe plan``'s).

Pure: no torch, no device; the runtime's measured counterpart is
:func:`lightning_roundpipe.runtime.tuning.max_seq.measure_max_seq_len`.
"""

from __future__ import annotations

from typing import Callable, Sequence

from lightning_roundpipe.partition.costmodel import ModelledProfiles
from lightning_roundpipe.partition.memory import StageBytes, device_peaks
from lightning_roundpipe.schedule.buffers import device_slots
from lightning_roundpipe.schedule.lower import lower
from lightning_roundpipe.schedule.plan import StageSpec
from lightning_roundpipe.schedule.roundpipe import build_roundpipe_plan

#: ``(kind, layers)`` of each stage in round-robin order; kind ``forward``, ``fused`` or ``backward``.
Stages = Sequence[tuple[str, range]]


def transfer_pool_bytes(mp: ModelledProfiles, stages: Stages, num_devices: int, num_microbatches: int) -> int:
    """Bytes of one device's activation transfer pool for one step of ``stages`` with
    ``num_microbatches`` (see the module docstring): per slot, the largest boundary put in it (a stage
    input: ``activation_bytes`` of its first layer; an incoming gradient: of the layer after its last).

    Raises:
        ValueError: for an unknown stage kind, or an invalid plan (``num_microbatches < 1``).
    """
    specs = []
    for index, (kind, layers) in enumerate(stages):
        if kind not in ("forward", "fused", "backward"):
            raise ValueError(f"Stage kind must be 'forward', 'fused' or 'backward', got {kind!r}.")
        specs.append(StageSpec(index, "forward" if kind == "forward" else "backward", layers, fused=kind == "fused"))
    program = lower(build_roundpipe_plan(specs, num_devices, num_microbatches), validate=False)
    act = [p.activation_bytes for p in mp.profiles]

    def boundary(layer: int) -> int:
        return act[layer] if layer < len(act) else 0

    sizes: dict[int, int] = {}
    for plan in device_slots(program):
        for (kind, stage_index, _), slot in plan.slots.items():
            layers = program.plan.stages[stage_index].layers
            nbytes = boundary(layers.start if kind == "in" else layers.stop)
            sizes[slot] = max(sizes.get(slot, 0), nbytes)
    return sum(sizes.values())


def peak_device_memory_bytes(mp: ModelledProfiles, stages: Stages, num_devices: int,
                             num_microbatches: int | None = None, *, banks: int = 1,
                             stage_bytes: Sequence[StageBytes] | None = None) -> int:
    """The modelled peak bytes on any device for one step of ``stages``: the one memory model,
    :func:`~lightning_roundpipe.partition.memory.device_peaks` (pools x ``banks``, accumulators and
    dequantised copies from ``stage_bytes``); with ``num_microbatches``, the transfer pool of that
    step's program is included.

    Raises:
        ValueError: for ``num_devices < 1`` or an unknown stage kind.
    """
    if num_devices < 1:
        raise ValueError(f"`num_devices` must be >= 1, got {num_devices}.")
    if not stages:
        return 0
    transfers = transfer_pool_bytes(mp, stages, num_devices, num_microbatches) if num_microbatches is not None else 0
    peaks = device_peaks(mp.profiles, stages, num_devices, saved_activation_bytes=mp.saved_activation_bytes,
                         stage_bytes=stage_bytes, transfer_bytes=transfers, banks=banks)
    return max(p.peak_bytes for p in peaks)


def planned_max_seq_len(modelled: Callable[[int], ModelledProfiles], stages: Stages, num_devices: int,
                        device_memory_bytes: int, *, limit: int = 1 << 20, num_microbatches: int | None = None,
                        frozen: bool = False) -> int:
    """Longest sequence (tokens) whose modelled peak device memory fits ``device_memory_bytes``; 0 if
    not even one token fits; ``limit`` means "at least ``limit``".

    Args:
        modelled: sequence length -> modelled profiles of the layer sequence (microbatch size fixed).
        stages: ``(kind, layers)`` of the step's stages in round-robin order.
        num_devices: devices of the round robin.
        device_memory_bytes: one device's memory, bytes.
        limit: the largest length searched.
        num_microbatches: microbatches per step: the transfer pool is counted (``None``: it is not).
        frozen: count the dequantised copies of the frozen weights of the profiles' format
            (:func:`frozen_stage_bytes`).
    """

    def fits(seq_len: int) -> bool:
        mp = modelled(seq_len)
        return peak_device_memory_bytes(mp, stages, num_devices, num_microbatches,
                                        stage_bytes=frozen_stage_bytes(mp, stages) if frozen else None
                                        ) <= device_memory_bytes

    return largest_fitting(fits, limit)


def frozen_stage_bytes(mp: ModelledProfiles, stages: Stages) -> list[StageBytes] | None:
    """Per stage, the device copies of its converted frozen weights (``mp.frozen``'s format:
    :attr:`~lightning_roundpipe.partition.costmodel.ModelledProfiles.frozen_layer_bytes`), the rest as the
    default :class:`StageBytes`; ``None`` when no weight is converted."""
    if not mp.frozen_layer_bytes:
        return None
    out = []
    for _, layers in stages:
        held = [mp.frozen_layer_bytes[i] for i in layers]
        out.append(StageBytes(dequantised_bytes=sum(f.dequantised_bytes for f in held),
                              dequant_transient_bytes=max((f.transient_bytes for f in held), default=0)))
    return out


def largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """The largest ``n`` in ``1..limit`` with ``fits(n)``, for a ``fits`` that holds up to some length and
    fails beyond it (memory grows with the sequence): doubling, then bisection (``O(log n)`` calls).
    0 when ``fits(1)`` fails; ``limit`` when ``fits(limit)`` holds."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        if lo == limit or fits(limit):
            return limit
        hi = limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
