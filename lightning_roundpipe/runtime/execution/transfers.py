"""The transfer ops' handlers of the executor, over the pooled buffers (DESIGN.md section 4).

:class:`TransferOps` is a part of :class:`~lightning_roundpipe.runtime.execution.executor.Executor`:

- ``H2D`` / ``GH2D``: the host pytree goes into the op's device transfer slot (the program gives
  it: :func:`~lightning_roundpipe.schedule.buffers.device_slots`); sources the driver cannot
  upload asynchronously (pageable memory on CUDA: the batch, Lightning's output gradients) are
  first copied into a pinned staging block keyed by the op's content;
- ``D2H``: each host content (a boundary, a saved boundary, an input gradient, the loss) goes into
  its host staging slot when only this program reads it, else into a keyed block
  (:class:`~lightning_roundpipe.runtime.backends.pool.HostStagingPool`);
- ``WD2H``: the stage's weight gradients into one keyed block, ``("wgrad", stage_index, round_index)``;
  the host thread adds it into ``.grad`` (a first gradient becomes ``.grad`` itself: the block is
  reused once that ``.grad`` is gone);
- after the program (:meth:`TransferOps._settle_pools`): every device's transfer slot ``k`` and every
  host slot grow to the largest content measured in them, so the next programs allocate nothing.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from lightning_roundpipe.runtime.backends.base import Backend
from lightning_roundpipe.runtime.backends.budget import pool_slots_text
from lightning_roundpipe.runtime.execution.jitter import pause as jitter_pause
from lightning_roundpipe.runtime.backends.pool import HostStagingPool, pack, packed_nbytes, pool_slots
from lightning_roundpipe.schedule.buffers import device_slots, host_slots, slot_sizes
from lightning_roundpipe.runtime.execution.run_state import ProgramRun
from lightning_roundpipe.schedule.program import Op, OpKind, StreamProgram


class TransferOps:
    """Handlers of ``H2D``, ``GH2D``, ``D2H`` and ``WD2H``, and the pools' sizing (mixin of the executor:
    uses ``self.seq``, ``self.store``, ``self.backends`` and ``self.host_pool``)."""

    host_pool: HostStagingPool
    _host_pools: list[HostStagingPool]  # by pool bank: [host_pool, bank 1's]

    # ------------------------------------------------------------------ pools
    def host_pool_of(self, bank: int) -> HostStagingPool:
        """The host staging pool of pool bank ``bank`` (bank 0: ``self.host_pool``; bank 1 made on first use)."""
        pools = self._host_pools
        while len(pools) <= bank:
            pools.append(HostStagingPool(pools[0]._allocate))
        return pools[bank]

    def _master_grad_bytes(self, run: ProgramRun) -> int:
        """Bytes of the masters' ``.grad`` for the peak accounting, read on a stream or host thread. A
        fused run (gradients into ``state.grad_sink``) never writes ``.grad``, and the main thread may
        set it meanwhile (an overlapped run: ``zero_grad``, the previous batch's gradients): reading
        ``.grad`` from another thread while the main thread replaces it is not safe in torch (a
        dangling reference), so such a run uses the bytes taken on the main thread at its start."""
        if run.state.grad_sink is not None:
            return run.master_grad_bytes
        return self.store.grad_bytes()

    def _pools_for(self, program: StreamProgram, state: Any) -> int:
        """Before a program is issued (main thread; at most one run in flight, on the other bank): check
        the memory model, reserve the program's pools and return the bank it runs on.

        The model (``memory_check``) counts two banks when this program overlaps a run in flight, or
        will be overlapped (``expect_overlap``); when two do not fit and one does, the run falls back to
        one bank before anything of the second is allocated (``one_bank`` says why; the engine says so
        once). The second bank is reserved eagerly with the first (stage slots and accumulators as
        bank 0's, transfer slots sized from bank 0's), before the first program; an out-of-memory error
        reserving it falls back to one bank too.

        Raises:
            PlanMemoryError / torch.OutOfMemoryError: one bank does not fit a device.
        """
        bank = 1 - self.in_flight[-1].bank if self.in_flight else 0
        overlapped = self.one_bank is None and (bank == 1 or self.expect_overlap or len(self.backends[0].banks) > 1)
        if self.memory_check is not None:  # the memory model, before anything of this program is allocated
            reason = self.memory_check(program, state, 2 if overlapped else 1)
            if reason is not None and overlapped:
                self.one_bank = reason
        if bank == 1 and self.one_bank is None:
            try:
                self._reserve_pools(program, state.keep, 1)
            except torch.OutOfMemoryError as error:
                self.one_bank = f"{type(error).__name__}: {error}"
        if self.one_bank is not None and (bank == 1 or len(self.backends[0].banks) > 1):
            # the second bank does not fit: free it (outside any handler: a traceback would hold the new
            # buffers), finish the run in flight, and from now on run one program at a time (the overlap
            # costs a second set of pools; DESIGN.md section 4)
            while self.in_flight:
                self.finish(self.in_flight[0])
            for backend in self.backends:
                del backend.banks[1:]
            bank = 0
        if bank == 0:
            self._reserve_pools(program, state.keep, 0)
            if overlapped and self.one_bank is None and len(self.backends[0].banks) == 1:
                try:  # eagerly, sized from bank 0, before the first program that needs it
                    self._reserve_pools(program, state.keep, 1, from_bank=0)
                except torch.OutOfMemoryError as error:
                    self.one_bank = f"{type(error).__name__}: {error}"
                if self.one_bank is not None:
                    for backend in self.backends:
                        del backend.banks[1:]
        return bank

    def _reserve_pools(self, program: StreamProgram, keep: frozenset, bank: int = 0, from_bank: int | None = None) -> None:
        """Before a program is issued: every device's stage pool has a slot per stage it holds at once,
        each as large as the program's largest stage, and as many fp32 gradient accumulators, each as
        large as the largest backward stage's (allocated only when that grows); the transfers' slot
        assignment is made here, on the main thread (cached on the program). A plan that keeps stages
        off devices whose memory cannot hold them (``plan._meta["stage_devices"]``, the weighted
        dispatch on devices of unequal memory) sizes each device's slots to the largest stage it may hold."""
        device_slots(program)
        host_slots(program, len(self.seq.layers), keep)
        slots = pool_slots(program.plan)
        stages = program.plan.stages
        allowed = program.plan._meta.get("stage_devices")
        sizes = {s: self.store.layout(stages[s].layers).total_bytes for _, s, _ in slots}
        count = max(slots.values(), default=-1) + 1  # every device the same (a rotated plan swaps devices)
        for backend in self.backends:
            if any(d == backend.device_index for d, _, _ in slots):
                mine = [s for s in sizes if allowed is None or backend.device_index in allowed[s]]
                largest = max(mine, key=sizes.get)
                accumulate = max((self.store.accumulator_numel(stages[s].layers) * 4 for s in mine
                                  if stages[s].kind == "backward"), default=0)
                spec = stages[largest]
                pools = backend.bank(bank)
                backend.pool_label = (f"the stage weight pool{f' (bank {bank})' if bank else ''}, before any LOAD:"
                                      f" {pool_slots_text(count)} of {sizes[largest]} bytes for the largest stage,"
                                      f" {spec.describe()}")
                with backend.stream_context("weights"):  # the stream that fills them
                    pools.pool.reserve(count, sizes[largest])
                if accumulate:
                    with backend.stream_context("compute"):
                        pools.accumulator_pool.ensure([accumulate] * count)
        transfers = self.transfer_sizes(program) if self.transfer_sizes is not None else None
        for backend in self.backends:
            wanted = list(transfers or [])
            if from_bank is not None:  # sized from the other bank's slots (what its programs measured)
                held = [0 if b is None else b.numel() for b in backend.bank(from_bank).transfer_pool.buffers]
                count = max(len(wanted), len(held))
                wanted = [max(x, y) for x, y in zip(wanted + [0] * (count - len(wanted)), held + [0] * (count - len(held)))]
            if wanted:
                with backend.stream_context("h2d"):  # the stream that fills them, before the first program
                    backend.bank(bank).transfer_pool.ensure(wanted)

    def _settle_pools(self, run: ProgramRun, ok: bool) -> None:
        """After a program has completed: free the buffers that grew during it and, when it ran, size
        every device's transfer slot ``k`` and every host staging slot to the largest content
        measured there (the same sizes on every device: a rotated plan uses the same slots). Only the
        run's own pool bank: a program of the other bank may still be in flight."""
        host_pool = self.host_pool_of(run.bank)
        if ok:
            devices = device_slots(run.program)
            sizes = slot_sizes(devices, run.device_bytes)
            for backend in self.backends:
                backend.bank(run.bank).transfer_pool.ensure(sizes)
            hosted, _ = host_slots(run.program, len(self.seq.layers), run.state.keep)
            host_pool.slots.ensure(slot_sizes([hosted], run.host_bytes))
        for backend in self.backends:
            backend.bank(run.bank).transfer_pool.end_program()
            backend.bank(run.bank).accumulator_pool.end_program()
        host_pool.end_program()

    def pool_allocations(self) -> dict[str, int]:
        """Allocations every pool has made since the executor started, summed over devices: ``stage
        weights``, ``transfers``, ``accumulators`` (device pools) and ``host staging``."""
        out: dict[str, int] = {}
        for backend in self.backends:
            for name, pool in backend.pools.items():
                out[name] = out.get(name, 0) + pool.allocations
        out["host staging"] = sum(pool.allocations for pool in self._host_pools)
        return out

    # ------------------------------------------------------------------ uploads
    def _upload(self, backend: Backend, op: Op, run: ProgramRun, tree: Any, content: tuple) -> int:
        nbytes = packed_nbytes(tree)
        run.device_bytes[content] = nbytes
        slot = device_slots(run.program)[backend.device_index].slots[content]
        buffer = backend.bank(run.bank).transfer_pool.take(slot, nbytes)

        def stage(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
            pageable = [src for _, src in pairs if backend.needs_staging(src)]
            if not pageable:
                return pairs
            block = self.host_pool_of(run.bank).keyed(("upload",) + content, packed_nbytes(pageable))
            staged, copies = pack(pageable, block)
            for view, src in copies:  # host memcpy now; the upload itself is asynchronous
                view.copy_(src)
            by_source = {id(src): view for src, view in zip(pageable, staged)}
            return [(dst, by_source.get(id(src), src)) for dst, src in pairs]

        return backend.to_device(tree, lambda t: run.slots.__setitem__(content, t), buffer, stage)

    def _h2d(self, backend: Backend, op: Op, run: ProgramRun) -> int:
        spec = run.plan.stages[op.stage_index]
        carry = run.take_input(spec.layers.start, op.microbatch_index)
        return self._upload(backend, op, run, carry, ("in", op.stage_index, op.microbatch_index))

    def _gh2d(self, backend: Backend, op: Op, run: ProgramRun) -> int:
        state = run.state
        spec = run.plan.stages[op.stage_index]
        m = op.microbatch_index
        last = spec.layers.stop == len(self.seq.layers)
        # a boundary without float tensors (say an argmax between layers) carries no gradient:
        # nothing is published for it, and the stage's backward has nothing to propagate
        incoming = state.final_grads[m] if last else (state.grads.pop((spec.layers.stop, m), None) or [])
        return self._upload(backend, op, run, incoming, ("gin", op.stage_index, m))

    # ------------------------------------------------------------------ downloads
    def _host_block(self, run: ProgramRun, content: tuple, tree: Any) -> torch.Tensor:
        """The host staging memory ``content`` is downloaded into: its slot when only this program
        reads it, else a keyed block."""
        nbytes = packed_nbytes(tree)
        hosted, _ = host_slots(run.program, len(self.seq.layers), run.state.keep)
        slot = hosted.slots.get(content)
        if slot is None:
            return self.host_pool_of(run.bank).keyed(content, nbytes)
        run.host_bytes[content] = nbytes
        return self.host_pool_of(run.bank).slots.take(slot, nbytes)

    def _d2h(self, backend: Backend, op: Op, run: ProgramRun) -> int:
        state = run.state
        spec = run.plan.stages[op.stage_index]
        m = op.microbatch_index
        kind, payload = run.slots.pop(("out", op.stage_index, m))
        if kind == "F":
            out, saved = payload
            last = spec.layers.stop == len(self.seq.layers)
            keys = [("final", m) if last else ("act", spec.layers.stop, m)] + [("act", li, m) for li in saved]
            trees = [out] + list(saved.values())

            def publish(host: list) -> None:
                for key, tree in zip(keys, host):
                    if key[0] == "final":
                        state.final[m] = tree
                    else:
                        state.acts[key[1:]] = tree
        else:
            loss, grads = payload
            keys, trees = [], []
            if grads is not None:
                keys.append(("grad", spec.layers.start, m))
                trees.append(grads)
            if loss is not None:
                keys.append(("final", m))
                trees.append(loss)

            def publish(host: list) -> None:
                for key, tree in zip(keys, host):
                    if key[0] == "grad":
                        state.grads[key[1:]] = tree
                    else:
                        state.final[m] = {self.seq.loss_key: tree}
        parts = [(tree, self._host_block(run, key, tree)) for key, tree in zip(keys, trees)]
        return backend.to_host(parts, publish)

    def _start_refresh(self, program: StreamProgram, stale: list[int], run: ProgramRun) -> threading.Event:
        """Copy the stale shadows from their masters on the refresh thread, tensor by tensor in the
        order the program first uploads them (the rest last), each with an event the uploads of its
        stages wait for (DESIGN.md section 4: the refresh after an optimizer step runs off the main
        thread). Returns the job's done event."""
        order: list[int] = []
        wanted, seen = set(stale), set()
        for op in program.topological_order():
            if op.kind is OpKind.LOAD and op.chunk_index == 0:
                for key in self.store.layout(program.plan.stages[op.stage_index].layers).tensors:
                    if key in wanted and key not in seen:
                        seen.add(key)
                        order.append(key)
        order += [key for key in stale if key not in seen]
        events = {key: threading.Event() for key in order}
        run.refreshed.update(events)

        def refresh() -> None:
            try:
                for key in order:
                    if run.abort.is_set():
                        return
                    jitter_pause()
                    self.store.refresh_entry(key)
                    events[key].set()
            except BaseException as error:
                run.fail(error, "RoundPipe: host weight refresh (master -> upload copy)")
            finally:
                for event in events.values():
                    event.set()

        return self.refresher.submit(refresh)

    def _wd2h(self, backend: Backend, op: Op, run: ProgramRun) -> int:
        """The stage's weight gradients to the host: ``view.grad`` of fp32 views (autograd summed
        the microbatches) and the fp32 accumulator of the narrower ones, in one keyed block."""
        resident = run.resident[(op.stage_index, op.round_index)]
        direct = [(master, view.grad) for master, view in resident.grad_pairs if view.grad is not None]
        accumulator = resident.accumulator
        tensors = [g for _, g in direct]
        if accumulator is not None and accumulator.flat is not None:
            tensors.append(accumulator.flat)
        if not tensors:
            return 0
        block = self.host_pool_of(run.bank).keyed(("wgrad", op.stage_index, op.round_index), packed_nbytes(tensors))
        received: list = []
        nbytes = backend.to_host([(tensors, block)], received.extend, gradients=True)
        host = received[0]
        pairs = [(master, g) for (master, _), g in zip(direct, host)]
        if accumulator is not None and accumulator.flat is not None:
            pairs += accumulator.host_pairs(host[-1])
        run.host_grads[(op.stage_index, op.round_index)] = pairs
        run.add_grad_buffer_bytes(sum(g.numel() * g.element_size() for _, g in pairs),
                                  self._master_grad_bytes(run))
        return nbytes

    def _write_back(self, backend: Backend, op: Op, run: ProgramRun, pairs: list, publish: Callable) -> None:
        """At a training forward stage's ``DROP``: its buffers (BatchNorm statistics) to a keyed host
        block, copied into the masters after the program."""
        views = [view for _, view in pairs]
        block = self.host_pool_of(run.bank).keyed(("buffers", op.stage_index, op.round_index), packed_nbytes(views))
        backend.to_host([(views, block)], lambda host: publish(host[0]))
