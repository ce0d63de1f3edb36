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

Everything above the driver (ordering, event placement, the stage weight pool, run-ahead) is one code
path, so every CPU test runs the logic a GPU runs.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from lightning_roundpipe.runtime.backends.checker import Access
from lightning_roundpipe.runtime.backends.pool import StagePool
from lightning_roundpipe.runtime.execution.devices import StreamThread
from lightning_roundpipe.schedule.program import STREAMS

Publish = Callable[[Any], None]


def tree_nbytes(tree: Any) -> int:
    """Bytes of all tensors in a pytree."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


class Backend(abc.ABC):
    """One device's streams and data movement.

    Args:
        device_index: position of the device in the strategy's device list.
        device: the ``torch.device`` of the device (``cpu`` for a CPU virtual device).

    Attributes:
        threads: ``threads[stream]``, the issuing :class:`StreamThread` of each stream of :data:`STREAMS`.
        pool: the device's :class:`~lightning_roundpipe.runtime.backends.pool.StagePool` of stage
            weight buffers.
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
        self.pool.clear()

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
        """After issuing the op: a function giving its ``(start_s, end_s)`` once the device is
        synchronised, seconds on the host's ``perf_counter`` clock."""
        raise NotImplementedError

    # ------------------------------------------------------------------ data
    @abc.abstractmethod
    def to_device(self, tree: Any, publish: Publish) -> int:
        """H2D copy of a host pytree on the ``h2d`` stream.

        ``publish(tree_on_device)`` is called with the destination as soon as it exists (before the
        data is guaranteed there); returns the bytes moved.
        """

    @abc.abstractmethod
    def to_host(self, tree: Any, publish: Publish) -> int:
        """D2H copy of a device pytree on the ``d2h`` stream (pinned host memory on CUDA); as
        :meth:`to_device`, ``publish`` receives the host destination first."""

    @abc.abstractmethod
    def allocate_bytes(self, nbytes: int) -> torch.Tensor:
        """A new device buffer of ``nbytes`` bytes (``uint8``): the stage weight pool's slots.

        Raises:
            DeviceMemoryError (CPU budget) / torch.OutOfMemoryError (CUDA): it does not fit.
        """

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

    def measured_stage_budget(self) -> int | None:
        """Bytes one stage may use on this device, measured after the profiled steps (CUDA); ``None``
        where the budget is given instead (CPU virtual devices: ``device_memory_bytes // 2``)."""
        return None

    def record_use(self, tensors: list[torch.Tensor], stream: str) -> None:
        """``tensors``, allocated on the current stream, are also used by ``stream``: CUDA keeps
        their blocks from reuse until that stream's work completes (``record_stream``); nothing on CPU."""

    def poison(self, buffer: torch.Tensor) -> None:
        """Debug (CPU ``copy_delay_s``): fill a stage buffer with NaN before its load; else nothing."""

    @abc.abstractmethod
    def copy_chunk(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> None:
        """One weight chunk: ``dst.copy_(src)`` for each ``(device bytes, host bytes)`` piece, on the
        ``weights`` stream, ``nbytes`` in all."""

    @abc.abstractmethod
    def grads_to_host(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """D2H of a stage's gradients into one flat host buffer (pinned on CUDA), on ``d2h``; returns
        one host view per gradient (valid once the op's event completed)."""
