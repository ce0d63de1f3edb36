"""Executes a :class:`~lightning_roundpipe.schedule.program.StreamProgram`; never reorders.

Every (device, stream) list is walked in order by that stream's thread (DESIGN.md sections 4 and
9). Before an op, the thread waits until each op it depends on (``program.deps``) is issued, then
makes its stream wait for that op's device event (cross-device too); after the op it records its own
event. A dispatch table maps each op kind to its handler:

- ``LOAD``: chunk ``c`` of the stage's weights from the host shadows into the stage's device buffer
  (:mod:`~lightning_roundpipe.runtime.execution.residency`, as ``DROP``);
- ``H2D`` / ``GH2D``: the input of an ``F``/``X``/``R`` / the incoming gradient of a ``B``, host to device
  (into the device's transfer pool; :mod:`~lightning_roundpipe.runtime.execution.transfers`);
- ``F``: forward without autograd (the inputs of later backward stages are snapshotted as they
  pass, so an in-place op further on cannot change them); ``X``: fused tail (forward, loss,
  backward seeded with ``loss_seed``; never recomputed, logits never leave the device); ``R``:
  recompute with autograd from a clone of the saved stage input (:mod:`~lightning_roundpipe.runtime.execution.carry`);
  ``B``: backward with the incoming gradient; after every ``X``/``B`` the microbatch's weight
  gradients are added into the stage's fp32 accumulator (:mod:`~lightning_roundpipe.runtime.host.grads`);
- ``D2H``: what ``F``/``X``/``B`` send to the host (boundary activations, the loss, input gradients),
  into host staging blocks;
- ``WD2H``: the stage's weight gradients (the fp32 accumulator, or ``view.grad`` where the compute
  dtype is fp32) into one host staging block, added into the masters' ``.grad`` by the host thread in
  backward-stage order (so the result does not depend on timing);
- ``DROP``: release the stage (after writing BatchNorm-like buffers back for forward stages).

Each device runs its layers on its own :class:`~lightning_roundpipe.runtime.execution.replica.LayerReplica`,
so no lock is shared between devices. A handler that raises makes the program raise in the main
thread with the original exception object (its type, attributes and traceback kept) and a note
(``add_note``) naming the device, op, stream, stage, microbatch and the layer's name in the model
(:mod:`~lightning_roundpipe.runtime.execution.errors`); the other threads stop at their next wait.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from lightning_roundpipe.adapters.base import LayerSequence
from lightning_roundpipe.adapters.chunked_loss import loss_only
from lightning_roundpipe.metrics.timeline import Interval, Timeline
from lightning_roundpipe.runtime.execution.access import in_bank, op_access, round_of
from lightning_roundpipe.runtime.backends.base import Backend, tree_nbytes
from lightning_roundpipe.runtime.execution.jitter import pause as jitter_pause
from lightning_roundpipe.runtime.backends.pool import HostStagingPool
from lightning_roundpipe.runtime.backends.threads import limit_this_thread
from lightning_roundpipe.runtime.execution.carry import diff_leaves, grad_leaves, grad_positions, snapshot
from lightning_roundpipe.runtime.execution.devices import StreamThread
from lightning_roundpipe.runtime.execution.errors import ErrorNotes
from lightning_roundpipe.runtime.execution.replica import HostAttributes, LayerReplica
from lightning_roundpipe.runtime.execution.residency import ResidencyOps, last_compute_ops, room_flushes
from lightning_roundpipe.runtime.execution.transfers import TransferOps
from lightning_roundpipe.runtime.replay.rng import layer_seed, rng_layers, rng_scope  # noqa: F401 (rng_layers: the engine's)
from lightning_roundpipe.runtime.replay.routing import routing_scope
from lightning_roundpipe.runtime.execution.run_state import _POLL_S, PipelineState, ProgramRun, _Aborted  # noqa: F401 (PipelineState: the engine's)
from lightning_roundpipe.runtime.host.pinned import collect as collect_pinned
from lightning_roundpipe.runtime.host.store import WeightStore
from lightning_roundpipe.schedule.lower import plan_dispatches
from lightning_roundpipe.schedule.program import STREAMS, Op, OpKind, StreamProgram

class Executor(TransferOps, ResidencyOps):
    """Runs stream programs of one :class:`LayerSequence` on a fixed set of device backends.

    Args:
        seq: the layer sequence.
        backends: one :class:`Backend` per device, ``backends[device_index]``.
        store: the :class:`WeightStore` of ``seq``'s layers.
        autocast_dtype: dtype of ``torch.autocast`` on the devices (``None``: no autocast).
    """

    def __init__(self, seq: LayerSequence, backends: list[Backend], store: WeightStore,
                 autocast_dtype: torch.dtype | None = None) -> None:
        self.seq = seq
        self.backends = backends
        self.store = store
        self.autocast_dtype = autocast_dtype
        self.profiler = None  # a runtime.profiler.LayerProfiler while profiling
        self.replicas = [[LayerReplica(layer) for layer in seq.layers] for _ in backends]
        self.attributes = HostAttributes(self.replicas)  # plain attributes set on the layers reach the replicas
        # CPU virtual devices own the cores: the host threads, busy while the devices compute, run on
        # one intra-op thread each (an OpenMP team would wait for cores the devices hold)
        setup = (lambda: limit_this_thread(1)) if backends and not any(b.is_cuda for b in backends) else None
        self.host = StreamThread("roundpipe-host-grads", setup)
        self.refresher = StreamThread("roundpipe-host-refresh", setup)
        self.error_notes = ErrorNotes(seq)
        self.host_pool = HostStagingPool(backends[0].allocate_host_bytes if backends else
                                         (lambda n: torch.empty(n, dtype=torch.uint8)))
        self._host_pools = [self.host_pool]
        self.in_flight: list[ProgramRun] = []
        """Runs started (:meth:`start`) and not yet finished (:meth:`finish`), oldest first: at most
        two, on different pool banks."""
        self.one_bank: str | None = None
        """Why programs no longer overlap (the second pool bank did not fit in a device's memory: the
        error), else ``None``."""
        self.expect_overlap = False
        """Set (for good) once a call may overlap the next: the second pool bank is then reserved with the
        first, before the first program (:meth:`~TransferOps._pools_for`)."""
        self.transfer_sizes: Callable[[StreamProgram], list[int] | None] | None = None
        """Main thread: the program's transfer slot sizes to reserve before it runs (the memory model's
        boundaries), else ``None`` (slots grow inside the first program)."""
        self.memory_check: Callable[[StreamProgram, PipelineState, int], str | None] | None = None
        """Main thread, before a program's pools are reserved: ``(program, state, banks) -> reason`` checks
        the memory model's per-device peak with ``banks`` pool banks against each device's budget; returns
        why a second bank does not fit (the run then uses one), or raises when one does not
        (:func:`~lightning_roundpipe.runtime.tuning.device_memory.check_budgets`)."""
        self.peak_grad_bytes = 0  # most bytes of gradients (.grad and host buffers) at once since the last pop
        self.grads_final_hook: Callable[[range, dict | None], None] | None = None
        """Host thread, after a backward stage's last dispatch of the program added its gradients
        into the masters' ``.grad``, or into ``state.grad_sink`` (fused path): called with the
        stage's layers and that sink (``None``: ``.grad``), whose entries for those layers are then
        complete for this backward (the data-parallel all-reduce starts there:
        :mod:`~lightning_roundpipe.runtime.host.allreduce`)."""
        self._dispatch: dict[OpKind, Callable[[Backend, Op, ProgramRun], int]] = {
            OpKind.LOAD: self._load, OpKind.H2D: self._h2d, OpKind.GH2D: self._gh2d,
            OpKind.F: self._forward, OpKind.X: self._fused, OpKind.R: self._recompute, OpKind.B: self._backward,
            OpKind.D2H: self._d2h, OpKind.WD2H: self._wd2h, OpKind.DROP: self._drop,
        }

    @property
    def current_run(self) -> "ProgramRun | None":
        """The program run in progress or last run (its ``issued`` flags show how far the host has
        issued); ``None`` once nothing references it."""
        ref = getattr(self, "_current", None)
        return ref() if ref is not None else None

    def pop_peak_grad_bytes(self) -> int:
        """Most bytes the gradients held at once during the programs since the last call: the
        masters' ``.grad`` plus the host gradient buffers (``WD2H`` downloads not yet added, the
        fused path's gradient buffers)."""
        out, self.peak_grad_bytes = self.peak_grad_bytes, 0
        return out

    def close(self) -> None:
        self.host.close()
        self.refresher.close()
        for backend in self.backends:
            backend.close()
        for pool in self._host_pools:
            pool.clear()
        collect_pinned()

    # ------------------------------------------------------------------ driver
    def run(self, program: StreamProgram, state: PipelineState) -> Timeline:
        """Execute ``program`` and return its measured timeline (:meth:`start`, then :meth:`finish`).

        Raises:
            The first exception of any stream: the original object (type, attributes, traceback),
            with a note naming the device, op, stream, stage, microbatch and layer.
            ``NotImplementedError`` for op kinds the runtime does not execute (``W``).
        """
        return self.finish(self.start(program, state))

    def start(self, program: StreamProgram, state: PipelineState) -> ProgramRun:
        """Issue ``program``'s stream jobs and return at once: its ops run behind those of a run still
        in flight on each (device, stream) (the stream threads take jobs in order), from the other
        pool bank, so the two never share a buffer. At most two runs are in flight: an older one is
        finished first; so is every run in flight when the weights' shadows are stale (the refresh
        must not overwrite what an earlier run uploads) or when plain attributes were set on the
        layers since the last start (they are then copied to the replicas: :class:`HostAttributes`).

        Raises:
            ``NotImplementedError`` for op kinds the runtime does not execute (``W``); the error of an
            older run finished here.
        """
        for _, _, _, op in program.ops():
            if op.kind not in self._dispatch:
                raise NotImplementedError(f"The runtime cannot execute `{op}` ({op.kind.value} ops are simulator-only).")
        while len(self.in_flight) >= 2:
            self.finish(self.in_flight[0])
        changes = self.attributes.changed()  # attributes set on the layers since the last program (SWA's momentum)
        if changes:  # the runs in flight (a forward and its recomputation) keep the values they started with
            while self.in_flight:
                self.finish(self.in_flight[0])
            self.attributes.push(changes)
        stale = self.store.stale_entries()  # raises here, in the main thread, for a parameter unfrozen too late
        if stale:
            while self.in_flight:
                self.finish(self.in_flight[0])
        if self.in_flight and self.one_bank is not None:
            while self.in_flight:
                self.finish(self.in_flight[0])
        bank = self._pools_for(program, state)
        checker = self.backends[0].checker if self.backends else None
        if checker is not None:
            if self.in_flight:
                checker.forget(bank)  # that bank's last program has completed; the other one runs on
                checker.program = program
            else:
                checker.reset(program)
        run = ProgramRun(program, state, len(self.backends), bank)
        run.master_grad_bytes = self.store.grad_bytes()  # main thread (see TransferOps._master_grad_bytes)
        run.shadow_bank = self.store.read_bank  # its uploads read this snapshot bank to the end
        pending = self.store.refresh_events  # a snapshot refresh off the main thread (asynchronous steady state)
        if pending is not None and pending[0] == run.shadow_bank:
            run.refreshed.update({key: event for key, event in pending[1].items() if not event.is_set()})
        self._current = weakref.ref(run)
        for backend in self.backends:
            backend.begin()
        refresh = self._start_refresh(program, stale, run) if stale else None  # before any LOAD is issued
        run.jobs = [backend.threads[stream].submit(lambda b=backend, s=stream: self._stream_job(b, s, run))
                    for backend in self.backends for stream in STREAMS if program.streams[backend.device_index][stream]]
        run.jobs.append(self.host.submit(lambda: self._commit_grads(run)))
        if refresh is not None:
            run.jobs.append(refresh)
        self.in_flight.append(run)
        return run

    def wait_ops(self, run: ProgramRun, ops: list[Op]) -> None:
        """Block until each of ``ops`` of ``run`` has completed on its device (its handler's host
        results published), or the run failed (its error is raised by :meth:`finish`)."""
        for op in ops:
            device_index, _, _ = run.program.location(op)
            while not run.issued[op].wait(_POLL_S):
                if run.abort.is_set():
                    return
            self.backends[device_index].host_wait(run.events[op])

    def finish(self, run: ProgramRun) -> Timeline:
        """Wait for ``run`` (started by :meth:`start`; older runs in flight are finished first) and
        return its measured timeline; the devices keep running a newer run in flight.

        Raises:
            As :meth:`run`. A failed run also stops the newer run in flight (its error, if any, is
            dropped: the older one is raised).
        """
        if run.done:  # finished already (by `start`, making room): its timeline, None if it failed
            return run.timeline
        while self.in_flight and self.in_flight[0] is not run:
            self.finish(self.in_flight[0])
        later = [other for other in self.in_flight if other is not run]
        checker = self.backends[0].checker if self.backends else None
        jobs = run.jobs
        try:
            self._wait_jobs(jobs, run)
            self._synchronize(run, later)  # the devices finish what the host issued (failed ops are skipped)
        except BaseException:  # KeyboardInterrupt in the main thread: stop the threads, then re-raise
            for other in [run] + later:
                other.abort.set()
            for other in [run] + later:
                for job in other.jobs:
                    job.wait(30)
            for backend in self.backends:
                backend.synchronize()
            for other in [run] + later:
                self._settle_pools(other, ok=False)
                other.done = True
            self.in_flight.clear()
            raise
        finally:
            run.done = True
            if run in self.in_flight:
                self.in_flight.remove(run)
            for backend in self.backends:  # its DROPs whose rooms no later compute of it reused
                if getattr(backend, "memory", None) is not None:
                    backend.memory.flush(prefix=id(run))
        for backend in self.backends:
            for error in backend.stream_errors():
                run.fail(error, f"RoundPipe: device {backend.device_index} stream worker")
        if run.error is not None and later:
            for other in later:  # the replicas are unbound below: the newer run cannot go on
                other.abort.set()
            for other in later:
                self._wait_jobs(other.jobs, other)
                self._settle_pools(other, ok=False)
                other.done = True
                self.in_flight.remove(other)
            for backend in self.backends:
                backend.synchronize()
            later = []
        if checker is not None and not later:
            checker.reset()  # everything issued has completed
        self._settle_pools(run, ok=run.error is None)
        if run.error is None:
            with torch.no_grad():
                for master, host in run.write_backs:  # the stages' buffers, downloaded at their DROPs
                    master.copy_(host)
        run.write_backs.clear()
        if run.profile_marks and run.error is None and self.profiler is not None:
            self._record_profile(run)
        self.peak_grad_bytes = max(self.peak_grad_bytes, run.peak_grad_bytes)
        collect_pinned()  # blocks the runs dropped (grown keyed blocks...): unregistered here, on this thread
        if run.error is not None:
            run.resident.clear()
            run.slots.clear()
            for replicas in self.replicas:  # stages the failed program never dropped: free their device buffers
                for replica in replicas:
                    replica.unbind_all()
            error, run.error = run.error, None  # no cycle run -> error -> traceback -> run: freed without gc
            error.add_note(run.error_context)
            try:
                raise error
            finally:
                del error
        wall = time.perf_counter() - run.t0
        intervals = []
        for device_index, op, span in run.spans:
            start, end = span()
            nbytes = run.nbytes.get(op, 0)
            kind = op.kind.value if op.kind.is_compute else ("H2D" if op.stream in ("weights", "h2d") else "D2H")
            intervals.append(Interval(device_index, kind, op.stage_index, op.microbatch_index, start - run.t0,
                                      end - run.t0, nbytes, stream=op.stream, label=str(op)))
        run.timeline = Timeline(len(self.backends), intervals, wall_s=wall,
                                peak_resident_bytes=run.peak_resident_bytes, origin_s=run.t0)
        return run.timeline

    def _synchronize(self, run: ProgramRun, later: list[ProgramRun]) -> None:
        """Wait until the devices completed ``run``'s issued ops: every device, when no newer run is in
        flight; else the last issued op of each of ``run``'s (device, stream) lists (streams run in order)."""
        if not later:
            for backend in self.backends:
                backend.synchronize()
            return
        for backend in self.backends:
            for stream in STREAMS:
                issued = [op for op in run.program.streams[backend.device_index][stream] if op in run.events]
                if issued:
                    backend.host_wait(run.events[issued[-1]])

    def _wait_jobs(self, jobs: list, run: ProgramRun) -> None:
        for job in jobs:
            while not job.wait(_POLL_S):
                if not all(b.alive for b in self.backends) or not self.host.alive or not self.refresher.alive:
                    run.fail(RuntimeError("a RoundPipe stream thread died"), "RoundPipe: runtime")

    def _stream_job(self, backend: Backend, stream: str, run: ProgramRun) -> None:
        """The issuing thread of one (device, stream): for each op, wait until its producers are
        issued, make the stream wait for their events, enqueue the op, record its event. It never
        waits for the device."""
        op = None
        deps = run.program.deps
        num_layers, keep = len(self.seq.layers), run.state.keep
        try:
            with backend.stream_context(stream):
                for op in run.program.streams[backend.device_index][stream]:
                    if run.abort.is_set():
                        return
                    for dep in deps.get(op, ()):
                        run.wait(run.issued[dep])
                        event = run.events.get(dep)
                        if event is not None:
                            backend.wait_event(stream, event)
                    if op.kind is OpKind.LOAD and op.chunk_index == 0 and run.refreshed:
                        # the host refreshes the shadows off the main thread, in upload order: this
                        # upload waits for its own stage's tensors only
                        for key in self.store.layout(run.plan.stages[op.stage_index].layers).tensors:
                            if key in run.refreshed:
                                run.wait(run.refreshed[key])
                    access = in_bank(op_access(run.program, op, backend.device_index, num_layers, keep), run.bank) \
                        if backend.checker is not None else None
                    jitter_pause()
                    start = backend.timer_start(stream)
                    backend.launch(stream, lambda op=op: self._execute(backend, stream, op, run), access,
                                   str(op), op)
                    run.events[op] = backend.record(stream)
                    if op.kind is not OpKind.DROP:
                        run.spans.append((backend.device_index, op, backend.timer_span(stream, start)))
                    run.issued[op].set()
        except _Aborted:
            return
        except BaseException as error:
            run.fail(error, self.error_notes.note(error, backend.device_index, str(backend.device), op, stream,
                                                  run.plan.stages[op.stage_index], self.replicas[backend.device_index]))

    def _execute(self, backend: Backend, stream: str, op: Op, run: ProgramRun) -> None:
        """One op's work, where the driver runs it (CUDA: the issuing thread enqueuing kernels; CPU:
        the stream's worker). After a failure anywhere, later ops do nothing (their events still
        complete, so nothing waits forever)."""
        if run.abort.is_set():
            return
        memory = getattr(backend, "memory", None)
        deferred = contextlib.nullcontext()
        if memory is not None:  # CPU virtual devices: what a DROP frees is charged until the program orders it free
            if op.kind is OpKind.DROP:
                deferred = memory.deferring((id(run), op.stage_index, op.round_index))
            elif stream == "compute":
                room = room_flushes(run.program).get((backend.device_index, op))
                if room is not None:
                    memory.flush((id(run), *room))
        try:
            with backend.op_scope(stream, f"stage {op.stage_index}, {op}"), deferred:
                run.nbytes[op] = self._dispatch[op.kind](backend, op, run) or 0
                if stream == "compute" and self.store.dequantised_weights and op in last_compute_ops(run.program):
                    self._release_dequantised(backend, op, run)
        except _Aborted:
            return
        except BaseException as error:
            run.fail(error, self.error_notes.note(error, backend.device_index, str(backend.device), op, stream,
                                                  run.plan.stages[op.stage_index], self.replicas[backend.device_index]))

    def _commit_grads(self, run: ProgramRun) -> None:
        """Host thread: add each backward dispatch's gradients, in (round, backward stage) order."""
        try:
            order = {s.stage_index: i for i, s in enumerate(run.plan.backward_stages)}
            dispatches = sorted((d for d in plan_dispatches(run.plan) if d.stage_index in order),
                                key=lambda d: (d.round_index, order[d.stage_index]))
            last_round: dict[int, int] = {}
            for dispatch in dispatches:
                last_round[dispatch.stage_index] = max(last_round.get(dispatch.stage_index, -1), dispatch.round_index)
            hook = self.grads_final_hook
            for dispatch in dispatches:
                op = Op(OpKind.WD2H, dispatch.stage_index, None, None, dispatch.round_index)
                run.wait(run.issued[op])
                event = run.events.get(op)
                if event is not None:
                    self.backends[dispatch.device_index].host_wait(event)
                jitter_pause()
                pairs = run.host_grads.pop((dispatch.stage_index, dispatch.round_index), [])
                retained = self.store.add_grads(pairs, run.state.grad_sink)
                run.add_grad_buffer_bytes(retained - sum(g.numel() * g.element_size() for _, g in pairs),
                                          self._master_grad_bytes(run))
                if hook is not None and dispatch.round_index == last_round[dispatch.stage_index]:
                    hook(run.plan.stages[dispatch.stage_index].layers, run.state.grad_sink)
        except _Aborted:
            return
        except BaseException as error:
            run.fail(error, "RoundPipe: host gradient accumulation")

    # ------------------------------------------------------------------ helpers
    def _autocast(self, backend: Backend):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=backend.device.type, dtype=self.autocast_dtype)

    def _call_layers(self, backend: Backend, run: ProgramRun, stage_key: tuple[int, int], layers: range, carry: Any,
                     mb: int, on_boundary: Callable[[int, Any], None] | None = None,
                     profile_kind: str | None = None, replay: bool = False) -> tuple[Any, dict[int, float]]:
        """Run ``layers`` on ``carry`` with this device's replicas; returns the output and, when
        profiling, seconds per layer. Routing layers run inside a routing scope: recorded, or
        with ``replay`` (recomputation) replayed."""
        state = run.state
        resident = run.resident[stage_key]
        replicas = self.replicas[backend.device_index]
        prof = self.profiler if (self.profiler is not None and self.profiler.enabled and profile_kind) else None
        marks: dict[int, tuple[Any, Any]] = {}
        routing = self.seq.routing.layers if self.seq.routing is not None else frozenset()
        for li in layers:
            if on_boundary is not None and li != layers.start and li in state.keep:
                on_boundary(li, carry)
            module = replicas[li].bind(resident.layer_tensors(li), resident.layer_attributes(li))
            seed = layer_seed(state.base_seed, li, mb) if li in state.rng_layers else None
            if prof is not None:
                prof.record_activation(li, tree_nbytes(carry))
                started = backend.mark()
            store = state.routing if li in routing else None
            with rng_scope(seed, backend.device, li), routing_scope(store, li, mb, replay, backend.device, run.wait):
                carry = module(carry)
            if prof is not None:
                marks[li] = (started, backend.mark())
        if prof is not None:
            run.profile_marks.append((backend, profile_kind, marks, None))
        return carry, marks

    @staticmethod
    def _stage_key(run: ProgramRun, op: Op) -> tuple[int, int]:
        return op.stage_index, round_of(run.program)[(op.stage_index, op.microbatch_index)]

    def _leaves(self, carry: Any, start: int, run: ProgramRun) -> tuple[Any, list[torch.Tensor]]:
        """The carry a recomputation starts from (clones of fresh leaves: in-place safe) and the leaves."""
        if start > 0:
            return grad_leaves(carry, self.seq.grad_keys)
        if run.state.input_grad_positions:
            return grad_positions(carry, run.state.input_grad_positions)
        return carry, []

    # ------------------------------------------------------------------ compute
    def _forward(self, backend: Backend, op: Op, run: ProgramRun) -> int:
        spec = run.plan.stages[op.stage_index]
        m = op.microbatch_index
        carry = run.slots.pop(("in", op.stage_index, m))
        saved: dict[int, Any] = {}

        def on_boundary(layer_index: int, boundary: Any) -> None:  # a later in-place op must not reach it
            saved[layer_index] = snapshot(boundary)

        with torch.no_grad(), self._autocast(backend):
            carry, _ = self._call_layers(backend, run, self._stage_key(run, op), spec.layers, carry, m,
                                         on_boundary=on_boundary, profile_kind="forward")
        run.slots[("out", op.stage_index, m)] = ("F", (carry, saved))
        return 0

    def _fused(self, backend: Backend, op: Op, run: ProgramRun) -> int:
        """``X``: forward of the last layers and the loss, then backward seeded with ``loss_seed``."""
        spec = run.plan.stages[op.stage_index]
        m = op.microbatch_index
        carry, leaves = self._leaves(run.slots.pop(("in", op.stage_index, m)), spec.layers.start, run)
        with torch.enable_grad():
            with self._autocast(backend), loss_only():  # nobody reads the fused tail's logits: chunked loss
                out, layer_s = self._call_layers(backend, run, self._stage_key(run, op), spec.layers, carry, m,
                                                 profile_kind="forward")
            loss = out[self.seq.loss_key]
            self._backprop([(loss, torch.full_like(loss, run.state.loss_seed))], layer_s, backend, run)
        self._accumulate(run, op)
        grads = [leaf.grad for leaf in leaves] if leaves else None
        run.slots[("out", op.stage_index, m)] = ("X", (loss.detach(), grads))
        return 0

    def _recompute(self, backend: Backend, op: Op, run: ProgramRun) -> int:
        spec = run.plan.stages[op.stage_index]
        m = op.microbatch_index
        carry, leaves = self._leaves(run.slots.pop(("in", op.stage_index, m)), spec.layers.start, run)
        with torch.enable_grad(), self._autocast(backend):
            out, layer_s = self._call_layers(backend, run, self._stage_key(run, op), spec.layers, carry, m,
                                             profile_kind="recompute", replay=True)
        run.slots[("graph", op.stage_index, m)] = (out, leaves, layer_s)
        return 0

    def _backward(self, backend: Backend, op: Op, run: ProgramRun) -> int:
        spec = run.plan.stages[op.stage_index]
        m = op.microbatch_index
        out, leaves, layer_s = run.slots.pop(("graph", op.stage_index, m))
        incoming = run.slots.pop(("gin", op.stage_index, m))
        last = spec.layers.stop == len(self.seq.layers)
        outs = pytree.tree_leaves(out) if last else diff_leaves(out, self.seq.grad_keys)
        pairs = [(o, g.to(o.dtype)) for o, g in zip(outs, incoming)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        with torch.enable_grad():
            self._backprop(pairs, layer_s, backend, run)
        self._accumulate(run, op)
        run.slots[("out", op.stage_index, m)] = ("B", (None, [leaf.grad for leaf in leaves] if leaves else None))
        return 0

    def _accumulate(self, run: ProgramRun, op: Op) -> None:
        """After a microbatch's backward: its low-precision weight gradients into the stage's fp32
        accumulator (compute stream), so the sum over microbatches is fp32."""
        accumulator = run.resident[self._stage_key(run, op)].accumulator
        if accumulator is not None:
            accumulator.add()

    def _backprop(self, pairs: list, layer_marks: dict, backend: Backend, run: ProgramRun) -> None:
        started = backend.mark() if layer_marks else None
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if layer_marks:  # profiling: split the backward over the stage's layers like their forward
            run.profile_marks.append((backend, "backward", layer_marks, (started, backend.mark())))

    def _record_profile(self, run: ProgramRun) -> None:
        """After the devices synchronised: the layer times the marks measured (device events on CUDA,
        so no host launch time is counted) into the profiler; a backward is split over its layers in
        proportion to their forward (recompute) times."""
        for backend, kind, marks, whole in run.profile_marks:
            seconds = {li: backend.elapsed_s(*pair) for li, pair in marks.items()}
            if whole is None:
                for li, sec in seconds.items():
                    self.profiler.record(kind, li, sec, backend.device_index)
                continue
            total, forward = backend.elapsed_s(*whole), sum(seconds.values()) or 1.0
            for li, sec in seconds.items():
                self.profiler.record("backward", li, total * sec / forward, backend.device_index)
        run.profile_marks.clear()
