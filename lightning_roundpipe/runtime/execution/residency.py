"""The weight residency ops' handlers of the executor: a stage's weights on a device from ``LOAD`` to ``DROP``.

:class:`ResidencyOps` is a part of :class:`~lightning_roundpipe.runtime.execution.executor.Executor`:

- ``LOAD``: at chunk 0 the stage's buffer is taken from the pool slot the program gives the dispatch
  (:func:`~lightning_roundpipe.runtime.backends.pool.pool_slots`), with its fp32 gradient accumulator
  for a backward stage, and becomes a :class:`~lightning_roundpipe.runtime.host.layout.ResidentStage`;
  each chunk (at most ``program.chunk_bytes`` bytes) is copied from the host shadows into it;
- after a stage's last compute op of its residency (:func:`last_compute_ops`): its fp8 weights'
  dequantised copies are unbound and freed, so a device holds one stage's copies at a time;
- ``DROP``: a training forward stage's persistent buffers (BatchNorm statistics) go back to the host,
  the replicas unbind the stage's tensors and its buffers' own copies go back to the allocator.
"""

from __future__ import annotations

from lightning_roundpipe.runtime.backends.base import Backend
from lightning_roundpipe.runtime.backends.pool import pool_slots
from lightning_roundpipe.runtime.execution.access import round_of
from lightning_roundpipe.runtime.execution.run_state import ProgramRun
from lightning_roundpipe.schedule.lower import plan_dispatches
from lightning_roundpipe.schedule.program import Op, StreamProgram


class ResidencyOps:
    """Handlers of ``LOAD`` and ``DROP``, and the release of fp8 dequantised weights (mixin of the executor:
    uses ``self.seq``, ``self.store``, ``self.replicas``, ``self._stage_key`` and
    :meth:`~lightning_roundpipe.runtime.execution.transfers.TransferOps._write_back`)."""

    def _load(self, backend: Backend, op: Op, run: ProgramRun) -> int:
        spec = run.plan.stages[op.stage_index]
        layout = self.store.layout(spec.layers)
        key = (op.stage_index, op.round_index)
        if op.chunk_index == 0:  # the pool slot the program gives this dispatch (its release was waited for)
            slot = pool_slots(run.plan)[(backend.device_index, *key)]
            pools = backend.bank(run.bank)
            buffer = pools.pool.buffer(slot)[:layout.total_bytes]
            backend.poison(buffer)
            accumulate = self.store.accumulator_numel(spec.layers) * 4 if spec.kind == "backward" else 0
            run.resident[key] = self.store.resident(  # the fp32 accumulator of the same slot (reserved)
                layout, buffer, with_grad=spec.kind == "backward",
                accumulator_buffer=pools.accumulator_pool.take(slot, accumulate) if accumulate else None)
            run.add_resident(backend.device_index, layout.total_bytes)
        resident = run.resident[key]
        start = op.chunk_index * run.program.chunk_bytes
        stop = min(start + run.program.chunk_bytes, layout.total_bytes)
        if stop > start:
            backend.copy_chunk(self.store.chunk_pieces(layout, resident.buffer, start, stop, run.shadow_bank),
                               stop - start)
        if stop >= layout.total_bytes:
            self.store.own_buffers(resident)  # made here, read by compute: released after the DROP (below)
        return max(0, stop - start)

    def _drop(self, backend: Backend, op: Op, run: ProgramRun) -> int:
        resident = run.resident.pop((op.stage_index, op.round_index))
        spec = run.plan.stages[op.stage_index]
        saved = self.store.written_back(resident)
        if (spec.kind == "forward" or spec.fused) and saved and any(
                self.seq.layers[li].training for li in spec.layers):
            # persistent buffers (BatchNorm statistics) go down on this stream into pinned host memory, and
            # reach the masters after the program (no blocking D2H into pageable memory inside the worker)
            masters = [master for master, _ in saved]
            self._write_back(backend, op, run, saved, lambda host: run.write_backs.extend(zip(masters, host)))
        replicas = self.replicas[backend.device_index]
        for li in spec.layers:  # the replicas must not keep the dropped buffer alive
            replicas[li].unbind(resident.layer_tensors(li), resident.layer_attributes(li))
        # the buffers' own copies (made on the weights stream, read by compute, downloaded above) go
        # back to the allocator once this op's stream has passed them (CUDA; no record_stream)
        backend.release_after([view for _, view in resident.buffer_pairs], "d2h")
        with run._lock:
            run.resident_bytes[backend.device_index] -= resident.nbytes
        return 0

    def _release_dequantised(self, backend: Backend, op: Op, run: ProgramRun) -> None:
        """After a stage's last compute op of its residency: unbind and free its fp8 weights' dequantised
        copies (:meth:`~lightning_roundpipe.runtime.host.layout.ResidentStage.release_dequantised`), so a
        device holds one stage's copies at a time (the memory model counts one)."""
        resident = run.resident.get(self._stage_key(run, op))
        if resident is None or not resident.quantised or resident.released:
            return
        replicas = self.replicas[backend.device_index]
        for li in run.plan.stages[op.stage_index].layers:
            replicas[li].unbind(resident.layer_tensors(li), resident.layer_attributes(li))
        resident.release_dequantised()


def last_compute_ops(program: StreamProgram) -> frozenset[Op]:
    """Per device, the last op of each (stage, round) residency on its ``compute`` stream (cached on the plan)."""
    cache = program.plan._meta.setdefault("_last_compute_ops", {})
    held = cache.get(id(program))
    got = held[1] if held is not None and held[0] is program else None
    if got is None:
        rounds = round_of(program)
        last: dict[tuple[int, int, int], Op] = {}
        for device_index, streams in enumerate(program.streams):
            for op in streams["compute"]:
                if op.microbatch_index is not None:
                    last[(device_index, op.stage_index, rounds[(op.stage_index, op.microbatch_index)])] = op
        got = frozenset(last.values())
        cache[id(program)] = (program, got)
    return got


def room_flushes(program: StreamProgram) -> dict[tuple[int, Op], tuple[int, int]]:
    """``(device_index, op) -> (stage_index, round_index)``: the first compute op of each dispatch whose
    ``LOAD`` reuses the room a ``DROP`` released (the program orders it after that ``DROP``: the LOAD's
    first chunk waits for it, the compute for the LOAD). What the ``DROP`` freed (the stage's
    gradients, its buffers' copies) is released from a CPU virtual device's memory ledger there
    (:meth:`~lightning_roundpipe.runtime.backends.budget.DeviceMemoryLedger.deferring`). Cached on the plan."""
    cache = program.plan._meta.setdefault("_room_flushes", {})
    held = cache.get(id(program))
    if held is not None and held[0] is program:
        return held[1]
    out: dict[tuple[int, Op], tuple[int, int]] = {}
    for dispatch in plan_dispatches(program.plan):
        if dispatch.room is None or not dispatch.computes:
            continue
        first = dispatch.computes[0]
        for op in program.streams[dispatch.device_index]["compute"]:
            if (op.stage_index, op.microbatch_index) == (first.stage_index, first.microbatch_index):
                out[(dispatch.device_index, op)] = dispatch.room
                break
    cache[id(program)] = (program, out)
    return out
