"""The runtime's side of the one memory model (issue 30): its inputs from the weight store and the program,
each device's budget, and the check of every partition before the first step.

:func:`predicted_peaks` fills :func:`~lightning_roundpipe.partition.memory.device_peaks` with what the
runtime will allocate: per stage its packed upload (a stage weight slot), its fp32 accumulator, its fp8
weights' dequantised copies (compute dtype) and fp32 transient, those of its ``frozen_weights="nf4"``
weights, the working copy of its largest weight loaded in 4 or 8 bits that bitsandbytes' matmul
dequantises (:func:`dequantised_bytes`), read from the
:class:`~lightning_roundpipe.runtime.host.store.WeightStore`; the transfer slots of the program's own
slot assignment (:func:`~lightning_roundpipe.schedule.buffers.device_slots`) sized to the stage
boundaries; and, for a Hugging Face causal LM, each layer's activations from the cost model
(:meth:`~lightning_roundpipe.partition.costmodel.CostModel.layer_costs` at the batch's rows and length;
other models: boundaries only). :func:`check_budgets` compares them with each device's budget
(:meth:`~lightning_roundpipe.runtime.backends.base.Backend.device_budget_bytes`: ``device_memory_bytes`` on
CPU virtual devices, measured free memory less a margin on CUDA) and raises
:class:`PlanMemoryError` naming the device, the stage and the bytes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from lightning_roundpipe.partition.memory import DevicePeak, StageBytes, aligned, device_peaks
from lightning_roundpipe.partition.profile import LayerProfile
from lightning_roundpipe.runtime.backends.budget import DeviceMemoryError, _size, pool_slots_text
from lightning_roundpipe.runtime.backends.pool import packed_nbytes
from lightning_roundpipe.runtime.host.grads import needs_fp32_accumulation
from lightning_roundpipe.schedule.buffers import device_slots
from lightning_roundpipe.schedule.lower import plan_dispatches


class PlanMemoryError(DeviceMemoryError):
    """A partition whose modelled peak does not fit a device's budget, raised before the first step
    (an out-of-memory error: ``torch.OutOfMemoryError``, so ``max-seq``'s search treats it as one).

    Attributes (beyond :class:`DeviceMemoryError`'s): ``peak`` (the :class:`DevicePeak`).
    """

    def __init__(self, peak: DevicePeak, budget_bytes: int, stage: str = "", banks: int = 1, pool_stage: str = "",
                 auto_partition: bool = False) -> None:
        self.peak, self.stage, self.banks, self.pool_stage = peak, stage, banks, pool_stage
        self.auto_partition = auto_partition
        self.device_index, self.where = peak.device_index, stage
        self.asked_bytes, self.in_use_bytes, self.budget_bytes = peak.peak_bytes, 0, budget_bytes
        parts = ", ".join(f"{name} {nbytes}" for name, nbytes in peak.parts.items() if nbytes)
        pools = "two pool banks (the overlapped modes), each with" if banks == 2 else "one pool bank with"
        slots = pool_slots_text(peak.slots)
        held = (f"{slots} of the largest stage's weights per bank"
                + (" (the stage computing and the one prefetched)" if peak.slots == 2 else ""))
        smaller = ("" if auto_partition else "`partition='auto'` (its choice keeps to this model), or ")
        torch.OutOfMemoryError.__init__(
            self,
            f"RoundPipe: the partition does not fit device {peak.device_index}: its modelled peak is {peak.peak_bytes}"
            f" bytes ({parts}) against its budget of {budget_bytes} bytes ({_size(peak.peak_bytes)} >"
            f" {_size(budget_bytes)}; `device_memory_bytes={budget_bytes}` on a CPU virtual device, on a GPU its"
            f" measured free memory less a margin); the stage weight pool, reserved before any LOAD: {pools}"
            f" {slots} of {peak.slot_bytes} bytes for the largest stage, {pool_stage}; the largest working"
            f" set is {stage}. HINT: this device holds {held}: make that stage smaller ({smaller}`forward_stages` /"
            " `backward_stages` with fewer layers each; a single layer cannot be split); fewer rows per microbatch"
            " (`num_microbatches`) or shorter sequences shrink the working set; "
            + ("`overlap_batches=False` keeps one pool bank; " if banks == 2 else "")
            + "or raise `device_memory_bytes`. `roundpipe plan` prints the same model.")

    def __reduce__(self):
        return type(self), (self.peak, self.budget_bytes, self.stage, self.banks, self.pool_stage, self.auto_partition)


def _autocast_copies(store: Any, layers: Sequence[torch.nn.Module], autocast_bytes: int | None) -> int:
    """Bytes of the compute-dtype casts autocast makes of the fp32-uploaded matmul weights of ``layers``
    (a tied embedding used as the LM head under mixed precision), held while the stage computes."""
    if not autocast_bytes or autocast_bytes >= 4:
        return 0
    seen, total = set(), 0
    for layer in layers:
        for module in layer.modules():
            weight = getattr(module, "weight", None) if isinstance(module, torch.nn.Linear) else None
            entry = store.tensors.get(id(weight)) if weight is not None else None
            if entry is not None and entry.block is None and entry.dtype == torch.float32 and id(weight) not in seen:
                seen.add(id(weight))
                total += aligned(weight.numel() * autocast_bytes)
    return total


def dequantised_bytes(entry: Any) -> tuple[int, int]:
    """``(held, transient)`` device bytes of one store entry's dequantisation (``(0, 0)`` for a weight uploaded
    as it computes):

    - fp8 (``entry.block`` without ``entry.packed``): its compute-dtype copy, held from the bind to the stage's
      last compute op, through an fp32 transient;
    - ``frozen_weights="nf4"`` (``entry.packed.converted``): its copy in ``entry.dequant_dtype``, held as fp8's;
      bitsandbytes' ``dequantize_4bit`` writes the original dtype (``packed.meta["dtype"]``), so a transient of
      that size when the two differ;
    - a weight loaded in 4 or 8 bits (``entry.packed``, not converted): nothing held; bitsandbytes' matmul
      dequantises it into ``entry.dequant_dtype`` (its working dtype) and frees it after the op (the transient).
    """
    packed = getattr(entry, "packed", None)
    if packed is not None:
        numel = int(packed.shape[0]) * int(packed.shape[1])
        working = aligned(numel * entry.dequant_dtype.itemsize)
        if not packed.converted:
            return 0, working
        original = packed.meta.get("dtype")
        wider = isinstance(original, torch.dtype) and original != entry.dequant_dtype
        return working, aligned(numel * original.itemsize) if wider else 0
    if entry.block is not None:
        numel = entry.master.numel()
        return aligned(numel * entry.dequant_dtype.itemsize), aligned(numel * 4)
    return 0, 0


def stage_bytes(store: Any, stages: Sequence[Any], layers: Sequence[torch.nn.Module] | None = None,
                autocast_bytes: int | None = None) -> list[StageBytes]:
    """Per stage (a :class:`~lightning_roundpipe.schedule.plan.StageSpec`), its pool and dequantisation bytes
    as the runtime allocates them (see the module docstring); with ``layers`` (the sequence's modules) and
    ``autocast_bytes`` (the autocast dtype's size), the autocast casts of fp32 matmul weights; the
    dequantised copies of its packed frozen weights (:func:`dequantised_bytes`)."""
    out = []
    for spec in stages:
        layout = store.layout(spec.layers)
        casts = _autocast_copies(store, [layers[i] for i in spec.layers], autocast_bytes) if layers else 0
        dequantised = transient = 0
        for key in layout.tensors:
            held, passing = dequantised_bytes(store.tensors[key])
            dequantised += held
            transient = max(transient, passing)
        accumulate = store.accumulator_numel(spec.layers) * 4 if spec.kind == "backward" else 0
        held = sum(store.tensors[k].master.numel() * store.tensors[k].dtype.itemsize for k in layout.tensors
                   if store.tensors[k].is_param and store.tensors[k].master.requires_grad
                   and not needs_fp32_accumulation(store.tensors[k].dtype)) if spec.kind == "backward" else 0
        out.append(StageBytes(weight_bytes=layout.total_bytes, accumulator_bytes=accumulate,
                              dequantised_bytes=dequantised, dequant_transient_bytes=transient, cast_bytes=casts,
                              held_grad_bytes=held))
    return out


def traced_activations(seq: Any, sample: Any, autocast_dtype: torch.dtype | None = None
                       ) -> tuple[list[int], list[int], int] | None:
    """A shape-only pass of the layer sequence (``torch``'s fake tensors: no data, no FLOPs) on a
    microbatch like ``sample`` (the carry of layer 0), under autocast when ``autocast_dtype`` is given:
    per layer, the packed bytes of its input carry (what an upload of it moves) and the bytes autograd
    saves inside it (parameters excluded, each storage once), and the packed bytes of the last layer's
    output. ``None`` where a layer cannot run on fake tensors (data-dependent shapes). Cached per
    sequence, shapes and dtype."""
    import copy

    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

    key = (autocast_dtype, _shapes(sample))
    cache = seq.__dict__.setdefault("_roundpipe_traced", {})
    if key in cache:
        return cache[key]
    inputs, saved = [], []
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with FakeCopyMode(mode):  # fake copies: the masters, their hooks and the user's hooks never run
            layers = copy.deepcopy(list(seq.layers))
        with mode:
            carry = pytree.tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu")
                                    if isinstance(t, torch.Tensor) else t, sample)  # fake, like the sample
            for layer in layers:
                for module in layer.modules():
                    for hooks in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
                        getattr(module, hooks).clear()
                    for name, param in module.named_parameters(recurse=False):
                        if param.dtype.itemsize == 1 and param.is_floating_point():  # an fp8 frozen weight: its copy
                            param.data = param.data.to(autocast_dtype or torch.float32)
                params = {t.untyped_storage()._cdata for t in layer.parameters()}
                carry = pytree.tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point())
                                        if isinstance(t, torch.Tensor) else t, carry)
                inputs.append(packed_nbytes(carry))
                kept: dict[int, int] = {}

                def pack_hook(t: torch.Tensor) -> torch.Tensor:
                    storage = t.untyped_storage()
                    if storage._cdata not in params:
                        kept[storage._cdata] = storage.nbytes()
                    return t

                amp = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
                       else contextlib.nullcontext())
                with amp, torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
                    carry = layer(carry)
                saved.append(sum(kept.values()))
            out = (inputs, saved, packed_nbytes(carry))
    except Exception:  # a layer the fake tensors cannot run: activations unknown (as before)
        out = None
    cache[key] = out
    return out


def _shapes(tree: Any) -> tuple:
    """The shapes and dtypes of the tensors of ``tree`` (a cache key)."""
    return tuple((tuple(t.shape), t.dtype) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def _layer_costs(seq: Any, rows: int, seq_len: int, compute_bytes: int) -> list | None:
    """The cost model's per-layer costs of a Hugging Face causal LM whose sequence is prefix, decoders,
    tail, at ``rows`` x ``seq_len`` tokens; ``None`` for another model."""
    config = getattr(seq.target, "config", None)
    if config is None:
        return None
    try:
        from lightning_roundpipe.partition.costmodel import CostModel, ModelShape

        shape = ModelShape.from_config(config)
        if shape.num_hidden_layers + 2 == len(seq.layers):
            return CostModel().layer_costs(shape, seq_len=seq_len, microbatch_size=rows,
                                           compute_dtype_bytes=compute_bytes)
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    return None


def layer_profiles(seq: Any, store: Any, rows: int, seq_len: int, compute_bytes: int, sample: Any = None,
                   ) -> tuple[list[LayerProfile], list[int] | None]:
    """Per layer of ``seq``, a :class:`LayerProfile` with the store's bytes (weights as uploaded,
    gradients of the trainable ones in their upload dtype) and, for a Hugging Face causal LM whose
    sequence is prefix, decoders, tail, the cost model's activations at ``rows`` x ``seq_len`` tokens;
    and the saved activation bytes (``None``: the model is not one the cost model knows). Another
    model's activations (an ``nn.Sequential``) come from :func:`traced_activations` of ``sample`` (a
    microbatch's carry; ``None``: unknown, 0)."""
    num_layers = len(seq.layers)
    costs = _layer_costs(seq, rows, seq_len, compute_bytes)
    traced = None
    if costs is None and sample is not None:
        traced = traced_activations(seq, sample, torch.bfloat16 if compute_bytes < 4 else None)
    profiles = []
    for index in range(num_layers):
        layout = store.layout(range(index, index + 1))
        trainable = sum(aligned(store.tensors[k].master.numel() * store.tensors[k].dtype.itemsize)
                        for k in layout.tensors if store.tensors[k].is_param and store.tensors[k].master.requires_grad)
        activation = (costs[index].activation_bytes if costs is not None
                      else traced[0][index] if traced is not None else 0)
        profiles.append(LayerProfile(forward_s=0.0, backward_s=0.0, param_bytes=layout.total_bytes,
                                     activation_bytes=activation, trainable_param_bytes=trainable))
    saved = ([c.saved_activation_bytes for c in costs] if costs is not None
             else list(traced[1]) if traced is not None else None)
    return profiles, saved


def transfer_slot_sizes(program: Any, boundary: Sequence[int]) -> list[int]:
    """Per transfer slot of the program's assignment (the same slots on every device), the largest
    boundary put there, bytes: a stage input is ``boundary[first layer]``, an incoming gradient
    ``boundary[the layer after its last]``."""
    sizes: dict[int, int] = {}
    for plan in device_slots(program):
        for (kind, stage_index, _), slot in plan.slots.items():
            layers = program.plan.stages[stage_index].layers
            layer = layers.start if kind == "in" else layers.stop
            sizes[slot] = max(sizes.get(slot, 0), boundary[layer] if layer < len(boundary) else 0)
    return [sizes.get(slot, 0) for slot in range(max(sizes, default=-1) + 1)]


def transfer_bytes(program: Any, boundary: Sequence[int]) -> int:
    """One bank's transfer slots on a device, bytes (:func:`transfer_slot_sizes` summed)."""
    return sum(transfer_slot_sizes(program, boundary))


def boundaries(profiles: Sequence[LayerProfile], tokens: int, compute_bytes: int,
               batch_bytes: int | None = None) -> list[int]:
    """Per layer, the bytes of its input carry as uploaded (packed): the first layer's is the
    microbatch itself (``batch_bytes``; ``None``: ``input_ids``, ``attention_mask`` and ``labels`` in
    int64), every later one the hidden states (the fp32 residual stream) beside what the carry passes
    on from the batch (the mask, the labels, the positions in place of the ids: as many bytes, or
    fewer); 0 where the activations are unknown."""
    batch = 3 * aligned(tokens * 8) if batch_bytes is None else int(batch_bytes)
    return [0 if not p.activation_bytes else batch if index == 0 else aligned(p.activation_bytes * 4 // compute_bytes) + batch
            for index, p in enumerate(profiles)]


def carry_boundaries(seq: Any, profiles: Sequence[LayerProfile], rows: int, seq_len: int, compute_bytes: int,
                     batch_bytes: int | None = None, sample: Any = None) -> list[int]:
    """Per layer, the bytes of its input carry as uploaded: :func:`boundaries` for a model the cost
    model knows; for another one traced from ``sample`` (:func:`traced_activations`), one entry more:
    the last layer's output, whose gradient a backward program uploads when the loss is computed
    outside the sequence."""
    if sample is not None and _layer_costs(seq, rows, seq_len, compute_bytes) is None:
        traced = traced_activations(seq, sample, torch.bfloat16 if compute_bytes < 4 else None)
        if traced is not None:
            return [*traced[0], traced[2]]
    return boundaries(profiles, rows * seq_len, compute_bytes, batch_bytes)


def planned_transfer_sizes(engine: Any, program: Any) -> list[int] | None:
    """The transfer slots to reserve before ``program`` runs (the executor's ``transfer_sizes``): the
    model's boundaries at the last training call's rows and length (:func:`transfer_slot_sizes`);
    ``None`` before a training call or for a model whose activations the cost model does not know.
    Cached per program and shape."""
    shape = engine.__dict__.get("memory_shape")
    if shape is None:
        return None
    rows, seq_len, _, batch_bytes = shape
    sample = engine.__dict__.get("memory_sample")
    cache = engine.__dict__.setdefault("_transfer_size_cache", {})
    key = (id(program), rows, seq_len, batch_bytes, _shapes(sample))
    held = cache.get(key)
    if held is not None and held[0] is program:
        return held[1]
    dtype = engine.autocast_dtype or engine.store.compute_dtype or torch.float32
    profiles, _ = layer_profiles(engine.seq, engine.store, rows, seq_len, dtype.itemsize, sample)
    boundary = carry_boundaries(engine.seq, profiles, rows, seq_len, dtype.itemsize, batch_bytes, sample)
    sizes = transfer_slot_sizes(program, boundary) if any(boundary) else None
    cache[key] = (program, sizes)
    return sizes


def predicted_peaks(seq: Any, store: Any, program: Any, *, rows: int, seq_len: int, banks: int,
                    compute_bytes: int = 4, batch_bytes: int | None = None, sample: Any = None) -> list[DevicePeak]:
    """The modelled per-device peak of ``program`` (a stream program of the engine's partition) with
    ``rows`` sequences of ``seq_len`` tokens per microbatch (``batch_bytes``: a microbatch's packed
    bytes, see :func:`boundaries`; ``sample``: the largest microbatch's carry, which gives the
    activations of a model the cost model does not know, :func:`traced_activations`) and ``banks``
    pool banks, bytes."""
    plan = program.plan
    profiles, saved = layer_profiles(seq, store, rows, seq_len, compute_bytes, sample)
    boundary = carry_boundaries(seq, profiles, rows, seq_len, compute_bytes, batch_bytes, sample)
    stages = [("fused" if s.fused else s.kind, s.layers) for s in plan.stages]
    runs = [{action.stage_index for action in actions} for actions in plan.actions]  # what each device computes
    autocast = compute_bytes if compute_bytes < 4 else None
    allowed = plan._meta.get("stage_devices")  # the runtime sizes a device's slots to the stages it may hold
    return device_peaks(profiles, stages, len(plan.actions), saved_activation_bytes=saved,
                        stage_bytes=stage_bytes(store, plan.stages, seq.layers, autocast),
                        transfer_bytes=transfer_bytes(program, boundary), banks=banks, slots=max(program_slots(plan), 1),
                        stage_devices=[[d for d, mine in enumerate(runs) if k in mine] for k in range(len(stages))],
                        pool_devices=[allowed[k] for k in range(len(stages))] if allowed is not None else None,
                        previous=[_previous_stages(actions) for actions in plan.actions],
                        held_outputs=max((len(d.computes) for d in plan_dispatches(plan)), default=1))


def _previous_stages(actions: Sequence[Any]) -> dict[int, int | None]:
    """``stage_index -> the stage computed just before it`` on a device (``None``: its first), from the
    device's plan list (with several rounds: the first dispatch's predecessor, or a later one's where the first
    has none)."""
    out: dict[int, int | None] = {}
    last = None
    for action in actions:
        if not action.kind.is_compute or action.stage_index == last:
            continue
        out.setdefault(action.stage_index, last)
        if out[action.stage_index] is None and last is not None:
            out[action.stage_index] = last
        last = action.stage_index
    return out


def program_slots(plan: Any) -> int:
    """Stage weight slots per device the runtime reserves for ``plan`` (its pool assignment)."""
    from lightning_roundpipe.runtime.backends.pool import pool_slots

    return max(pool_slots(plan).values(), default=-1) + 1


def check_budgets(peaks: Sequence[DevicePeak], budgets: Sequence[int | None], plan: Any, banks: int,
                  auto_partition: bool = False) -> None:
    """Raise :class:`PlanMemoryError` for the first device whose modelled peak exceeds its budget
    (``None``: unlimited); ``auto_partition``: the run's partition is automatic already (its HINT then
    does not suggest it)."""
    for peak, budget in zip(peaks, budgets):
        if budget is not None and peak.peak_bytes > budget:
            stage = plan.stages[peak.stage_index].describe() if peak.stage_index is not None else ""
            pool_stage = plan.stages[peak.pool_stage_index].describe() if peak.pool_stage_index is not None else ""
            raise PlanMemoryError(peak, budget, stage, banks, pool_stage, auto_partition)


def check_program(engine: Any, program: Any, state: Any, banks: int) -> str | None:
    """Before a program's pools are reserved (every partition, automatic, default or given, on both
    drivers): the memory model's per-device peak (:func:`predicted_peaks`) at this call's rows and
    sequence length (the first 2-D tensor of each microbatch's input) against each device's budget
    (:meth:`~lightning_roundpipe.runtime.backends.base.Backend.device_budget_bytes`).

    Returns:
        why ``banks = 2`` does not fit while one bank does (the executor then runs one program at a
        time), else ``None``.

    Raises:
        PlanMemoryError: one bank does not fit a device (nothing of the program was allocated).
    """
    rows, seq_len, batch_bytes = 1, 1, 0
    for index in range(state.num_microbatches):
        microbatch = state.acts.get((0, index))
        batch_bytes = max(batch_bytes, packed_nbytes(microbatch))
        for leaf in pytree.tree_leaves(microbatch):
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2:
                rows, seq_len = max(rows, leaf.shape[0]), max(seq_len, leaf.shape[1])
                break
    sample = max((state.acts[(0, index)] for index in range(state.num_microbatches) if (0, index) in state.acts),
                 key=packed_nbytes, default=None)
    if sample is not None:  # shapes only: what a shape-only pass of a model the cost model does not know needs
        sample = pytree.tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t,
                                 sample)
    if state.keep:  # a training call: the shape the automatic choice and the transfer slots are sized at
        engine.__dict__["memory_shape"] = (rows, seq_len, banks, batch_bytes)
        engine.__dict__["memory_sample"] = sample
    budgets = [backend.device_budget_bytes() for backend in engine.backends]
    if all(budget is None for budget in budgets):
        return None
    key = (id(program), banks, rows, seq_len, batch_bytes, tuple(budgets))
    checked = engine.__dict__.setdefault("_memory_checked", {})
    if key in checked:
        return checked[key]
    dtype = engine.autocast_dtype or engine.store.compute_dtype or torch.float32
    reason = None
    for count in range(banks, 0, -1):
        peaks = predicted_peaks(engine.seq, engine.store, program, rows=rows, seq_len=seq_len, banks=count,
                                compute_bytes=dtype.itemsize, batch_bytes=batch_bytes, sample=sample)
        try:
            check_budgets(peaks, budgets, program.plan, count, engine.auto_partition_after_steps is not None)
            break
        except PlanMemoryError as error:
            if count == 1:
                raise
            reason = f"the memory model: {error}"
    checked[key] = reason
    return reason


def plans_fit(engine: Any, plans: Sequence[Any]) -> bool:
    """Whether the model's per-device peak of every plan (an
    :class:`~lightning_roundpipe.schedule.plan.ExecutionPlan` the automatic choice considers) fits each
    device's budget, at the last training call's rows, length and pool banks; ``True`` before any
    training call or without budgets."""
    shape = engine.__dict__.get("memory_shape")
    budgets = [backend.device_budget_bytes() for backend in engine.backends]
    if shape is None or all(budget is None for budget in budgets):
        return True
    rows, seq_len, _, batch_bytes = shape
    dtype = engine.autocast_dtype or engine.store.compute_dtype or torch.float32
    for plan in plans:
        peaks = predicted_peaks(engine.seq, engine.store, engine._lower(plan), rows=rows, seq_len=seq_len, banks=1,
                                compute_bytes=dtype.itemsize, batch_bytes=batch_bytes,
                                sample=engine.__dict__.get("memory_sample"))
        if any(budget is not None and peak.peak_bytes > budget for peak, budget in zip(peaks, budgets)):
            return False
    return True
