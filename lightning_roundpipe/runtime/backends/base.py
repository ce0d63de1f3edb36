"""The backend interface: what the executor needs from one device to run its four streams.

The executor (:mod:`lightning_roundpipe.runtime.executor`) walks each stream's op list of the
stream program on that stream's :class:`~lightning_roundpipe.runtime.devices.StreamThread` and asks
the backend to move or compute data there. Two implementations:

- :class:`~lightning_roundpipe.runtime.backends.cpu.CpuBackend`: a CPU virtual device; copies are
  real copies done synchronously by the copy stream's thread, optionally throttled to a modelled
  host link (bytes/s);
- :class:`~lightning_roundpipe.runtime.backends.cuda.CudaBackend`: one GPU; ops are enqueued
  asynchronously on four CUDA streams and ordered by CUDA events.

Synchronisation contract: when a stream thread has *issued* an op it calls :meth:`Backend.record`,
which returns a device event (``None`` on the CPU, where issued means done); a consumer on any
device first waits until its producers are issued (a host flag), then calls
:meth:`Backend.wait_event` on each producer's device event. The host itself waits on a device event
(:meth:`Backend.host_wait`) only where the CPU consumes the data.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from lightning_roundpipe.runtime.devices import StreamThread
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
        threads: ``threads[stream]``, one :class:`StreamThread` per stream of :data:`STREAMS`.
    """

    is_cuda = False

    def __init__(self, device_index: int, device: torch.device) -> None:
        self.device_index = device_index
        self.device = torch.device(device)
        self.threads: dict[str, StreamThread] = {}

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

    # ------------------------------------------------------------------ ordering
    def stream_context(self, stream: str):
        """Context manager making ``stream`` current in the calling thread (no-op on the CPU)."""
        return contextlib.nullcontext()

    def record(self, stream: str) -> Any:
        """After issuing an op on ``stream``: the device event a consumer waits on (``None``: done)."""
        return None

    def wait_event(self, stream: str, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (recorded by any device) before its next op."""

    def host_wait(self, event: Any) -> None:
        """Block the calling host thread until ``event`` has completed."""

    def synchronize(self) -> None:
        """Block until every op issued on this device has completed."""

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
    def empty_bytes(self, nbytes: int) -> torch.Tensor:
        """A device buffer of ``nbytes`` bytes (``uint8``) for a stage's weights."""

    def release_bytes(self, buffer: torch.Tensor) -> None:
        """The program is done with ``buffer`` (from :meth:`empty_bytes`; its stage's ``DROP``): the
        backend may hand it to a later :meth:`empty_bytes` once nothing references it (CUDA: the
        caching allocator does this when the last reference goes)."""

    @abc.abstractmethod
    def copy_chunk(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> None:
        """One weight chunk: ``dst.copy_(src)`` for each ``(device bytes, host bytes)`` piece, on the
        ``weights`` stream, ``nbytes`` in all."""

    @abc.abstractmethod
    def grads_to_host(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """D2H of a stage's gradients into one flat host buffer (pinned on CUDA), on ``d2h``; returns
        one host view per gradient (valid once the op's event completed)."""

    def compute_sync(self) -> None:
        """Wait until the compute stream is idle (profiling only)."""
