"""CPU virtual devices: a compute thread and copy-engine threads per device (DESIGN.md section 4).

A CPU virtual device has the same four streams as a GPU, each a host thread walking its op list:
``compute`` runs the layers with ``torch.set_num_threads(1)`` (one core); ``weights``, ``h2d`` and
``d2h`` are its copy engines. Uploads and downloads are real copies into and out of device-local
tensors, done by the copy thread in program order, so transfers overlap compute exactly as they
would on a GPU (and a missing dependency edge is a real race).

Links: the ``weights`` and ``h2d`` streams share one H2D link, ``d2h`` has its own D2H link (a GPU's
two copy engines). A link carries one transfer at a time; when both H2D streams wait for it, the
activation upload goes first (paper section 3.3). With ``link_bytes_per_s`` set, each transfer takes
at least ``bytes / link_bytes_per_s`` seconds (the modelled PCIe regime); ``None``: as fast as the
copy runs.

Memory budget: with ``device_memory_bytes`` set, the device counts the bytes that live on it (weights,
uploaded activations, everything its compute creates) and raises
:class:`~lightning_roundpipe.runtime.backends.budget.DeviceMemoryError` before the budget would be
exceeded (:mod:`~lightning_roundpipe.runtime.backends.budget`).

Debug: with ``copy_delay_s`` > 0 every copy publishes its destination filled with NaN (floats) or
``-1`` (integers) first, sleeps, and only then copies, so a consumer that does not wait for the
copy (a missing edge) computes on poison and gives a wrong result.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from lightning_roundpipe.runtime.backends.base import Backend, Publish, tree_nbytes
from lightning_roundpipe.runtime.backends.budget import DeviceMemoryLedger
from lightning_roundpipe.runtime.backends.buffer_cache import BufferCache

_ACTIVATION, _WEIGHTS = 0, 1


class Link:
    """One direction of a modelled host link: one transfer at a time, activations first.

    Args:
        bytes_per_s: modelled rate, bytes/s (``None``: no throttling).
    """

    def __init__(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s
        self._cond = threading.Condition()
        self._busy = False
        self._waiting = [0, 0]  # per priority

    @contextlib.contextmanager
    def transfer(self, nbytes: int, priority: int):
        """Hold the link for one transfer of ``nbytes`` bytes (at least ``nbytes / rate`` seconds)."""
        with self._cond:
            self._waiting[priority] += 1
            while self._busy or (priority == _WEIGHTS and self._waiting[_ACTIVATION]):
                self._cond.wait(0.05)
            self._waiting[priority] -= 1
            self._busy = True
        start = time.perf_counter()
        try:
            yield
            if self.bytes_per_s:
                left = start + nbytes / self.bytes_per_s - time.perf_counter()
                if left > 0:
                    time.sleep(left)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def _poison(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    return out.fill_(float("nan")) if out.is_floating_point() or out.is_complex() else out.fill_(-1 if out.dtype != torch.bool else True)


class CpuBackend(Backend):
    """A CPU virtual device.

    Args:
        device_index: position in the device list.
        link_bytes_per_s: modelled host link rate per direction, bytes/s (``None``: unthrottled).
        copy_delay_s: debug: delay before each copy's data lands, seconds (0: off).
        device_memory_bytes: the device's memory budget, bytes (``None``: unlimited).

    Attributes:
        memory: the :class:`DeviceMemoryLedger` of the budget (``None`` without one).
        buffers: the :class:`~lightning_roundpipe.runtime.backends.buffer_cache.BufferCache` of stage
            weight buffers, as a GPU's caching allocator keeps them (``None`` with a memory budget,
            where every buffer is allocated and counted anew).
    """

    def __init__(self, device_index: int, link_bytes_per_s: float | None = None, copy_delay_s: float = 0.0,
                 device_memory_bytes: int | None = None) -> None:
        super().__init__(device_index, torch.device("cpu"))
        self.h2d_link = Link(link_bytes_per_s)
        self.d2h_link = Link(link_bytes_per_s)
        self.copy_delay_s = float(copy_delay_s)
        self.memory = None if device_memory_bytes is None else DeviceMemoryLedger(device_index, device_memory_bytes)
        self.buffers = BufferCache() if self.memory is None else None
        self._start_threads()

    def close(self) -> None:
        super().close()
        if self.buffers is not None:
            self.buffers.clear()

    def op_scope(self, stream: str, label: str):
        if self.memory is None:
            return contextlib.nullcontext()
        self.memory.set_where(label)
        return self.memory.counting() if stream == "compute" else contextlib.nullcontext()

    def _thread_setup(self, stream: str) -> None:
        torch.set_num_threads(1)

    # ------------------------------------------------------------------ timing
    def timer_start(self, stream: str) -> float:
        return time.perf_counter()

    def timer_span(self, stream: str, start: float) -> Callable[[], tuple[float, float]]:
        end = time.perf_counter()
        return lambda: (start, end)

    # ------------------------------------------------------------------ data
    def _copy_tree(self, tree: Any, publish: Publish, link: Link, priority: int, to_device: bool = False) -> int:
        nbytes = tree_nbytes(tree)
        if to_device and self.memory is not None:
            self.memory.check(nbytes)  # before the copy allocates
            inner = publish

            def publish(out: Any) -> None:
                self.memory.track_tree(out)
                inner(out)
        with link.transfer(nbytes, priority):
            if self.copy_delay_s:
                pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

                def dest(t: Any) -> Any:
                    if not isinstance(t, torch.Tensor):
                        return t
                    out = _poison(t)
                    pairs.append((out, t))
                    return out

                publish(pytree.tree_map(dest, tree))
                time.sleep(self.copy_delay_s)
                for out, src in pairs:
                    out.copy_(src)
            else:
                publish(pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree))
        return nbytes

    def to_device(self, tree: Any, publish: Publish) -> int:
        return self._copy_tree(tree, publish, self.h2d_link, _ACTIVATION, to_device=True)

    def to_host(self, tree: Any, publish: Publish) -> int:
        return self._copy_tree(tree, publish, self.d2h_link, _ACTIVATION)

    def empty_bytes(self, nbytes: int) -> torch.Tensor:
        buf = self.buffers.take(nbytes) if self.buffers is not None else None
        if buf is None:
            if self.memory is not None:
                self.memory.check(nbytes)  # before the stage's weight buffer is allocated
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if self.memory is not None:
                self.memory.track(buf)
            if self.buffers is not None:
                self.buffers.register(buf)
        if self.copy_delay_s:
            buf.fill_(255)  # NaN in every float format
        return buf

    def release_bytes(self, buffer: torch.Tensor) -> None:
        if self.buffers is not None:
            self.buffers.give(buffer)

    def copy_chunk(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> None:
        with self.h2d_link.transfer(nbytes, _WEIGHTS):
            if self.copy_delay_s:
                time.sleep(self.copy_delay_s)
            for dst, src in pieces:
                dst.copy_(src)

    def grads_to_host(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        with self.d2h_link.transfer(nbytes, _WEIGHTS):
            if self.copy_delay_s:
                time.sleep(self.copy_delay_s)
            return [g.detach().clone() for g in grads]
