"""Walks each device's action list of an :class:`ExecutionPlan`; never reorders.

One :class:`PhaseRun` per phase (the forward stages of a call, or its backward stages): the
executor gives every :class:`DeviceWorker` its list, each action waits for the actions it depends
on (``ExecutionPlan.dependencies``) through per-(stage, microbatch) events, and a dispatch table
maps each action kind to its handler:

- ``LOAD``: upload the stage's weights (compute dtype);
- ``F``: forward of one microbatch without autograd; stage-boundary outputs go to the host;
- ``B``: recompute the stage's layers from the saved boundary input with autograd, then backward
  with the gradient from the stage after it; the input gradient goes to the host;
- ``X``: fused tail: forward of the last layers and the loss, then backward seeded with
  ``loss_seed``, in one action (never recomputed; logits never leave the device);
- ``DROP``: release the weights; for a backward stage add its gradients into the masters' ``.grad``
  (in backward-stage order, so the summation order, and so the result, does not depend on timing).

A worker that raises makes the phase raise in the main thread with the original exception type and
the device, stage and microbatch in the message; the other workers stop at their next wait.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.func import functional_call
from torch.utils import _pytree as pytree

from lightning_roundpipe.adapters.base import LayerSequence, is_float_tensor, module_uses_rng
from lightning_roundpipe.metrics.timeline import Interval, Timeline
from lightning_roundpipe.runtime import transfer
from lightning_roundpipe.runtime.devices import DeviceWorker
from lightning_roundpipe.runtime.store import ResidentStage, WeightStore
from lightning_roundpipe.schedule import Action, ActionKind, ExecutionPlan

_CPU_RNG_LOCK = threading.Lock()
_POLL_S = 0.05


class _Aborted(Exception):
    """Raised inside a worker waiting on a dependency when another worker failed."""


@dataclass
class PipelineState:
    """Data of one pipelined call, shared by its forward and backward phases.

    Attributes:
        num_microbatches: microbatches of this call.
        acts: ``(layer_index, microbatch_index) -> carry`` on the host: inputs of layer
            ``layer_index`` (layer 0: the microbatch itself).
        keep: layer indices whose inputs the backward needs (the backward stages' first layers).
        final: ``microbatch_index -> carry`` output of the last layer.
        grads: ``(layer_index, microbatch_index) -> [grad | None]``, gradients of the
            differentiable leaves of the input of ``layer_index``.
        final_grads: per microbatch, gradients of the final carry's leaves.
        base_seed: seed the per-(layer, microbatch) RNG streams derive from; ``None`` if no layer
            draws random numbers.
        rng_layers: indices of the layers that draw random numbers.
        grad_sink: fused path: ``id(master) -> (master, grad)`` CPU gradient buffers that ``DROP``
            fills instead of ``.grad``.
        loss_seed: fused path: the gradient the fused tail seeds its loss with (the fp16 loss scale;
            1.0 otherwise).
        input_grad_positions: flat (pytree) positions of the batch inputs that need a gradient;
            their per-microbatch gradients go to ``grads[(0, microbatch_index)]``.
    """

    num_microbatches: int
    acts: dict = field(default_factory=dict)
    keep: frozenset = frozenset()
    final: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    final_grads: list | None = None
    base_seed: int | None = None
    rng_layers: frozenset = frozenset()
    grad_sink: dict | None = None
    loss_seed: float = 1.0
    backward_done: bool = False
    input_grad_positions: tuple = ()


class PhaseRun:
    """Synchronisation of one phase: done events, abort flag, first error, timeline."""

    def __init__(self, plan: ExecutionPlan, state: PipelineState) -> None:
        self.plan = plan
        self.state = state
        self.done = {(a.stage_index, a.microbatch_index): threading.Event()
                     for acts in plan.actions for a in acts if a.kind.is_compute}
        self.committed = {s.stage_index: threading.Event() for s in plan.stages}
        self.abort = threading.Event()
        self.error: BaseException | None = None
        self.error_context = ""
        self._lock = threading.Lock()
        self.intervals: list[Interval] = []
        self.peak_resident_bytes = [0] * plan.num_devices
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wait(self, event: threading.Event) -> None:
        while not event.wait(_POLL_S):
            if self.abort.is_set():
                raise _Aborted()

    def fail(self, error: BaseException, context: str) -> None:
        with self._lock:
            if self.error is None:
                self.error, self.error_context = error, context
        self.abort.set()


def _with_context(error: BaseException, context: str) -> BaseException:
    """The same exception type with ``context`` in front of its message (a note if it cannot be rebuilt)."""
    msg = f"{context}: {error}"
    try:
        new = type(error)(msg)
    except Exception:
        new = None
    if new is None or str(new) == str(error):
        error.add_note(f"RoundPipe: {context}")
        return error
    new.__cause__ = error
    return new


def layer_seed(base_seed: int, layer_index: int, microbatch_index: int) -> int:
    """Seed of one (layer, microbatch): independent of which device runs it."""
    digest = hashlib.blake2b(f"{base_seed}:{layer_index}:{microbatch_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextlib.contextmanager
def rng_scope(seed: int | None, worker: DeviceWorker):
    """Run a layer with the generator of ``worker``'s device seeded to ``seed``, then restore it.

    The CPU generator is process-wide, so CPU virtual devices take a lock around seeded layers.
    """
    if seed is None:
        yield
        return
    if worker.is_cuda:
        gen = torch.cuda.default_generators[worker.device.index]
        state = gen.get_state()
        gen.manual_seed(seed)
        try:
            yield
        finally:
            gen.set_state(state)
        return
    with _CPU_RNG_LOCK:
        state = torch.default_generator.get_state()
        torch.default_generator.manual_seed(seed)
        try:
            yield
        finally:
            torch.default_generator.set_state(state)


class Executor:
    """Runs plan phases of one :class:`LayerSequence` on a fixed set of workers.

    Args:
        seq: the layer sequence.
        workers: one :class:`DeviceWorker` per device, ``workers[device_index]``.
        store: the :class:`WeightStore` of ``seq``'s layers.
        autocast_dtype: dtype of ``torch.autocast`` on the workers (``None``: no autocast).
    """

    def __init__(self, seq: LayerSequence, workers: list[DeviceWorker], store: WeightStore,
                 autocast_dtype: torch.dtype | None = None) -> None:
        self.seq = seq
        self.workers = workers
        self.store = store
        self.autocast_dtype = autocast_dtype
        self.profiler = None  # a runtime.profiler.LayerProfiler while profiling
        # `functional_call` swaps a module's attributes while it runs: one thread per layer at a time
        # (a forward stage and a backward stage over the same layer overlap in the fused plan)
        self._layer_locks = [threading.Lock() for _ in seq.layers]
        self._dispatch: dict[ActionKind, Callable] = {
            ActionKind.LOAD: self._load,
            ActionKind.F: self._forward,
            ActionKind.B: self._backward,
            ActionKind.X: self._backward,
            ActionKind.DROP: self._drop,
        }

    # ------------------------------------------------------------------ driver
    def run(self, plan: ExecutionPlan, state: PipelineState) -> Timeline:
        """Execute ``plan`` (one phase) and return its measured timeline.

        Raises:
            The first worker exception, same type, message prefixed with device, stage and microbatch.
            ``NotImplementedError`` for action kinds the runtime does not execute (``W``).
        """
        for acts in plan.actions:
            for a in acts:
                if a.kind not in self._dispatch:
                    raise NotImplementedError(f"The runtime cannot execute `{a}` ({a.kind.value} actions are simulator-only).")
        run = PhaseRun(plan, state)
        jobs = [w.submit(lambda worker, acts=acts: self._device_job(worker, acts, run))
                for w, acts in zip(self.workers, plan.actions)]
        try:
            for j in jobs:
                while not j.wait(_POLL_S):
                    if not all(w.alive for w in self.workers):
                        run.fail(RuntimeError("a RoundPipe device worker thread died"), "runtime")
        except BaseException:  # KeyboardInterrupt in the main thread: stop the workers, then re-raise
            run.abort.set()
            for j in jobs:
                j.wait(30)
            raise
        if run.error is not None:
            raise _with_context(run.error, run.error_context) from run.error
        wall = run.now()
        return Timeline(len(self.workers), run.intervals, wall_s=wall, peak_resident_bytes=run.peak_resident_bytes)

    def _device_job(self, worker: DeviceWorker, actions: tuple[Action, ...], run: PhaseRun) -> None:
        resident: dict[int, ResidentStage] = {}
        action = None
        try:
            with transfer.compute_context(worker):
                for action in actions:
                    if run.abort.is_set():
                        return
                    self._dispatch[action.kind](worker, action, run, resident)
        except _Aborted:
            return
        except BaseException as e:
            spec = run.plan.stages[action.stage_index]
            mb = "" if action.microbatch_index is None else f", microbatch {action.microbatch_index}"
            run.fail(e, f"RoundPipe device {worker.device_index} ({worker.device}), action `{action}`: "
                        f"{spec.describe()}{mb}")
        finally:
            resident.clear()

    # ------------------------------------------------------------------ helpers
    def _autocast(self, worker: DeviceWorker):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=worker.device.type, dtype=self.autocast_dtype)

    def _call_layers(self, worker: DeviceWorker, run: PhaseRun, resident: ResidentStage, layers: range,
                     carry: Any, mb: int, on_boundary: Callable[[int, Any], None] | None = None,
                     profile_kind: str | None = None) -> tuple[Any, dict[int, float]]:
        """Run ``layers`` on ``carry``; returns the output and, when profiling, seconds per layer."""
        state = run.state
        prof = self.profiler if (self.profiler is not None and self.profiler.enabled and profile_kind) else None
        times: dict[int, float] = {}
        for li in layers:
            if on_boundary is not None and li != layers.start and li in state.keep:
                on_boundary(li, carry)
            seed = layer_seed(state.base_seed, li, mb) if li in state.rng_layers else None
            if prof is not None:
                prof.record_activation(li, transfer.tree_nbytes(carry))
                _sync(worker)
                t = time.perf_counter()
            with self._layer_locks[li], rng_scope(seed, worker):
                carry = functional_call(self.seq.layers[li], resident.tensors[li], (carry,))
            if prof is not None:
                _sync(worker)
                times[li] = time.perf_counter() - t
                prof.record(profile_kind, li, times[li])
        return carry, times

    def _wait_deps(self, action: Action, run: PhaseRun) -> None:
        for dep in run.plan.dependencies(action):
            ev = run.done.get((dep.stage_index, dep.microbatch_index))
            if ev is not None:  # a dependency of an earlier phase has already completed
                run.wait(ev)

    def _record(self, run: PhaseRun, worker: DeviceWorker, kind: str, action: Action, start: float, nbytes: int = 0) -> None:
        run.intervals.append(Interval(worker.device_index, kind, action.stage_index, action.microbatch_index,
                                      start, run.now(), nbytes))

    # ------------------------------------------------------------------ action handlers
    def _load(self, worker: DeviceWorker, action: Action, run: PhaseRun, resident: dict) -> None:
        t = run.now()
        spec = run.plan.stages[action.stage_index]
        stage = self.store.upload(action.stage_index, spec.layers, worker, with_grad=spec.kind == "backward")
        resident[action.stage_index] = stage
        d = worker.device_index
        run.peak_resident_bytes[d] = max(run.peak_resident_bytes[d], sum(r.nbytes for r in resident.values()))
        self._record(run, worker, "H2D", action, t, stage.nbytes)

    def _begin(self, action: Action, run: PhaseRun, resident: dict, worker: DeviceWorker, pop: bool) -> tuple:
        """Common start of a compute action: wait for its dependencies and its weights, bring its
        input to the device. Returns ``(spec, microbatch, stage, carry, start_s)``."""
        spec = run.plan.stages[action.stage_index]
        m = action.microbatch_index
        self._wait_deps(action, run)
        stage = resident[action.stage_index]
        self.store.ensure_ready(stage, worker)
        key = (spec.layers.start, m)
        carry = run.state.acts.pop(key) if pop else run.state.acts[key]
        t = run.now()
        carry, h2d = transfer.to_device(carry, worker)
        if h2d:
            self._record(run, worker, "H2D", action, t, h2d)
        return spec, m, stage, carry, t

    def _forward(self, worker: DeviceWorker, action: Action, run: PhaseRun, resident: dict) -> None:
        state = run.state
        a = run.plan.stages[action.stage_index].layers.start
        spec, m, stage, carry, t = self._begin(action, run, resident, worker, pop=a not in state.keep)
        b = spec.layers.stop

        def save(li: int, c: Any) -> None:
            state.acts[(li, m)] = transfer.to_host(c, worker)[0]

        with torch.no_grad(), self._autocast(worker):
            carry, _ = self._call_layers(worker, run, stage, spec.layers, carry, m, on_boundary=save, profile_kind="forward")
        host, _ = transfer.to_host(carry, worker)
        if b == len(self.seq.layers):
            state.final[m] = host
        else:
            state.acts[(b, m)] = host
        self._record(run, worker, "F", action, t, 0)
        run.done[(action.stage_index, m)].set()

    def _backward(self, worker: DeviceWorker, action: Action, run: PhaseRun, resident: dict) -> None:
        """``B`` (recompute from the saved input, then backward with the incoming gradient) and
        ``X`` (the fused tail: forward, loss and backward seeded with ``loss_seed``)."""
        state = run.state
        spec, m, stage, carry, t = self._begin(action, run, resident, worker, pop=True)
        a, b = spec.layers.start, spec.layers.stop
        last = b == len(self.seq.layers)
        leaves: list[torch.Tensor] = []
        if a > 0:
            carry, leaves = _grad_leaves(carry, self.seq.grad_keys)
        elif state.input_grad_positions:
            carry, leaves = _grad_positions(carry, state.input_grad_positions)
        if not spec.fused:
            incoming, _ = transfer.to_device(state.final_grads[m] if last else state.grads.pop((b, m)), worker)
        with torch.enable_grad():
            with self._autocast(worker):
                out, layer_s = self._call_layers(worker, run, stage, spec.layers, carry, m,
                                                 profile_kind="forward" if spec.fused else "recompute")
            if spec.fused:
                loss = out[self.seq.loss_key]
                pairs = [(loss, torch.full_like(loss, state.loss_seed))]
            else:
                outs = pytree.tree_leaves(out) if last else _diff_leaves(out, self.seq.grad_keys)
                pairs = [(o, g.to(o.dtype)) for o, g in zip(outs, incoming)
                         if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
            tb = time.perf_counter()
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if layer_s:  # profiling: split the backward over the stage's layers like their forward
                _sync(worker)
                total, whole = time.perf_counter() - tb, sum(layer_s.values()) or 1.0
                for li, sec in layer_s.items():
                    self.profiler.record("backward", li, total * sec / whole)
        if leaves:
            state.grads[(a, m)] = transfer.to_host([leaf.grad for leaf in leaves], worker)[0]
        if spec.fused:
            state.final[m] = transfer.to_host({self.seq.loss_key: loss.detach()}, worker)[0]
        self._record(run, worker, action.kind.value, action, t, 0)
        run.done[(action.stage_index, m)].set()

    def _drop(self, worker: DeviceWorker, action: Action, run: PhaseRun, resident: dict) -> None:
        stage = resident.pop(action.stage_index)
        spec = run.plan.stages[action.stage_index]
        if (spec.kind == "forward" or spec.fused) and stage.buffer_pairs and any(
                self.seq.layers[li].training for li in spec.layers):
            self.store.write_back_buffers(stage)
        if spec.kind == "backward":
            bwd = run.plan.backward_stages
            pos = bwd.index(spec)
            if pos > 0 and (bwd[pos - 1].stage_index, 0) in run.done:  # the previous stage is in this phase
                run.wait(run.committed[bwd[pos - 1].stage_index])
            t = run.now()
            moved = self.store.commit_grads(stage, worker, run.state.grad_sink)
            self._record(run, worker, "D2H", action, t, moved)
        run.committed[action.stage_index].set()


def _sync(worker: DeviceWorker) -> None:
    if worker.is_cuda:
        torch.cuda.current_stream(worker.device).synchronize()


def _grad_leaves(carry: dict, keys: tuple[str, ...]) -> tuple[dict, list[torch.Tensor]]:
    """Copy of ``carry`` whose float tensors under ``keys`` are fresh leaves requiring grad."""
    leaves: list[torch.Tensor] = []

    def mark(t: Any) -> Any:
        if is_float_tensor(t):
            t = t.detach().requires_grad_(True)
            leaves.append(t)
        return t

    out = dict(carry)
    for k in keys:
        if k in out:
            out[k] = pytree.tree_map(mark, out[k])
    return out, leaves


def _grad_positions(carry: Any, positions: tuple) -> tuple[Any, list[torch.Tensor]]:
    """Copy of ``carry`` whose leaves at the flat ``positions`` are fresh leaves requiring grad."""
    flat, spec = pytree.tree_flatten(carry)
    leaves = []
    for i in positions:
        flat[i] = flat[i].detach().requires_grad_(True)
        leaves.append(flat[i])
    return pytree.tree_unflatten(flat, spec), leaves


def _diff_leaves(carry: dict, keys: tuple[str, ...]) -> list[Any]:
    return [t for k in keys if k in carry for t in pytree.tree_leaves(carry[k]) if is_float_tensor(t)]


def rng_layers(seq: LayerSequence) -> frozenset:
    """Indices of the layers that draw random numbers in their current mode."""
    return frozenset(i for i, layer in enumerate(seq.layers) if module_uses_rng(layer))
