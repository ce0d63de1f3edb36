"""`RoundPipeEngine`: one pipelined model on a set of devices (no Lightning here).

It owns the device workers, the weight store, the stages and the round-robin cursor, and provides
the pipelined ``forward`` that replaces the target module's own. The Lightning strategy only
creates it, installs it and reads its metrics.
"""

from __future__ import annotations

import logging
import math
import threading
import warnings
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from lightning_roundpipe.adapters.base import LayerSequence
from lightning_roundpipe.config import RoundPipeConfig
from lightning_roundpipe.metrics.timeline import Timeline
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.runtime.execution.autograd import attach
from lightning_roundpipe.runtime.tuning.autopartition import (choose_partition, describe_choice, fused_stages, hardware_model,
                                                      microbatch_weights, predict_step_s)
from lightning_roundpipe.runtime.backends import make_backends, smallest_stage_budget, step_memory_peaks
from lightning_roundpipe.runtime.execution.jitter import pause as jitter_pause
from lightning_roundpipe.runtime.execution.executor import Executor, PipelineState, rng_layers
from lightning_roundpipe.runtime.execution.host_calls import HostCalls
from lightning_roundpipe.runtime.host.memory import HostMemory, host_memory
from lightning_roundpipe.runtime.execution.overlap import StepOverlap
from lightning_roundpipe.runtime.execution.microbatch import (BatchStatistics, check_batch_dim, merge_input_grads, merge_leaves,
                                                           split_grads, split_microbatches)
from lightning_roundpipe.runtime.tuning.profiler import LayerProfiler
from lightning_roundpipe.runtime.replay.routing import RoutingStore
from lightning_roundpipe.runtime.host.store import WeightStore
from lightning_roundpipe.runtime.tuning.mixed import build_plan
from lightning_roundpipe.schedule import ExecutionPlan, build_stages, default_stage_ranges
from lightning_roundpipe.schedule.lower import DEFAULT_CHUNK_BYTES, lower
from lightning_roundpipe.schedule.program import StreamProgram

log = logging.getLogger(__name__)


class RoundPipeEngine(HostCalls):
    """Pipelined execution of a :class:`LayerSequence`.

    Args:
        seq: the model's layer sequence (its parameters are the CPU master weights).
        devices: one ``torch.device`` per worker (``cpu`` entries are CPU virtual devices).
        num_microbatches: microbatches per call (at most the batch size is used).
        partition: forward and backward stage boundaries; default: forward stages of 3 layers,
            backward stages of 1 layer (:func:`default_stage_ranges`).
        compute_dtype: dtype the matmul weights (``nn.Linear`` / convolution weights) are uploaded in
            under mixed precision, the other tensors keeping their master's dtype (``None``: every
            tensor as its master; see :class:`~lightning_roundpipe.runtime.host.store.WeightStore`).
        autocast_dtype: ``torch.autocast`` dtype on the workers (``None``: no autocast).
        auto_partition_after_steps: profile every layer during this many steps (the first is
            dropped as warm-up), then re-cut the stages with
            :func:`~lightning_roundpipe.partition.auto_partition` from the measured times; ``None``
            keeps ``partition`` for good.
        stage_memory_bytes: per-stage memory budget for the automatic partition, bytes (half of a
            device's memory: the next stage is prefetched); ``None``: no limit (CPU virtual devices).
        fused_loss: when the model computes its own scalar loss (HF causal LM with ``labels``),
            run forward stages, the fused tail and the backward stages as one plan inside the
            forward call (DESIGN.md section 2, fused path); ``False`` always uses the transparent path.
        chunk_bytes: largest weight upload chunk, bytes (paper section 3.3; default 64 MiB).
        microbatches_per_round: dispatch microbatches in rounds of at most this many
            (:func:`~lightning_roundpipe.schedule.build_roundpipe_plan`); ``None``: one round, or,
            with ``auto_partition_after_steps``, the rounds the automatic choice finds fastest.
        cpu_link_bytes_per_s: CPU virtual devices: modelled host link rate per direction, bytes/s
            (``None``: unthrottled copies).
        check_streams: CPU virtual devices: the stream checking mode (``None``: the environment variable).
        frozen_weights: ``"fp8"`` / ``"nf4"``: frozen matmul weights held and uploaded in fp8 / NF4 (:class:`WeightStore`).
        debug_copy_delay_s: CPU virtual devices, debugging: every copy lands this many seconds late
            (its destination holds NaN meanwhile), so a missing dependency gives a wrong result.
        device_memory_bytes: memory budget of each device, bytes: enforced on CPU virtual devices
            (:class:`~lightning_roundpipe.runtime.backends.budget.DeviceMemoryError`); the automatic
            partition's per-stage budget defaults to half of it. ``None``: unlimited on CPU virtual devices.
        profile_steps: profile every layer during this many training steps (>= 2, the first is
            dropped) to predict step times with the simulator (:meth:`predict_s`), also without
            the automatic partition; ``None``: only when ``auto_partition_after_steps`` is set.
        loss_seed: fused path: called at every fused call, returns the gradient (a finite float
            > 0) the fused tail seeds its loss's backward with on the devices, e.g. the current
            loss scale under fp16 so device gradients do not underflow; the CPU gradient buffers
            are divided by it again when the returned loss's backward scales them. ``None``: 1.0.
        balance_microbatches: with ``auto_partition_after_steps``, the automatic choice may also cut
            the batch into the next multiple of the device count of microbatches
            (:func:`~lightning_roundpipe.runtime.tuning.autopartition.split_options`); ``False``: always
            ``num_microbatches`` (the default here; the strategy's default is ``True``).

    Raises:
        ValueError: for an empty device list, ``num_microbatches < 1``, a partition that does not
            tile the layers, or an accelerator other than CPU and CUDA.
    """

    def __init__(self, seq: LayerSequence, devices: Sequence[torch.device], num_microbatches: int,
                 partition: PartitionPlan | None = None, compute_dtype: torch.dtype | None = None,
                 autocast_dtype: torch.dtype | None = None, auto_partition_after_steps: int | None = None,
                 stage_memory_bytes: int | None = None, fused_loss: bool = True,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, microbatches_per_round: int | None = None,
                 cpu_link_bytes_per_s: float | None = None, debug_copy_delay_s: float = 0.0,
                 profile_steps: int | None = None, loss_seed: Callable[[], float] | None = None,
                 device_memory_bytes: int | None = None, balance_microbatches: bool = False,
                 check_streams: bool | None = None, frozen_weights: str | None = None) -> None:
        if not devices:
            raise ValueError("`devices` is empty: RoundPipe needs at least one device.")
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"`num_microbatches` must be a positive int, got {num_microbatches!r}.")
        self.seq = seq
        self.devices = [torch.device(d) for d in devices]
        self.num_microbatches = num_microbatches
        self.partition = partition or PartitionPlan(*default_stage_ranges(len(seq)))
        self.partition.validate(len(seq))
        self.stages = build_stages(self.partition.forward_stages, self.partition.backward_stages)
        self._fused_stages = None
        self.chunk_bytes = chunk_bytes
        self.microbatches_per_round = microbatches_per_round
        self.rounds_pinned = microbatches_per_round is not None  # the automatic choice keeps them
        self.balance_microbatches = balance_microbatches
        self.split_num_microbatches: int | None = None  # the automatic choice's finer cut of the batch, if any
        self.cpu_link_bytes_per_s = cpu_link_bytes_per_s
        self.backends = make_backends(self.devices, cpu_link_bytes_per_s, debug_copy_delay_s, device_memory_bytes,
                                      check_streams)
        self.device_memory_bytes = device_memory_bytes
        if stage_memory_bytes is None and device_memory_bytes is not None:
            stage_memory_bytes = smallest_stage_budget(device_memory_bytes)  # half: the next stage is prefetched
        self.store = WeightStore(seq.layers, compute_dtype, self.devices[0].type == "cuda", frozen_weights)
        self.executor = Executor(seq, self.backends, self.store, autocast_dtype)
        self.cursor = 0
        self._plans: dict[tuple, ExecutionPlan] = {}
        self._programs: dict[tuple, StreamProgram] = {}
        self._timelines: list[Timeline] = []
        self._step_programs: list[StreamProgram] = []
        self._lock = threading.Lock()
        self._original_forward = None
        self._warned_small_batch = False
        self.batch_statistics = BatchStatistics(seq.layers, seq.target)  # BatchNorm in train mode: whole batch
        self._warned_routing_fused = False
        self.stage_memory_bytes = stage_memory_bytes
        self.fused_loss = fused_loss
        self.loss_seed = loss_seed
        self.auto_partition_after_steps = auto_partition_after_steps
        self.executor.error_notes.auto_partition = auto_partition_after_steps is not None
        self.measured_profiles = None
        self._last_call: tuple[int, bool] | None = None  # (microbatches, fused) of the last training call
        self._last_sizes: list[int] = []  # rows of each microbatch of the last training call
        self._profiled_rows: float | None = None  # mean rows per microbatch of the profiled steps
        self.plan_choice = None  # the automatic choice (autopartition.PlanChoice), once made
        self._predictions: dict[int, tuple[StreamProgram, float]] = {}
        self.grad_barrier: Callable[[], None] | None = None
        """Called in the main thread right before the engine writes gradients into the masters'
        ``.grad`` (the asynchronous optimizer waits there for the step in flight, paper section 4);
        while set, the transparent path's backward stages also collect their gradients in CPU
        buffers first, so they run while that step is in flight."""
        self.sink_barrier: Callable[[dict], None] | None = None
        """Fused path: called in the main thread with the gradient buffers (``id(master) ->
        (master, grad)``) right before the loss's backward adds them into ``.grad`` (the
        data-parallel all-reduce of buffers launched during the pipeline is waited for there)."""
        for name, value in (("auto_partition_after_steps", auto_partition_after_steps), ("profile_steps", profile_steps)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 2):
                raise ValueError(f"`{name}` must be an int >= 2 (the first step is warm-up) or None, got {value!r}.")
        self.profile_steps = auto_partition_after_steps or profile_steps
        if self.profile_steps is not None:
            self.executor.profiler = LayerProfiler(len(seq))
        self.autocast_dtype = autocast_dtype
        self.host_barrier: Callable[[], None] | None = None
        """Called in the main thread before a host call (:meth:`host_forward`) reads the master weights
        (the asynchronous optimizer waits there for the step in flight)."""
        self.on_fused_call: Callable[[], None] | None = None
        """Called in the main thread at every fused-path call, before it runs (the strategy warns once
        that the output carries the loss only)."""
        self.info: Callable[[str], None] = log.info
        """Where the engine reports a new partition (the strategy passes Lightning's ``rank_zero_info``)."""
        self._host_calls = threading.local()  # depth of `generate` calls in this thread
        self.executor.memory_check = self._check_memory
        self.executor.transfer_sizes = self._transfer_sizes
        self.overlap = StepOverlap(self)
        self.overlap_next = False
        """Set before a training call whose fused program may still drain when the call returns
        (:mod:`~lightning_roundpipe.runtime.execution.overlap`: a batch that does not step the
        optimizer, in ``"sync"`` mode, with no hook reading gradients at its backward); consumed by
        that call."""
        self.before_fused_start: Callable[[], None] | None = None
        """Called before a fused program is issued (the asynchronous steady state prepares the weights
        snapshot the program uploads: :mod:`lightning_roundpipe.integration.async_step`)."""
        self.on_gradients_complete: Callable[[], None] | None = None
        """Called when an overlapped call's gradients have been added into ``.grad`` (the asynchronous
        steady state then runs that step's clipping and hands its update to the optimizer thread).
        Overlapped calls with a :attr:`grad_barrier` are allowed only when this is set."""
        self._original_generate = None
        self._seed_generator: torch.Generator | None = None

    def next_base_seed(self) -> int:
        """The ``base_seed`` of the next pipelined call with random layers (main thread), an int in
        ``[0, 2**62)``: drawn from the engine's own CPU ``torch.Generator``, which is seeded, at the
        first call, with one ``torch.randint(0, 2**62, (1,))`` from torch's global CPU generator. So
        ``seed_everything`` reproduces a run, and the main thread does not draw from the global
        generator while an overlapped run's random layers run (:mod:`~lightning_roundpipe.runtime.replay.rng`)."""
        if self._seed_generator is None:
            self._seed_generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        return int(torch.randint(0, 2**62, (1,), generator=self._seed_generator).item())

    @classmethod
    def from_config(cls, seq: LayerSequence, devices: Sequence[torch.device], config: RoundPipeConfig, *,
                    fitting: bool = True, compute_dtype: torch.dtype | None = None,
                    autocast_dtype: torch.dtype | None = None, stage_memory_bytes: int | None = None,
                    loss_seed: Callable[[], float] | None = None) -> "RoundPipeEngine":
        """An engine with the fields of ``config`` (:class:`~lightning_roundpipe.RoundPipeConfig`).

        ``num_microbatches=None`` becomes ``len(devices) + 1``; explicit ``forward_stages`` and
        ``backward_stages`` become the partition; ``partition="auto"`` re-cuts the stages after
        ``profile_steps`` steps, and the layers are profiled for the prediction, only when ``fitting``.
        ``module``, ``optimizer``, ``trace_every_n_steps`` and ``peak_flops`` are the strategy's business and
        not read here.

        Raises:
            ValueError: as :class:`RoundPipeEngine`.
        """
        partition = (PartitionPlan(config.forward_stages, config.backward_stages)
                     if config.forward_stages is not None else None)
        auto = fitting and partition is None and config.partition == "auto"
        return cls(seq, devices, config.num_microbatches or len(devices) + 1, partition, compute_dtype, autocast_dtype,
                   auto_partition_after_steps=config.profile_steps if auto else None,
                   stage_memory_bytes=stage_memory_bytes, fused_loss=config.fused_loss,
                   chunk_bytes=config.chunk_bytes, microbatches_per_round=config.microbatches_per_round,
                   cpu_link_bytes_per_s=config.cpu_link_bytes_per_s, debug_copy_delay_s=config.debug_copy_delay_s,
                   device_memory_bytes=config.device_memory_bytes,
                   profile_steps=config.profile_steps if fitting else None, loss_seed=loss_seed,
                   balance_microbatches=config.balance_microbatches, check_streams=config.check_streams,
                   frozen_weights=config.frozen_weights)

    def _check_memory(self, program: StreamProgram, state: PipelineState, banks: int) -> str | None:
        """The executor's check before a program's pools are reserved:
        :func:`~lightning_roundpipe.runtime.tuning.device_memory.check_program`."""
        from lightning_roundpipe.runtime.tuning.device_memory import check_program

        return check_program(self, program, state, banks)

    def _transfer_sizes(self, program: StreamProgram) -> list[int] | None:
        """The executor's transfer slots reserved before a program:
        :func:`~lightning_roundpipe.runtime.tuning.device_memory.planned_transfer_sizes`."""
        from lightning_roundpipe.runtime.tuning.device_memory import planned_transfer_sizes

        return planned_transfer_sizes(self, program)

    def pop_device_memory_peaks(self) -> list[int] | None:
        """Per CPU virtual device, the most bytes live at once (weights, activations, op outputs)
        since the last call; ``None`` without ``device_memory_bytes`` or on GPUs."""
        ledgers = [getattr(b, "memory", None) for b in self.backends]
        if any(ledger is None for ledger in ledgers):
            return None
        return [ledger.pop_peak() for ledger in ledgers]

    def pop_step_memory_peaks(self) -> list[int] | None:
        """``roundpipe/device{i}/peak_memory(GiB)``'s bytes: :func:`~lightning_roundpipe.runtime.backends.step_memory_peaks`."""
        return step_memory_peaks(self.backends)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Uninstall, stop the worker threads and give frozen parameters held in the compute dtype
        their original dtype back (values stay rounded to the compute dtype: see
        :meth:`~lightning_roundpipe.runtime.host.store.WeightStore.restore_frozen`)."""
        self.uninstall()
        try:
            self.drain()
        finally:
            self.executor.close()
        self.store.restore_frozen()

    def set_partition(self, partition: PartitionPlan, microbatches_per_round: int | None | str = "keep") -> None:
        """Use new stage boundaries (and, unless ``"keep"``, new microbatch rounds) from the next call
        on, e.g. what the automatic choice found fastest."""
        partition.validate(len(self.seq))
        self.drain()
        self.partition = partition
        if microbatches_per_round != "keep":
            self.microbatches_per_round = microbatches_per_round
        self.stages = build_stages(partition.forward_stages, partition.backward_stages)
        self._fused_stages = None
        self._plans.clear()
        self._programs.clear()
        self._predictions.clear()

    def plan(self, num_microbatches: int, cursor: int, fused: bool = False) -> ExecutionPlan:
        """The validated full-step plan (forward then backward stages) starting at ``cursor``.

        With ``fused`` the first backward stage is the fused tail and the forward stages stop where
        it starts.
        """
        key = (num_microbatches, cursor, fused)
        plan = self._plans.get(key)
        if plan is None:
            stages = self.fused_stages if fused else self.stages
            plan = self._plans[key] = self._build_plan(stages, num_microbatches, cursor, self.microbatches_per_round)
        return plan

    def _build_plan(self, stages, num_microbatches: int, cursor: int, microbatches_per_round: int | None) -> ExecutionPlan:
        return build_plan(self, stages, num_microbatches, cursor, microbatches_per_round)  # the dispatch rule: tuning/mixed.py

    def _lower(self, plan: ExecutionPlan) -> StreamProgram:
        return lower(plan, stage_weight_bytes=[self.store.stage_bytes(s.layers) for s in plan.stages],
                     stage_grad_bytes=[self.store.stage_grad_bytes(s.layers) if s.kind == "backward" else 0
                                       for s in plan.stages],
                     chunk_bytes=self.chunk_bytes)

    def program(self, num_microbatches: int, cursor: int, fused: bool = False, phase: str | None = None) -> StreamProgram:
        """The validated stream program of :meth:`plan` (or of its ``phase``), lowered with this
        model's stage byte sizes and ``chunk_bytes`` (cached)."""
        key = (num_microbatches, cursor, fused, phase)
        program = self._programs.get(key)
        if program is None:
            plan = self.plan(num_microbatches, cursor, fused)
            program = self._programs[key] = self._lower(plan if phase is None else plan.phase(phase))
        return program

    @property
    def fused_stages(self):
        """Stages of the fused path: forward stages clipped before the tail, the tail fused."""
        if self._fused_stages is None:
            self._fused_stages = fused_stages(self.partition)
        return self._fused_stages

    def _advance(self, n: int) -> int:
        with self._lock:
            c = self.cursor
            self.cursor = (c + n) % len(self.backends)
            return c

    # ------------------------------------------------------------------ the pipelined forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The pipelined forward: same inputs and outputs as the target's own forward.

        With grad enabled and trainable parameters, the outputs carry an autograd node whose
        backward runs the backward stages (the transparent path), or, when the model computes its
        own loss and ``fused_loss`` is on, the whole step runs here and the returned loss's backward
        only scales the gradient buffers into ``.grad`` (the fused path; ``logits`` is ``None``).
        Otherwise only forward stages run and no activation is kept. Calls inside :meth:`generate`
        and calls the adapter marks as host calls run :meth:`host_forward` instead.
        """
        seq = self.seq
        if getattr(self._host_calls, "depth", 0) or (seq.host_call is not None and seq.host_call(args, kwargs)):
            return self.host_forward(*args, **kwargs)
        self.store.rebind_buffers()  # a module replaced a buffer (SWA resets BatchNorm statistics so)
        carry = seq.prepare(args, kwargs)
        flat, carry_spec = pytree.tree_flatten(carry)
        grad_enabled = torch.is_grad_enabled()
        # inputs that carry autograd history (a trainable module in front of the model): the node
        # takes them as inputs and returns their gradients; the workers see detached copies
        grad_pos = tuple(i for i, t in enumerate(flat)
                         if grad_enabled and isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad)
        grad_inputs = [flat[i] for i in grad_pos]
        carry = pytree.tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in flat], carry_spec)
        target = self.batch_statistics.num_microbatches(self.split_num_microbatches or self.num_microbatches)
        mbs, sizes = split_microbatches(carry, target)
        if seq.prepare_microbatch is not None:  # data-dependent decisions per microbatch, on the host
            mbs = [seq.prepare_microbatch(mb) for mb in mbs]
        m = len(mbs)
        if m < target and not self._warned_small_batch:
            self._warned_small_batch = True
            warnings.warn(f"RoundPipe: a batch of {sum(sizes)} rows is cut into {m} microbatches instead of {target}"
                          f" (`num_microbatches={self.num_microbatches}`{', re-cut for the devices' if target != self.num_microbatches else ''};"
                          f" a microbatch needs at least one row). HINT: a `batch_size` of at least {target}, or a lower `num_microbatches`.")
        training = grad_enabled and (bool(grad_pos) or any(p.requires_grad for p in seq.parameters()))
        n_fwd = len(self.partition.forward_stages)
        n_bwd = len(self.partition.backward_stages)
        state = PipelineState(num_microbatches=m)
        state.rng_layers = rng_layers(seq)
        state.input_grad_positions = grad_pos
        if state.rng_layers:
            state.base_seed = self.next_base_seed()
        if seq.routing is not None:
            state.routing = RoutingStore(seq.routing.layers, m)
        if training:
            state.keep = frozenset(r.start for r in self.partition.backward_stages)
        for i, mb in enumerate(mbs):
            state.acts[(0, i)] = mb
        if (training and self.fused_loss and seq.loss_key and seq.has_loss and seq.has_loss(carry)
                and self._fused_allows_routing(carry, m)):
            return self.overlap.fused_forward(state, m, flat, sizes, grad_inputs, carry)
        cursor = self._advance(n_fwd)
        if training:
            self._last_call, self._last_sizes = (m, False), list(sizes)
        self._run(self.program(m, cursor, phase="forward"), state, record=training)
        finals = [pytree.tree_flatten(state.final.pop(i)) for i in range(m)]
        spec = finals[0][1]
        if not seq.additive_scalars:
            check_batch_dim([leaves for leaves, _ in finals], sizes, seq.family)
        merged = merge_leaves([leaves for leaves, _ in finals])
        extra = self._routing_outputs(state, carry)
        if extra:
            tree = pytree.tree_unflatten(merged, spec)
            for key, value in extra.items():
                tree[key] = tree[key] + value if tree.get(key) is not None else value
            merged, spec = pytree.tree_flatten(tree)
        if training:
            idx = [i for i, x in enumerate(merged) if isinstance(x, torch.Tensor)]
            # what the backward needs of the outputs (their ranks): not the attached outputs, whose
            # node holds this closure (a reference cycle would keep the saved inputs until gc runs)
            leaves = [torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in merged]

            def run_backward(grads: list, retain: bool) -> list:
                full = [None] * len(leaves)
                for i, g in zip(idx, grads):
                    full[i] = g
                state.final_grads = split_grads(leaves, full, sizes)
                bcursor = (self._advance(n_bwd) - n_fwd) % len(self.backends)
                barrier = self.grad_barrier
                if barrier is not None:
                    state.grad_sink = {}
                # a retained graph keeps the saved stage inputs (host memory) for the next backward,
                # which runs the backward program again: the program removes each input as it reads it
                kept = dict(state.acts) if retain else None
                if state.routing is not None:
                    state.routing.retain = retain
                try:
                    self._run(self.program(m, bcursor, phase="backward"), state)
                finally:
                    state.acts.clear()
                    state.final_grads = None
                    if kept is not None:
                        state.acts.update(kept)
                if barrier is not None:
                    barrier()
                    WeightStore.add_grads(list(state.grad_sink.values()), None, staged=False)
                    state.grad_sink = None
                jitter_pause()  # the main thread's return (schedule jitter, `execution/jitter.py`)
                return self._input_grads(state, flat, sizes)

            attached = attach([merged[i] for i in idx], run_backward, grad_inputs)
            for i, t in zip(idx, attached):
                merged[i] = t
        jitter_pause()
        return seq.finalize(pytree.tree_unflatten(merged, spec))

    def _input_grads(self, state: PipelineState, batch_leaves: list, sizes: list[int]) -> list:
        """Gradients of the batch's grad-requiring inputs, merged over microbatches."""
        if not state.input_grad_positions:
            return []
        per_mb = [state.grads.pop((0, i), None) or [None] * len(state.input_grad_positions) for i in range(len(sizes))]
        return merge_input_grads([batch_leaves[i] for i in state.input_grad_positions], per_mb, sizes)

    def _routing_outputs(self, state: PipelineState, batch_carry: dict) -> dict:
        """Values the whole batch's routing adds to the merged outputs (the load-balancing loss)."""
        routing = self.seq.routing
        if routing is None or routing.outputs is None:
            return {}
        return routing.outputs(state.routing, batch_carry)

    def _fused_allows_routing(self, batch_carry: dict, m: int) -> bool:
        """Whether the fused path can run this call exactly: when the recomputation reads the whole
        batch's routing statistics (the load-balancing loss), every microbatch's forward must pass
        every routing layer before a backward stage recomputes one. In one round of the fused plan
        every device runs its forward stages before its backward stages, so a recomputation waiting
        for them cannot deadlock; with several rounds (``microbatches_per_round``), or a routing
        layer inside the fused tail (its forward and backward are one op), it could: such calls
        take the transparent path, whose backward starts after the whole forward."""
        routing = self.seq.routing
        if routing is None or not routing.needs_totals(batch_carry):
            return True
        tail = next(s for s in self.fused_stages if s.fused).layers
        several_rounds = self.microbatches_per_round is not None and self.microbatches_per_round < m
        if several_rounds or any(i in routing.layers for i in tail):
            if not self._warned_routing_fused:
                self._warned_routing_fused = True
                log.info("RoundPipe: the load-balancing loss needs the whole batch's routing before recomputation;"
                         " %s, so this model's steps take the transparent path.",
                         "the plan runs several rounds" if several_rounds else "the fused tail holds a routing layer")
            return False
        return True

    def _run(self, program: StreamProgram, state: PipelineState, record: bool = True) -> None:
        """Execute ``program``; keep its timeline and the program for the step's metrics when ``record``
        (training calls only: evaluation calls have no step that would collect them). Overlapped fused
        calls still in flight are finished first (:meth:`drain`)."""
        self.overlap.drain()
        timeline = self.executor.run(program, state)
        if record:
            self._keep(timeline, program)

    def _keep(self, timeline: Timeline, program: StreamProgram) -> None:
        with self._lock:
            self._timelines.append(timeline)
            self._step_programs.append(program)

    def end_step(self) -> PartitionPlan | None:
        """Call after every training step: folds the step's layer timings into the profile; after
        the profiled steps, keeps the measured profiles (for :meth:`predict_s`) and, with
        ``auto_partition_after_steps``, switches to the automatic partition.

        Returns:
            The new partition when it was switched at this step, else ``None``.
        """
        prof = self.executor.profiler
        if prof is None or not prof.enabled:
            return None
        prof.end_step()
        if prof.steps_seen < self.profile_steps or not prof.ready:
            return None
        prof.enabled = False
        param_bytes = [self.store.stage_bytes(range(i, i + 1)) for i in range(len(self.seq))]
        grad_bytes = [self.store.stage_grad_bytes(range(i, i + 1)) for i in range(len(self.seq))]
        profiles = prof.profiles(param_bytes, grad_bytes, list(self.seq.layer_names))
        self.measured_profiles = profiles
        if self.auto_partition_after_steps is None:
            return None
        self._profiled_rows = sum(self._last_sizes) / max(1, len(self._last_sizes))
        choice = self.plan_choice = choose_partition(self, profiles)
        new = choice.partition
        if ((new.forward_stages, new.backward_stages) == (self.partition.forward_stages, self.partition.backward_stages)
                and choice.microbatches_per_round == self.microbatches_per_round and choice.num_microbatches is None):
            return new
        self.info(describe_choice(self, choice, profiles, prof.steps_seen - prof.skip_steps))
        self.set_partition(new, choice.microbatches_per_round)
        self.split_num_microbatches = choice.num_microbatches
        return new

    def hardware_model(self):
        """The link model of the prediction (:func:`~lightning_roundpipe.runtime.tuning.autopartition.hardware_model`)."""
        return hardware_model(self)

    def microbatch_weights(self, num_microbatches: int) -> list[float] | None:
        """The last call's rows cut into ``num_microbatches``, relative to the profiled microbatch
        (:func:`.autopartition.microbatch_weights`)."""
        return microbatch_weights(self._last_sizes, num_microbatches, self._profiled_rows)

    def predict_s(self, programs: Sequence[StreamProgram]) -> float | None:
        """The simulator's time for one step's ``programs``, s (:func:`.autopartition.predict_step_s`)."""
        return predict_step_s(self, programs)

    def drain(self) -> None:
        """Finish the overlapped fused calls still in flight and add their gradients
        (:meth:`.overlap.StepOverlap.drain`); a no-op when none is.

        Raises:
            The first error of such a call (the older calls' gradients kept).
        """
        self.overlap.drain()

    def pop_step_programs(self) -> list[StreamProgram]:
        """The programs run since the last call (one step's: the fused program, or the forward and
        backward phases)."""
        with self._lock:
            out, self._step_programs = self._step_programs, []
        return out

    def host_memory(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> HostMemory:
        """Host bytes of the model's parameters by category (masters, shadows, gradients, host
        gradient buffers at the peak since the last call, the state of ``optimizers``), trainable
        and frozen apart (:func:`~lightning_roundpipe.runtime.host.memory.host_memory`)."""
        return host_memory(self.store, optimizers, self.executor.pop_peak_grad_bytes())

    def pop_timelines(self) -> list[Timeline]:
        """Timelines of the phases run since the last call (forward and backward phases)."""
        with self._lock:
            out, self._timelines = self._timelines, []
        return out
