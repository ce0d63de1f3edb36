"""The host-side state of one pipelined call and of one program run (:mod:`~lightning_roundpipe.runtime.execution.executor`).

:class:`PipelineState` is the data a pipelined call's forward and backward programs share (boundary
activations, gradients, the fused path's gradient sink); :class:`ProgramRun` is one execution of one
stream program: which ops are issued, their events, the device slots, the first error.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from lightning_roundpipe.runtime.replay.routing import RoutingStore
from lightning_roundpipe.schedule.program import Op, OpKind, StreamProgram

_POLL_S = 0.05


class _Aborted(Exception):
    """Raised inside a stream thread waiting on a dependency when another thread failed."""


@dataclass
class PipelineState:
    """Data of one pipelined call, shared by its forward and backward programs (host side).

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
        grad_sink: fused path: ``id(master) -> (master, grad)`` CPU gradient buffers that ``WD2H``
            fills instead of ``.grad``.
        loss_seed: fused path: the gradient the fused tail seeds its loss with (1.0 unless scaled).
        input_grad_positions: flat (pytree) positions of the batch inputs that need a gradient;
            their per-microbatch gradients go to ``grads[(0, microbatch_index)]``.
        routing: mixture-of-experts: the routing recorded by the forward and replayed by the
            recomputation (:mod:`~lightning_roundpipe.runtime.replay.routing`); ``None`` for dense models.
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
    input_grad_positions: tuple = ()
    routing: RoutingStore | None = None


class ProgramRun:
    """One execution of a program: issue flags, device events, device-local slots, the first error.

    ``bank``: the pool bank (0 or 1) its device and host staging buffers come from; a program issued
    while the previous one still drains uses the other bank."""

    def __init__(self, program: StreamProgram, state: PipelineState, num_devices: int, bank: int = 0) -> None:
        self.program = program
        self.bank = bank
        self.jobs: list = []  # the done events of its stream, host-gradient and refresh jobs (Executor.start)
        self.master_grad_bytes = 0  # bytes of the masters' .grad when the run started (main thread)
        self.shadow_bank = 0  # the weight store's snapshot bank its uploads read (WeightStore.read_bank)
        self.done = False  # Executor.finish ran (timeline: its measured timeline; None when it failed)
        self.timeline: Any = None
        self.plan = program.plan
        self.state = state
        self.issued = {op: threading.Event() for _, _, _, op in program.ops()}
        self.events: dict[Op, Any] = {}
        self.slots: dict[tuple, Any] = {}
        self.resident: dict[tuple[int, int], Any] = {}
        self.host_grads: dict[tuple[int, int], list] = {}
        self.abort = threading.Event()
        self.error: BaseException | None = None
        self.error_context = ""
        self._lock = threading.Lock()
        self.spans: list[tuple[int, Op, Callable[[], tuple[float, float]]]] = []
        self.refreshed: dict[int, threading.Event] = {}  # tensor key -> its shadow is fresh (refresh thread)
        self.write_backs: list = []  # (master buffer, its downloaded host copy), applied after the program
        self.profile_marks: list = []  # (backend, kind, {layer: (start, end)}, whole backward marks or None)
        self.nbytes: dict[Op, int] = {}
        # measured bytes of every pooled transfer content (device uploads, host downloads): the pools
        # are sized from them after the program (Executor._settle_pools)
        self.device_bytes: dict[tuple, int] = {}
        self.host_bytes: dict[tuple, int] = {}
        self.resident_bytes = [0] * num_devices
        self.peak_resident_bytes = [0] * num_devices
        # host inputs read by several uploads (a boundary the next forward stage and a backward
        # stage's recompute both start from): the last reader of this program frees the entry
        self.readers, self.has_backward = _readers(program)
        self._readers_left: dict[tuple[int, int], int] = {}
        # host gradient buffers (downloaded by WD2H and not yet added, the fused path's sink) and
        # the most bytes they and the masters' .grad held at once
        self.grad_buffer_bytes = 0
        self.peak_grad_bytes = 0
        self.t0 = time.perf_counter()

    def take_input(self, layer_index: int, microbatch_index: int) -> Any:
        """The host carry entering ``layer_index`` for one microbatch; the program's last reader
        removes it, unless a later program (the backward phase) still needs it."""
        key = (layer_index, microbatch_index)
        with self._lock:
            left = self._readers_left.get(key, self.readers.get(layer_index, 1)) - 1
            self._readers_left[key] = left
        if left <= 0 and (self.has_backward or layer_index not in self.state.keep):
            return self.state.acts.pop(key)
        return self.state.acts[key]

    def wait(self, event: threading.Event) -> None:
        while not event.wait(_POLL_S):
            if self.abort.is_set():
                raise _Aborted()

    def fail(self, error: BaseException, context: str) -> None:
        with self._lock:
            if self.error is None:
                self.error, self.error_context = error, context
        self.abort.set()

    def add_grad_buffer_bytes(self, nbytes: int, grad_bytes: int) -> None:
        """``nbytes`` more (or fewer) bytes of host gradient buffers, while ``.grad`` holds ``grad_bytes``."""
        with self._lock:
            self.grad_buffer_bytes += nbytes
            self.peak_grad_bytes = max(self.peak_grad_bytes, self.grad_buffer_bytes + grad_bytes)

    def add_resident(self, device_index: int, nbytes: int) -> None:
        with self._lock:
            self.resident_bytes[device_index] += nbytes
            self.peak_resident_bytes[device_index] = max(self.peak_resident_bytes[device_index],
                                                         self.resident_bytes[device_index])


def _readers(program: StreamProgram) -> tuple[dict[int, int], bool]:
    """Per layer index, how many uploads of one microbatch read the host input of that layer, and
    whether the program runs backward stages (cached on the program: it is static)."""
    cached = program._cache.get("readers")
    if cached is None:
        plan = program.plan
        readers: dict[int, int] = {}
        for _, _, _, op in program.ops():
            if op.kind is OpKind.H2D and op.microbatch_index == 0:
                start = plan.stages[op.stage_index].layers.start
                readers[start] = readers.get(start, 0) + 1
        has_backward = any(plan.stages[op.stage_index].kind == "backward" for _, _, _, op in program.ops())
        cached = program._cache["readers"] = (readers, has_backward)
    return cached
