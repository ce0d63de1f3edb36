"""The fused path's call, and the overlap of accumulated batches (DESIGN.md section 11, sync mode).

With ``accumulate_grad_batches > 1`` the weights do not change between the batches of one optimizer
step, so batch ``i + 1``'s program may be issued while batch ``i``'s backward stages still drain:

- a call the strategy marks as overlappable (:attr:`RoundPipeEngine.overlap_next`: a batch that does
  not step the optimizer, in ``"sync"`` mode, with no hook reading gradients at its backward) starts
  its program (:meth:`Executor.start`), waits only for the fused tail's losses, and returns; its
  loss's backward records the incoming gradient and returns without waiting for the drain;
- the next call starts its program on the other pool bank, behind the first on every (device,
  stream): each device runs the next batch's forward stages as soon as its part of the previous
  batch is done; then the previous run is finished and its gradient buffers are added into the
  masters' ``.grad`` (scaled as the loss's backward asked), before any of the new batch's;
- a call that is not overlappable (the batch that steps the optimizer) runs its whole program
  inside the forward, as without overlap, after finishing the previous one: clipping,
  ``on_before_optimizer_step`` and ``optimizer.step()`` see the complete accumulated gradient.

So ``.grad`` holds the complete gradient of every finished batch at the stepping batch's backward and
after :meth:`StepOverlap.drain`; between an overlapped batch's backward and the next batch's forward
it does not hold that batch's part yet.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_roundpipe.runtime.execution.jitter import pause as jitter_pause
from lightning_roundpipe.runtime.execution.autograd import attach
from lightning_roundpipe.runtime.execution.microbatch import merge_leaves
from lightning_roundpipe.runtime.execution.run_state import PipelineState, ProgramRun
from lightning_roundpipe.schedule.program import Op, OpKind


@dataclass
class _Pending:
    """An overlapped fused call whose program still drains."""

    run: ProgramRun
    sink: dict
    seed: float
    grad: torch.Tensor | None = None  # the loss's incoming gradient, once its backward ran
    finished: bool = False
    added: bool = False
    extra: dict = field(default_factory=dict)
    snapshot: PipelineState | None = None  # the call's state before its program ran (a rerun on one bank)


def _snapshot(state: PipelineState) -> PipelineState:
    """The call's state as it was before its program ran (its inputs, seeds and loss seed): a rerun of the
    program on one pool bank starts from it with fresh gradient buffers."""
    return PipelineState(num_microbatches=state.num_microbatches, acts=dict(state.acts), keep=state.keep,
                         base_seed=state.base_seed, rng_layers=state.rng_layers, grad_sink={},
                         loss_seed=state.loss_seed, input_grad_positions=state.input_grad_positions)


def _scaled(buffer: torch.Tensor, grad: torch.Tensor, seed: float) -> torch.Tensor:
    factor = grad if seed == 1.0 else grad / seed  # the incoming gradient in units of the seed
    return buffer if bool(factor == 1) else buffer * factor.to(buffer.dtype)


class StepOverlap:
    """The engine's runs in flight across fused calls (see the module docstring).

    Args:
        engine: the :class:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine` (passed in;
            this module does not import it: engine.py imports this one).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.pending: list[_Pending] = []
        self._open: list[_Pending] = []  # calls whose gradients are not in .grad yet
        self.told_one_bank = False
        self.overlap_proven = False  # a program on the second pool bank has completed: no fallback after

    # ------------------------------------------------------------------ finishing
    def _finish(self, pending: _Pending) -> None:
        """Wait for ``pending``'s run, keep its timeline, and add its gradients if its backward ran."""
        self.pending.remove(pending)
        already = pending.run.done and pending.run.timeline is None  # failed, its error raised before
        reason = None
        try:
            timeline = None if already else self.engine.executor.finish(pending.run)
        except torch.OutOfMemoryError as error:
            if not self._may_fall_back(pending.run):
                self._close(pending)  # its gradients are lost with the error
                raise
            reason = f"{type(error).__name__}: {error}"  # rerun below, outside the handler (its traceback holds memory)
        except BaseException:
            self._close(pending)  # its gradients are lost with the error
            raise
        if reason is not None:  # the first program on the second bank ran out of memory: rerun it on one bank
            self._fall_back(reason)
            state = _snapshot(pending.snapshot)
            run = self.engine.executor.start(pending.run.program, state)
            pending.run, pending.sink = run, state.grad_sink
            try:
                timeline = self.engine.executor.finish(run)
            except BaseException:
                self._close(pending)
                raise
        if timeline is None:  # a failed run adds nothing
            self._close(pending)
            return
        if pending.run.bank == 1:
            self.overlap_proven = True
        self.engine._keep(timeline, pending.run.program)
        pending.finished = True
        if pending.grad is not None:
            self._add(pending)

    def _add(self, pending: _Pending) -> None:
        engine = self.engine
        if engine.grad_barrier is not None:  # an optimizer step in flight reads .grad: wait for it
            engine.grad_barrier()
        if engine.sink_barrier is not None:
            engine.sink_barrier(pending.sink)
        for master, buffer in pending.sink.values():
            contribution = _scaled(buffer, pending.grad, pending.seed)
            if master.grad is None:
                master.grad = contribution
            else:
                master.grad.add_(contribution)
        pending.sink.clear()
        pending.added = True
        self._close(pending)
        if engine.on_gradients_complete is not None and not self.incomplete():
            engine.on_gradients_complete()

    def incomplete(self) -> bool:
        """Whether a call's gradients are not all in ``.grad`` yet (its run still drains, or its
        backward has not run)."""
        return bool(self._open)

    def _close(self, pending: _Pending) -> None:
        if pending in self._open:
            self._open.remove(pending)

    def drain(self) -> None:
        """Finish every overlapped run, oldest first, and add the gradients of those whose backward
        ran (the others' are added by their backward). Call before anything reads ``.grad``, the
        weights or the buffers outside a training step (checkpoints, validation, epoch end,
        exceptions, teardown).

        Raises:
            The first error of a run (after the older runs were finished: their gradients are kept).
        """
        while self.pending:
            self._finish(self.pending[0])
        for pending in list(self._open):  # finished, but their backward never ran: nothing to wait for
            if pending.finished:
                self._close(pending)

    def _may_fall_back(self, run: ProgramRun) -> bool:
        """Whether an out-of-memory error of ``run`` is the second pool bank's: no program on it has
        completed yet and it is held (reserved eagerly, or ``run`` uses it)."""
        executor = self.engine.executor
        return (executor.one_bank is None and not self.overlap_proven and self.engine.seq.routing is None
                and (run.bank == 1 or len(executor.backends[0].banks) > 1))

    def _fall_back(self, reason: str) -> None:
        """Run one program at a time from now on (:attr:`Executor.one_bank`): finish the runs in flight
        (their gradients are added as usual), free the second pool bank, say so once."""
        executor = self.engine.executor
        executor.one_bank = reason
        self.drain()
        while executor.in_flight:
            executor.finish(executor.in_flight[0])
        for backend in executor.backends:
            del backend.banks[1:]
        self._tell_one_bank()

    def _tell_one_bank(self) -> None:
        if self.engine.executor.one_bank is not None and not self.told_one_bank:
            self.told_one_bank = True
            stages = ("shorter `forward_stages`/`backward_stages`" if self.engine.auto_partition_after_steps is not None
                      else "`partition='auto'`, or shorter `forward_stages`/`backward_stages`")
            self.engine.info("RoundPipe: the next batch's pipeline no longer overlaps the previous one's drain: a"
                             f" second set of device pools does not fit ({self.engine.executor.one_bank}). HINT:"
                             f" smaller stages ({stages}), fewer microbatch rows or a larger `device_memory_bytes`"
                             " bring the overlap back.")

    def allowed(self, grad_inputs: list) -> bool:
        """Whether this fused call may be overlapped with the next (consumes ``engine.overlap_next``)."""
        engine = self.engine
        wanted, engine.overlap_next = engine.overlap_next, False
        barrier_ok = engine.grad_barrier is None or engine.on_gradients_complete is not None
        return (wanted and not grad_inputs and barrier_ok and engine.sink_barrier is None
                and engine.seq.routing is None and not _running_statistics(engine.seq.layers))

    # ------------------------------------------------------------------ the fused call
    def fused_forward(self, state: PipelineState, m: int, batch_leaves: list, sizes: list[int],
                      grad_inputs: list, batch_carry: dict | None = None) -> Any:
        """The fused path: forward stages, the fused tail and the backward stages as one program; the
        returned loss's backward scales the gradient buffers into ``.grad``.

        Gradients land in CPU buffers (``state.grad_sink``), computed with the backward seeded by
        ``loss_seed``; the node's backward adds ``buffer * (grad_output / loss_seed)`` into each
        parameter's ``.grad`` (gradients are linear in the seed, so this is exact whatever the user
        does with the scalar loss, e.g. Lightning's loss scaling under fp16). An overlapped call
        (:meth:`allowed`) returns once the tail's losses are on the host and adds its buffers when
        its run is finished (the next call, or :meth:`drain`).

        Raises:
            ValueError: when ``loss_seed()`` is not a finite number > 0.
        """
        engine = self.engine
        seed = 1.0 if engine.loss_seed is None else float(engine.loss_seed())
        if not (math.isfinite(seed) and seed > 0):
            raise ValueError(f"The fused path's `loss_seed()` must be a finite number > 0, got {seed!r}.")
        if engine.on_fused_call is not None:
            engine.on_fused_call()
        overlap = self.allowed(grad_inputs)
        if overlap:  # the second pool bank is reserved with the first, before this call's program
            engine.executor.expect_overlap = True
        if engine.before_fused_start is not None:
            engine.before_fused_start()
        state.loss_seed = seed
        state.grad_sink = {}
        engine._last_call, engine._last_sizes = (m, True), list(sizes)
        program = engine.program(m, engine._advance(len(engine.fused_stages)), fused=True)
        snapshot = _snapshot(state)
        run = engine.executor.start(program, state)  # behind the previous call's drain, if one is in flight
        self._tell_one_bank()
        try:
            self.drain()  # the previous call's run: its gradients go into .grad before this call's
        except BaseException:
            if run in engine.executor.in_flight:  # a failed older run stops this one; else clean it up here
                with contextlib.suppress(BaseException):
                    engine.executor.finish(run)
            raise
        pending, reason = None, None
        try:
            if overlap:
                tail = next(s.stage_index for s in engine.fused_stages if s.fused)
                engine.executor.wait_ops(run, [Op(OpKind.D2H, tail, mb) for mb in range(m)])
                if run.error is not None:  # raise it now, with the run's cleanup
                    engine._keep(engine.executor.finish(run), program)
                pending = _Pending(run, state.grad_sink, seed, snapshot=snapshot)
                self.pending.append(pending)
                self._open.append(pending)
            else:
                engine._keep(engine.executor.finish(run), program)
                self.overlap_proven |= run.bank == 1
        except torch.OutOfMemoryError as error:
            if not self._may_fall_back(run):
                raise
            reason = f"{type(error).__name__}: {error}"  # rerun below, outside the handler (its traceback holds memory)
        if reason is not None:  # the first program with the second bank held ran out of memory: rerun on one bank
            self._fall_back(reason)
            state = _snapshot(snapshot)
            run = engine.executor.start(program, state)
            engine._keep(engine.executor.finish(run), program)
        key = engine.seq.loss_key
        loss = merge_leaves([[state.final.pop(i)[key]] for i in range(m)])[0]
        extra = engine._routing_outputs(state, batch_carry) if batch_carry is not None else {}
        if key in extra:
            loss = loss + extra.pop(key)
        sink = state.grad_sink
        input_grads = engine._input_grads(state, batch_leaves, sizes) if pending is None else []

        retained = False  # a backward with retain_graph=True ran: the buffers are kept for the next one

        def run_backward(grads: list, retain: bool) -> list:
            nonlocal retained
            g = grads[0]
            if g is None:
                return [None] * len(input_grads)
            steady = engine.on_gradients_complete is not None  # the asynchronous steady state hands them on
            if pending is not None and steady and pending.grad is not None:
                raise ValueError(
                    "A second backward (`retain_graph=True` before) through a RoundPipe batch whose pipeline overlaps"
                    " the next is not supported with `RoundPipeStrategy(optimizer='async')`: the batch's gradients were"
                    " handed to the optimizer thread at its first backward. HINT: backward once per batch (sum the"
                    " losses), or use `optimizer='sync'`.")
            if pending is not None and (steady or not (retain or retained)):
                # overlapped: added when the run is finished (now, if it is)
                pending.grad = g
                if pending.finished and not pending.added:
                    self._add(pending)
                jitter_pause()  # the main thread's return (schedule jitter, `execution/jitter.py`)
                return []
            buffers = sink
            if pending is not None:  # a retained graph: finish the overlapped run and add its buffers here
                if not pending.finished:
                    self.drain()
                buffers = pending.sink  # a rerun on one pool bank has its own buffers
            if engine.grad_barrier is not None:
                engine.grad_barrier()
            if engine.sink_barrier is not None:
                engine.sink_barrier(buffers)
            for master, buf in buffers.values():
                contrib = _scaled(buf, g, seed)
                if retain:  # the buffer is added again by the next backward: .grad must not be it
                    contrib = contrib.clone() if contrib is buf else contrib
                if master.grad is None:
                    master.grad = contrib
                else:
                    master.grad.add_(contrib)
            retained = retained or retain
            if not retain:
                buffers.clear()
            jitter_pause()
            scaled = [None if x is None else _scaled(x, g, seed) for x in input_grads]
            return [y.clone() if retain and y is not None and any(y is x for x in input_grads) else y for y in scaled]

        (loss,) = attach([loss], run_backward, grad_inputs)
        jitter_pause()
        return engine.seq.finalize({**extra, key: loss})


def _running_statistics(layers: Any) -> bool:
    """Whether a layer in training mode updates running statistics in its forward (BatchNorm): the
    next batch's forward would read them before this batch's are written back."""
    return any(isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.training
               and module.track_running_stats for layer in layers for module in layer.modules())
