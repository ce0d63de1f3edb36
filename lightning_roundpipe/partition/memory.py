"""One memory model: the per-device peak bytes the runtime allocates for a plan (issue 30, DESIGN.md section 4).

What a device holds while it runs a step, as the runtime allocates it
(:mod:`lightning_roundpipe.runtime.backends.pool`, :mod:`lightning_roundpipe.runtime.execution.transfers`):

- **pools, per bank**: ``slots`` stage weight slots, each the size of the largest stage the device may
  hold (its packed upload: every tensor aligned to 64 bytes); as many fp32 gradient accumulators, each
  the size of the largest backward stage's weights that train in a dtype narrower than fp32; the
  transfer slots the program's uploads land in (stage inputs, incoming gradients:
  :func:`~lightning_roundpipe.schedule.buffers.device_slots`). The overlapped modes
  (``accumulate_grad_batches > 1`` in sync mode, ``optimizer="async"``) hold a **second bank** of all
  three, so ``banks = 2``;
- **the working set of the stage computing** (the largest over the stages the device may run,
  :func:`_working_bytes`): a forward stage's largest layer input and output; a backward stage's
  gradients, its largest layer input and output, the larger of its recompute's saved activations and one
  layer's fresh weight gradient (added into the accumulated one while it is alive); the fused tail's
  logits chunks are in its saved bytes; the outputs of one dispatch's microbatches **held for their
  download** (a ``D2H`` on its own stream: a forward stage's output and the boundaries it saves for the
  backward stages, a backward stage's outgoing gradient); with ``frozen_weights="fp8"``, the stage's
  **dequantised copies** (the compute dtype, freed after the stage's last compute op) plus the fp32
  transient of the largest one; with bitsandbytes weights (nf4, int8: ``frozen_weights="nf4"`` or a model
  loaded in 4 or 8 bits), the compute-dtype copy of the largest weight, which each matmul dequantises and
  frees; under mixed precision, autocast's casts of fp32 matmul weights;
- **the previous stage's gradients**: the stage the device computed just before a backward stage
  leaves its fp32 ``.grad`` tensors on the device until its ``WD2H`` and ``DROP`` (the ``d2h`` stream),
  which the program does not order before the next stage's compute.

So, for a device ``d``::

    peak(d) = banks * (slots * max_k weights(k) + slots * max_k accumulator(k) + transfers)
              + max_k (working(k) + held_grads(previous(k)) + dequantised(k) + casts(k)) + max_k dequant_transient(k)

over the stages ``k`` that ``d`` may run (every stage: a rotated plan moves stages between devices; the
weighted dispatch on devices of unequal memory keeps some off a device). The CPU virtual devices' memory
ledger (:class:`~lightning_roundpipe.runtime.backends.budget.DeviceMemoryLedger`) is the oracle this model
is checked against (``docs/partitioner.md``, "The memory model against the ledger").

Pure: no torch, no device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from lightning_roundpipe.partition.frozen import FrozenLayerBytes
from lightning_roundpipe.partition.partitioner import stage_memory
from lightning_roundpipe.partition.profile import LayerProfile

#: byte alignment of every tensor packed into a pooled buffer (the runtime's ``PACK_ALIGN``)
PACK_ALIGN = 64


@dataclass(frozen=True, kw_only=True)
class StageBytes:
    """What one stage adds to a device beyond :func:`stage_memory` (bytes; the runtime measures them from
    its weight store, the planner from a model's shape).

    Attributes:
        weight_bytes: the stage's packed upload: one stage weight slot (``None``: the sum of its layers'
            ``param_bytes``).
        accumulator_bytes: its fp32 gradient accumulator slot (trainable weights narrower than fp32;
            backward stages only).
        dequantised_bytes: its fp8 weights' dequantised copies in the compute dtype.
        dequant_transient_bytes: the fp32 transient of its largest fp8 weight's dequantisation; for
            bitsandbytes weights (nf4, int8), the compute-dtype copy of its largest weight that a matmul
            dequantises and frees.
        cast_bytes: compute-dtype casts autocast makes of its fp32 matmul weights (a tied embedding as
            the LM head under mixed precision), held while one of its ops runs.
        held_grad_bytes: the weight gradients autograd leaves on the device until the stage's ``DROP``
            (the ``.grad`` of weights trained in fp32: no accumulator slot holds them; ``None``: the sum
            of its layers' ``grad_bytes`` for a backward or fused stage).
    """

    weight_bytes: int | None = None
    accumulator_bytes: int = 0
    dequantised_bytes: int = 0
    dequant_transient_bytes: int = 0
    cast_bytes: int = 0
    held_grad_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class DevicePeak:
    """The modelled peak of one device, bytes, and what sets it.

    Attributes:
        device_index: the device.
        peak_bytes: pools plus the largest working set.
        pool_bytes: ``banks x`` (stage weight slots + accumulators + transfer slots).
        working_bytes: the largest working set (:attr:`stage_index`'s).
        stage_index: the stage whose working set is the largest (``None``: the device runs none).
        parts: ``name -> bytes`` of the sum (``stage weights``, ``accumulators``, ``transfers``, ``working
            set``, ``dequantised``), for messages and tables.
        pool_stage_index: the largest stage the device's slots hold (it sizes them).
        slots: stage weight slots per bank; slot_bytes: bytes of each.
    """

    device_index: int
    peak_bytes: int
    pool_bytes: int
    working_bytes: int
    stage_index: int | None
    parts: dict[str, int] = field(default_factory=dict)
    pool_stage_index: int | None = None
    slots: int = 0
    slot_bytes: int = 0


def overlap_banks(optimizer: str = "sync", accumulate_grad_batches: int = 1, overlap_batches: bool = True) -> int:
    """Pool banks the runtime holds: 2 in the overlapped modes (``optimizer="async"``, or sync with
    ``accumulate_grad_batches > 1``, both with ``overlap_batches``), else 1."""
    return 2 if overlap_batches and (optimizer == "async" or accumulate_grad_batches > 1) else 1


def device_peaks(
    profiles: Sequence[LayerProfile],
    stages: Sequence[tuple[str, range]],
    num_devices: int,
    *,
    saved_activation_bytes: Sequence[int] | None = None,
    stage_bytes: Sequence[StageBytes] | None = None,
    transfer_bytes: int = 0,
    banks: int = 1,
    slots: int | None = None,
    stage_devices: Sequence[Sequence[int]] | None = None,
    pool_devices: Sequence[Sequence[int]] | None = None,
    previous: Sequence[dict[int, int | None]] | None = None,
    held_outputs: int = 2,
) -> list[DevicePeak]:
    """Per device, the modelled peak bytes of one step (the formula in the module docstring).

    Args:
        profiles: the layer sequence (``param_bytes``, ``grad_bytes``, ``activation_bytes``).
        stages: ``(kind, layers)`` of every stage in round-robin order, kind ``forward``, ``fused`` or ``backward``.
        num_devices: devices of the round robin.
        saved_activation_bytes: per layer, bytes autograd keeps during recomputation (``None``: ``activation_bytes``).
        stage_bytes: per stage, its pool and dequantisation figures (``None``: weights = sum of ``param_bytes``).
        transfer_bytes: one bank's transfer slots on a device, bytes.
        banks: pool banks (:func:`overlap_banks`).
        slots: stage weight slots per bank (``None``: 2, or 1 when no device runs more than one stage).
        stage_devices: per stage, the devices that run it (``None``: every device): their working sets.
        pool_devices: per stage, the devices whose pool slots are sized to hold it (``None``: every
            device, as the runtime does unless the weighted dispatch keeps stages off small devices).
        previous: per device, ``stage_index -> the stage the device computes just before it`` (``None``
            for its first; ``None`` altogether: the round robin's, stage ``k - num_devices``): that
            stage's held gradients (:attr:`StageBytes.held_grad_bytes`) may still be on the device while
            ``stage_index`` computes (their ``WD2H`` and ``DROP`` run on the ``d2h`` stream, which the
            program does not order before the next stage's compute).
        held_outputs: microbatches whose outputs a stage may hold for their download (``D2H`` runs on
            its own stream, which the program does not order before the stage's next compute op): the
            microbatches of one dispatch.

    Raises:
        ValueError: ``num_devices < 1``, ``banks`` not 1 or 2, an unknown stage kind, or ``stage_bytes``
            of another length than ``stages``.
    """
    if num_devices < 1:
        raise ValueError(f"`num_devices` must be >= 1, got {num_devices}.")
    if banks not in (1, 2):
        raise ValueError(f"`banks` must be 1 or 2, got {banks!r}. HINT: `overlap_banks(...)` gives it for a run's mode.")
    if stage_bytes is not None and len(stage_bytes) != len(stages):
        raise ValueError(f"`stage_bytes` has {len(stage_bytes)} entries for {len(stages)} stages.")
    extras = list(stage_bytes) if stage_bytes is not None else [StageBytes() for _ in stages]
    kept = {layers.start for kind, layers in stages if kind == "backward"}  # boundaries a training forward saves
    weights, accumulators, working, transients, held_grads = [], [], [], [], []
    for (kind, layers), extra in zip(stages, extras):
        if kind not in ("forward", "fused", "backward"):
            raise ValueError(f"Stage kind must be 'forward', 'fused' or 'backward', got {kind!r}.")
        params = sum(profiles[i].param_bytes for i in layers)
        weights.append(params if extra.weight_bytes is None else extra.weight_bytes)
        accumulators.append(extra.accumulator_bytes if kind != "forward" else 0)
        working.append(_working_bytes(profiles, layers, kind, saved_activation_bytes, kept, held_outputs)
                       + extra.dequantised_bytes + extra.cast_bytes)
        transients.append(extra.dequant_transient_bytes)
        grads = sum(profiles[i].grad_bytes for i in layers) if extra.held_grad_bytes is None else extra.held_grad_bytes
        held_grads.append(grads if kind != "forward" else 0)
    if slots is None:
        slots = 2 if len(stages) > num_devices else 1  # a device that runs one stage never prefetches
    out = []
    for device_index in range(num_devices):
        mine = [k for k in range(len(stages)) if stage_devices is None or device_index in stage_devices[k]]
        if not mine:
            out.append(DevicePeak(device_index=device_index, peak_bytes=0, pool_bytes=0, working_bytes=0, stage_index=None))
            continue
        held = [k for k in range(len(stages)) if pool_devices is None or device_index in pool_devices[k]] or mine
        sizing = max(held, key=lambda k: weights[k])
        weight_pool = slots * weights[sizing]
        accumulator_pool = slots * max(accumulators[k] for k in held)
        pool = banks * (weight_pool + accumulator_pool + transfer_bytes)
        before = previous[device_index] if previous is not None else {
            k: k - num_devices if k >= num_devices else None for k in mine}
        # the gradients of the stage computed before it, downloaded and dropped on the d2h stream meanwhile
        pending = {k: held_grads[before[k]] if before.get(k) is not None else 0 for k in mine}
        largest = max(mine, key=lambda k: working[k] + pending[k])
        # one fp32 transient of a dequantisation (the copies themselves are freed after the stage's last
        # compute op, so a device holds one stage's)
        transient = max(transients[k] for k in mine)
        parts = {"stage weights": banks * weight_pool, "accumulators": banks * accumulator_pool,
                 "transfers": banks * transfer_bytes, "working set": working[largest] - extras[largest].dequantised_bytes,
                 "previous stage's gradients": pending[largest],
                 "dequantised": extras[largest].dequantised_bytes + transient}
        work = working[largest] + pending[largest] + transient
        out.append(DevicePeak(device_index=device_index, peak_bytes=pool + work, pool_bytes=pool,
                              working_bytes=work, stage_index=largest, parts=parts,
                              pool_stage_index=sizing, slots=slots, slot_bytes=weights[sizing]))
    return out


def _working_bytes(profiles: Sequence[LayerProfile], layers: range, kind: str,
                   saved_activation_bytes: Sequence[int] | None, kept: set[int], held_outputs: int) -> int:
    """One stage's working set beside its weights, bytes. A forward stage:
    :func:`~lightning_roundpipe.partition.partitioner.stage_memory` less its weights (the largest layer's
    input and output), and, for ``held_outputs`` microbatches, what it downloads (its output and the
    boundaries inside it that backward stages start at, ``kept``). A backward or fused stage: its
    gradients, the largest layer's input and output (the recomputed output, then the gradient it sends
    down, beside the gradient uploaded), the larger of the recompute's saved activations and one layer's
    fresh weight gradient (autograd adds it into the accumulated one while the layer's input and output
    gradients are alive), and ``held_outputs`` microbatches' outgoing gradients held for their download."""
    params = sum(profiles[i].param_bytes for i in layers)
    act = [p.activation_bytes for p in profiles]
    if kind == "forward":
        out = (act[layers.stop] if layers.stop < len(act) else 0) + sum(act[i] for i in kept if layers.start < i < layers.stop)
        return stage_memory(profiles, layers, kind, saved_activation_bytes) - params + held_outputs * out
    saved = [saved_activation_bytes[i] if saved_activation_bytes is not None else act[i] for i in layers]
    io = max(act[i] + (act[i + 1] if i + 1 < len(act) else 0) for i in layers)
    grads = [profiles[i].grad_bytes for i in layers]
    return sum(grads) + io + max(sum(saved), max(grads)) + held_outputs * act[layers.start]


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`PACK_ALIGN` (one tensor's room in a packed buffer)."""
    return -(-int(nbytes) // PACK_ALIGN) * PACK_ALIGN


def planner_stage_bytes(profiles: Sequence[LayerProfile], stages: Sequence[tuple[str, range]],
                        compute_dtype_bytes: int, frozen: Sequence[FrozenLayerBytes] = ()) -> list[StageBytes]:
    """:class:`StageBytes` for a plan made without a run: each backward stage's (and the fused tail's)
    fp32 gradient accumulator, its trainable bytes in fp32 when the compute dtype is narrower
    (``compute_dtype_bytes < 4``: mixed precision uploads half-precision weights and accumulates in fp32);
    with ``frozen`` (per layer, :attr:`~lightning_roundpipe.partition.costmodel.ModelledProfiles.frozen_layer_bytes`),
    the dequantised copies of a stage's converted frozen weights (fp8: held while it computes) and the
    largest transient (fp8's fp32 one; bitsandbytes' compute-dtype copy of one weight inside a matmul)."""
    if compute_dtype_bytes < 1:
        raise ValueError(f"`compute_dtype_bytes` must be >= 1, got {compute_dtype_bytes!r}.")
    out = []
    for kind, layers in stages:
        trainable = sum(profiles[i].grad_bytes for i in layers)
        accumulate = trainable * 4 // compute_dtype_bytes if kind != "forward" and compute_dtype_bytes < 4 else 0
        held = [frozen[i] for i in layers] if frozen else []
        out.append(StageBytes(accumulator_bytes=accumulate, held_grad_bytes=trainable if not accumulate else 0,
                              dequantised_bytes=sum(f.dequantised_bytes for f in held),
                              dequant_transient_bytes=max((f.transient_bytes for f in held), default=0)))
    return out
