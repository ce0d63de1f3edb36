"""The backend interface: one backend logic over two drivers (DESIGN.md section 4).

The executor (:mod:`lightning_roundpipe.runtime.execution.executor`) walks each stream's op list of the stream
program on that stream's issuing thread (:class:`~lightning_roundpipe.runtime.execution.devices.StreamThread`)
and, for every op, in this order: waits (on the host) until the op's producers are *issued*, makes
its stream wait for their events (:meth:`Backend.wait_event`, across devices too), enqueues the op's
work (:meth:`Backend.launch`) and records the op's event (:meth:`Backend.record`). It never waits for
the device there: the host runs ahead until it needs data itself (:meth:`Backend.host_wait`,
:meth:`Backend.synchronize`). Two drivers implement it:

- :class:`~lightning_roundpipe.runtime.backends.cuda.CudaBackend`: one GPU; ``launch`` runs the op's
  Python on the issuing thread, which only enqueues kernels and copies on the op's CUDA stream;
  events are CUDA events;
- :class:`~lightning_roundpipe.runtime.backends.cpu.CpuBackend`: a CPU virtual device; ``launch``
  enqueues the op on the stream's worker thread, which runs it later in stream order; events are
  completed by the worker; an optional checking mode verifies every buffer access against the waits.

Everything above the driver (ordering, event placement, the buffer pools, run-ahead) is one code
path, so every CPU test runs the logic a GPU runs. Data moves only between pooled buffers
(:mod:`~lightning_roundpipe.runtime.backends.pool`): :meth:`Backend.to_device` packs a host pytree
into a device transfer slot, :meth:`Backend.to_host` packs device pytrees into host staging blocks;
the drivers only copy (:meth:`Backend.copy_h2d`, :meth:`Backend.copy_d2h`).
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from lightning_roundpipe.runtime.backends.budget import host_side
from lightning_roundpipe.runtime.backends.checker import Access
from lightning_roundpipe.runtime.backends.pool import SlotPool, StagePool, pack
from lightning_roundpipe.runtime.execution.devices import StreamThread
from lightning_roundpipe.schedule.program import STREAMS

Publish = Callable[[Any], None]


def tree_nbytes(tree: Any) -> int:
    """Bytes of all tensors in a pytree."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


class PoolBank:
    """A second set of a device's pools (stage weights, transfers, fp32 accumulators) for a program
    issued while the previous one drains.

    Args:
        allocate: the device's ``(nbytes, what) -> uint8 tensor``.
    """

    def __init__(self, allocate: Callable[..., torch.Tensor]) -> None:
        self.pool = StagePool(allocate)
        self.transfer_pool = SlotPool(lambda n: allocate(n, "the activation transfer pool (bank 1)"))
        self.accumulator_pool = SlotPool(lambda n: allocate(n, "the fp32 gradient accumulator pool (bank 1)"))


class Backend(abc.ABC):
    """One device's streams and data movement.

    Args:
        device_index: position of the device in the strategy's device list.
        device: the ``torch.device`` of the device (``cpu`` for a CPU virtual device).

    Attributes:
        threads: ``threads[stream]``, the issuing :class:`StreamThread` of each stream of :data:`STREAMS`.
        pool: the device's :class:`~lightning_roundpipe.runtime.backends.pool.StagePool` of stage
            weight buffers.
        transfer_pool: the device's :class:`~lightning_roundpipe.runtime.backends.pool.SlotPool` of
            upload destinations (activations, boundary inputs, incoming gradients).
        accumulator_pool: the device's fp32 gradient accumulators, one slot per stage weight slot.
        banks: the pool sets by bank index (:meth:`bank`): bank 0 is the three pools above; bank 1,
            made on first use, serves a program issued while the previous one still drains
            (:mod:`~lightning_roundpipe.runtime.execution.overlap`), so two programs in flight never share a slot.
        checker: the checking mode's shared checker (``None``: off; CPU virtual devices only).
    """

    is_cuda = False
    checker = None
    pool_label: str | None = None  # what the pool's next allocation is for, in error messages

    def __init__(self, device_index: int, device: torch.device) -> None:
        self.device_index = device_index
        self.device = torch.device(device)
        self.threads: dict[str, StreamThread] = {}
        self.pool = StagePool(self.allocate_bytes)
        self.transfer_pool = SlotPool(lambda n: self.allocate_bytes(n, "the activation transfer pool"))
        self.accumulator_pool = SlotPool(lambda n: self.allocate_bytes(n, "the fp32 gradient accumulator pool"))
        self.banks: list[Any] = [self]

    def bank(self, index: int) -> Any:
        """The pool set of bank ``index`` (0 or 1): an object with ``pool``, ``transfer_pool`` and
        ``accumulator_pool`` (bank 0: this backend's own)."""
        while len(self.banks) <= index:
            self.banks.append(PoolBank(self.allocate_bytes))
        return self.banks[index]

    @property
    def pools(self) -> dict[str, Any]:
        """The device's pools by name (``stage weights``, ``transfers``, ``accumulators``; a second
        bank's as ``... (bank 1)``)."""
        out = {"stage weights": self.pool, "transfers": self.transfer_pool, "accumulators": self.accumulator_pool}
        for index, bank in enumerate(self.banks[1:], start=1):
            out.update({f"stage weights (bank {index})": bank.pool, f"transfers (bank {index})": bank.transfer_pool,
                        f"accumulators (bank {index})": bank.accumulator_pool})
        return out

    @property
    def pool_bytes(self) -> int:
        """Bytes all the device's pools hold."""
        return sum(pool.nbytes for pool in self.pools.values())

    def _start_threads(self) -> None:
        for stream in STREAMS:
            self.threads[stream] = StreamThread(f"roundpipe-device{self.device_index}-{stream}",
                                                lambda stream=stream: self._thread_setup(stream))

    @abc.abstractmethod
    def _thread_setup(self, stream: str) -> None:
        """Run once in each stream thread (bind the device, set the thread count)."""

    @property
    def alive(self) -> bool:
        return all(t.alive for t in self.threads.values())

    def close(self) -> None:
        for thread in self.threads.values():
            thread.close()
        for pool in self.pools.values():
            pool.clear()

    # ------------------------------------------------------------------ ordering
    @abc.abstractmethod
    def launch(self, stream: str, work: Callable[[], None], access: Access | None = None, label: str = "",
               op: Any = None) -> None:
        """Enqueue one op's ``work()`` on ``stream`` (called by the stream's issuing thread, inside
        :meth:`stream_context`). CUDA: runs ``work`` now (it enqueues kernels); CPU: its worker runs
        it later, in stream order. ``access`` (the buffers it reads and writes), ``label`` and ``op``
        feed the checking mode.

        Raises:
            StreamCheckError: checking mode, the op touches a buffer it has not waited for.
        """

    def stream_context(self, stream: str):
        """Context manager making ``stream`` current in the calling thread (no-op on the CPU)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def record(self, stream: str) -> Any:
        """After issuing an op on ``stream``: an event that completes when the stream reaches it."""

    @abc.abstractmethod
    def wait_event(self, stream: str, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (recorded by any device) before its next op."""

    @abc.abstractmethod
    def host_wait(self, event: Any) -> None:
        """Block the calling host thread until ``event`` has completed."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until every op issued on this device has completed."""

    def stream_errors(self) -> list[BaseException]:
        """Exceptions the driver caught outside any op since the last call (none on CUDA)."""
        return []

    def op_scope(self, stream: str, label: str):
        """Context manager around one op of ``stream`` (``label``: its stage and op, for messages);
        CPU virtual devices with a memory budget count the op's allocations there."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ timing
    def begin(self) -> None:
        """Called once at the start of every program (CUDA: the timeline's reference event)."""

    def timer_start(self, stream: str) -> Any:
        """A start mark for an op on ``stream`` (see :meth:`timer_span`)."""
        raise NotImplementedError

    def timer_span(self, stream: str, start: Any) -> Callable[[], tuple[float, float]]:
        """After issuing the op: a function giving its ``(start_s, end_s)``, seconds on the host's
        ``perf_counter`` clock; it waits for the op's end marker first (a host that waited only for
        the op's event, with a newer run in flight, may call it before the marker completed)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ data
    def to_device(self, tree: Any, publish: Publish, buffer: torch.Tensor,
                  stage: Callable[[list], list] | None = None) -> int:
        """H2D copy of a host pytree on the ``h2d`` stream into ``buffer`` (a pooled device slot at
        least :func:`~lightning_roundpipe.runtime.backends.pool.packed_nbytes` long).

        ``publish(tree_on_device)`` is called with the destination views as soon as they exist
        (before the data is guaranteed there); ``stage(pairs)`` may replace sources that the driver
        cannot copy asynchronously (pageable memory on CUDA) by pinned staging copies. Returns the
        bytes moved.
        """
        views, pairs = pack(tree, buffer)
        if stage is not None:
            pairs = stage(pairs)
        self.poison([dst for dst, _ in pairs])
        publish(views)
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        self.copy_h2d(pairs, nbytes)
        return nbytes

    def to_host(self, parts: list[tuple[Any, torch.Tensor]], publish: Publish, gradients: bool = False) -> int:
        """D2H copy, on the ``d2h`` stream, of device pytrees into host staging blocks: ``parts`` is
        ``[(device tree, host block)]``; ``publish([host tree, ...])`` receives the destination views
        first (valid once the op's event completed). ``gradients``: weight gradients (a CPU
        virtual device's link sends activations first). Returns the bytes moved."""
        trees, pairs = [], []
        for tree, block in parts:
            views, more = pack(tree, block)
            trees.append(views)
            pairs += more
        self.poison([dst for dst, _ in pairs])
        publish(trees)
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        self.copy_d2h(pairs, nbytes, gradients)
        return nbytes

    @abc.abstractmethod
    def copy_h2d(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> None:
        """``dst.copy_(src)`` for each ``(device view, host tensor)`` pair, on the ``h2d`` stream
        (asynchronous on CUDA: every source is pinned), ``nbytes`` in all."""

    @abc.abstractmethod
    def copy_d2h(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int, gradients: bool = False) -> None:
        """``dst.copy_(src)`` for each ``(host staging view, device tensor)`` pair, on the ``d2h``
        stream. CUDA: asynchronous; a source made by the compute stream (not a pooled buffer) is
        kept referenced until the copy has completed (:meth:`release_after`), never ``record_stream``."""

    def needs_staging(self, tensor: torch.Tensor) -> bool:
        """Whether an upload from host ``tensor`` must first be copied into pinned staging memory
        (CUDA: pageable or non-contiguous memory, which ``cudaMemcpyAsync`` would copy synchronously)."""
        return False

    @abc.abstractmethod
    def allocate_bytes(self, nbytes: int, what: str | None = None) -> torch.Tensor:
        """A new device buffer of ``nbytes`` bytes (``uint8``): a slot of one of the device's pools
        (``what`` names the pool in a memory error; default: the stage weight pool).

        Raises:
            DeviceMemoryError (CPU budget) / torch.OutOfMemoryError (CUDA): it does not fit.
        """

    def allocate_host_bytes(self, nbytes: int) -> torch.Tensor:
        """A new host staging block of ``nbytes`` bytes (``uint8``; exact size, pinned on CUDA); made inside
        a ``d2h`` op too, where a CPU virtual device's memory ledger must not count it (host memory)."""
        with host_side():
            return torch.empty(nbytes, dtype=torch.uint8)

    def pop_step_memory_peak(self) -> int | None:
        """Most bytes allocated on the device at once since the last call, bytes (CUDA: the caching
        allocator's ``max_memory_allocated``; CPU virtual devices: the budget ledger's peak, ``None``
        without ``device_memory_bytes``)."""
        return None

    @abc.abstractmethod
    def mark(self) -> Any:
        """Inside an op, where it runs: a time mark on the op's stream now (CUDA: a timing event on
        the current stream; CPU: the worker's ``perf_counter``). Read with :meth:`elapsed_s` once
        the device has synchronised."""

    @abc.abstractmethod
    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two :meth:`mark` s (device time on CUDA)."""

    def device_budget_bytes(self) -> int | None:
        """Bytes this device may hold at once, for the memory model's check before a program runs
        (:mod:`~lightning_roundpipe.runtime.tuning.device_memory`): a CPU virtual device's
        ``device_memory_bytes`` (``None``: unlimited); CUDA: measured free memory less a margin."""
        ledger = getattr(self, "memory", None)
        return None if ledger is None else ledger.budget_bytes

    def measured_stage_budget(self) -> int | None:
        """Bytes one stage may use on this device, measured after the profiled steps (CUDA); ``None``
        where the budget is given instead (CPU virtual devices: ``device_memory_bytes // 2``)."""
        return None

    def release_after(self, tensors: list[torch.Tensor], stream: str) -> None:
        """``tensors`` (made by the caching allocator on another stream) were used by ``stream``'s work
        issued so far: keep them referenced until that work has completed, so their memory returns to
        the allocator only when no stream uses it any more (CUDA, instead of ``record_stream``);
        nothing on CPU, where the stream workers hold what they use."""

    def poison(self, buffers: torch.Tensor | list[torch.Tensor]) -> None:
        """Debug (CPU ``copy_delay_s``): fill copy destinations with NaN (integers with -1) before the
        copy is published; else nothing."""

    @abc.abstractmethod
    def copy_chunk(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> None:
        """One weight chunk: ``dst.copy_(src)`` for each ``(device bytes, host bytes)`` piece, on the
        ``weights`` stream, ``nbytes`` in all."""

