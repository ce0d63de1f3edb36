"""Routing replay for mixture-of-experts layers (issue 10 item 1).

A backward stage recomputes its layers from the saved stage input (full recomputation). For a
mixture-of-experts layer a fresh top-k in the recomputation may pick another expert for a token
whose top-k scores are nearly tied, because the recomputed router input can differ from the
forward's in the last bits (another device, another kernel, an earlier layer's nondeterminism):
the backward then differentiates a function the forward never computed (the failure NeMo
Automodel and torchtitan hit with MoE activation recomputation). Here the forward records, per
(layer, microbatch, router call), the **selected expert indices** on the host, and the
recomputation reuses them: the routing *weights* are recomputed from the recomputed router logits
at those indices, so they stay differentiable functions of the logits, exactly as in the forward.

- :class:`RoutingStore`: one per pipelined call (``PipelineState.routing``), shared by its forward
  and backward programs and by every device (a microbatch's forward and its recomputation may run
  on different devices: the indices live on the host, copied there without blocking the compute
  stream, and are uploaded to whichever device recomputes). It also keeps small per-(layer,
  microbatch) statistics the adapter asks for (the load-balancing loss's expert counts and
  probability sums) and sums them over the whole batch once every microbatch's forward has passed
  every routing layer (:meth:`RoutingStore.totals`).
- :func:`routing_scope`: the executor runs every call of a routing layer inside it (thread-local,
  like :func:`~lightning_roundpipe.runtime.replay.rng.rng_scope`); the adapter's router hooks read it
  with :func:`current`. Outside a scope (the model's own forward) the hooks do nothing.

Set :data:`REPLAY_ROUTING` to ``False`` (debugging only) to recompute a fresh top-k instead, which
shows the failure the replay prevents.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch

from lightning_roundpipe.runtime.backends import op_check

#: debugging switch: ``False`` makes recomputation choose a fresh top-k (the failure mode replay prevents)
REPLAY_ROUTING = True

_LOCAL = threading.local()


def _to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A host copy of ``tensor`` that a later in-place op cannot reach; on CUDA a non-blocking copy
    into pinned memory and the event after which it is valid."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":  # a CPU virtual device: a copy in host memory (not the device's)
        return op_check.host_copy(tensor), None
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event
    return tensor.to("cpu"), None  # other accelerators: a blocking copy


class RoutingStore:
    """Routing decisions and statistics of one pipelined call, on the host.

    Args:
        routing_layers: indices (in the layer sequence) of the layers that route tokens.
        num_microbatches: microbatches of the call.

    Keys are ``(layer_index, microbatch_index, call_index)``: ``call_index`` counts the router
    calls inside one layer call (0 for one router per layer).
    """

    def __init__(self, routing_layers: frozenset[int], num_microbatches: int) -> None:
        self.routing_layers = routing_layers
        self.num_microbatches = num_microbatches
        self._indices: dict[tuple[int, int, int], tuple[torch.Tensor, Any]] = {}
        self._stats: dict[tuple[int, int, int], dict[str, tuple[torch.Tensor, Any]]] = {}
        self._passed: dict[tuple[int, int], threading.Event] = {}
        self._num_passed = 0
        self._lock = threading.Lock()
        self._totals: dict[str, torch.Tensor] | None = None
        self._device_totals: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self.complete = threading.Event()
        """Set once every microbatch's forward has passed every routing layer."""
        self.retain = False
        """Set while a backward that keeps the graph (``retain_graph=True``) runs: :meth:`replay` leaves
        the indices for the next backward's recomputation."""
        if not routing_layers:
            self.complete.set()

    def record(self, key: tuple[int, int, int], indices: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        """Keep the selected expert indices (an int tensor of any shape; kept as int32, replayed as
        int64) and ``stats`` (small float tensors, summed over the batch by :meth:`totals`) of one
        router call."""
        host = _to_host(indices.to(torch.int32))
        host_stats = {name: _to_host(t) for name, t in stats.items()}
        with self._lock:
            self._indices[key] = host
            self._stats[key] = host_stats

    def _passed_event(self, layer_index: int, microbatch_index: int) -> threading.Event:
        with self._lock:
            return self._passed.setdefault((layer_index, microbatch_index), threading.Event())

    def mark_passed(self, layer_index: int, microbatch_index: int) -> None:
        """The forward of ``layer_index`` for one microbatch is done (its routing is recorded)."""
        event = self._passed_event(layer_index, microbatch_index)
        with self._lock:
            first = not event.is_set()
            event.set()
            self._num_passed += first
            done = self._num_passed >= len(self.routing_layers) * self.num_microbatches
        if done:
            self.complete.set()

    def replay(self, key: tuple[int, int, int], device: torch.device,
               wait: Callable[[threading.Event], None] | None = None) -> torch.Tensor:
        """The indices the forward chose for ``key``, on ``device`` (removed from the store, unless
        :attr:`retain`: every backward recomputes each (layer, microbatch) once).

        A recomputation needs only its stage input, so it may start while the forward of the same
        layer and microbatch still runs on another device: ``wait`` (called with that forward's
        event) blocks until it has recorded its routing.

        Raises:
            RuntimeError: when the forward recorded no routing for ``key``.
        """
        event = self._passed_event(key[0], key[1])
        if not event.is_set() and wait is not None:
            wait(event)
        with self._lock:
            got = self._indices.get(key) if self.retain else self._indices.pop(key, None)
        if got is None:
            raise RuntimeError(
                f"RoundPipe routing replay: no routing was recorded for layer {key[0]}, microbatch {key[1]},"
                f" router call {key[2]}: the recomputation calls the router more often than the forward did."
            )
        host, event = got
        if event is not None:  # the stream waits for the forward's download, the host does not
            torch.cuda.current_stream(device).wait_event(event)
        return host.to(device, non_blocking=True).to(torch.int64)

    def totals(self, wait: Callable[[threading.Event], None] | None = None,
               device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Every statistic summed over all recorded (layer, microbatch, call) keys, fp32, in key order.

        Args:
            wait: called with :attr:`complete` to block until the whole batch is recorded (the
                executor passes one that stops when the program aborts); ``None``: must be complete.
            device: ``None``: the sums on the host (after the program: the host consumes them). A
                device: inside a device op, the sums on that device, without a host sync: each
                host statistic is uploaded after the op's stream waited for its download (CUDA: a
                stream wait on its event, never ``event.synchronize()``); computed once per device
                and compute thread (the op's stream) and kept. The same values, bit for bit.

        Raises:
            RuntimeError: when ``wait`` is ``None`` and the routing of the batch is not complete.
        """
        if not self.complete.is_set():
            if wait is None:
                raise RuntimeError("RoundPipe: the whole batch's routing statistics are not complete yet.")
            wait(self.complete)
        if device is not None:
            return self._totals_on(torch.device(device))
        with self._lock:
            if self._totals is None:
                totals: dict[str, torch.Tensor] = {}
                for key in sorted(self._stats):
                    for name, (host, event) in self._stats[key].items():
                        if event is not None:
                            event.synchronize()
                        value = host.to(torch.float32)
                        totals[name] = value if name not in totals else totals[name] + value
                self._totals = totals
            return self._totals

    def _totals_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        where = (str(device), threading.get_ident())
        with self._lock:
            kept = self._device_totals.get(where)
            recorded = [self._stats[key] for key in sorted(self._stats)]
        if kept is not None:
            return kept
        totals: dict[str, torch.Tensor] = {}
        for stats in recorded:
            for name, (host, event) in stats.items():
                if event is not None:
                    torch.cuda.current_stream(device).wait_event(event)
                value = host.to(device, non_blocking=True).to(torch.float32)
                totals[name] = value if name not in totals else totals[name] + value
        with self._lock:
            self._device_totals[where] = totals
        return totals


class RoutingScope:
    """What a router hook needs during one layer call (see :func:`routing_scope`).

    Attributes:
        store: the call's :class:`RoutingStore`.
        layer_index, microbatch_index: the layer and microbatch running.
        replay: ``True`` in a recomputation (``R``): reuse the recorded indices.
        device: the device the layer runs on.
        wait: blocks on a ``threading.Event`` until it is set, or raises when the program aborts.
        batch: per-call values the layer puts here for its hooks (the token mask...).
        aux_terms: differentiable scalars the hooks add (the layer adds them to its carry).
    """

    def __init__(self, store: RoutingStore, layer_index: int, microbatch_index: int, replay: bool,
                 device: torch.device, wait: Callable[[threading.Event], None]) -> None:
        self.store = store
        self.layer_index = layer_index
        self.microbatch_index = microbatch_index
        self.replay = replay and REPLAY_ROUTING
        self.recompute = replay
        self.device = device
        self.wait = wait
        self.batch: dict[str, Any] = {}
        self.aux_terms: list[torch.Tensor] = []
        self._calls = 0

    def next_key(self) -> tuple[int, int, int]:
        """Key of the next router call of this layer call."""
        key = (self.layer_index, self.microbatch_index, self._calls)
        self._calls += 1
        return key


def current() -> RoutingScope | None:
    """The routing scope of the running layer call in this thread, else ``None``."""
    return getattr(_LOCAL, "scope", None)


@contextlib.contextmanager
def routing_scope(store: RoutingStore | None, layer_index: int, microbatch_index: int, replay: bool,
                  device: torch.device, wait: Callable[[threading.Event], None]):
    """Run one call of a routing layer: record its routing (forward ``F``/``X``) or replay it
    (``replay``: recomputation ``R``). ``store=None``: no scope (the layer routes freshly)."""
    if store is None:
        yield None
        return
    scope = RoutingScope(store, layer_index, microbatch_index, replay, device, wait)
    previous = current()
    _LOCAL.scope = scope
    try:
        yield scope
    finally:
        _LOCAL.scope = previous
    if not replay:
        store.mark_passed(layer_index, microbatch_index)
