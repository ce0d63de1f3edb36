"""Reuse of stage weight buffers on a CPU virtual device: the part of a GPU's caching allocator
that RoundPipe's weight streaming depends on.

A GPU keeps freed blocks reserved (PyTorch's CUDA caching allocator), so the weight buffer a stage's
``LOAD`` asks for in step k+1 is the block its ``DROP`` freed in step k, and the upload runs at the
link's rate. torch's CPU allocator returns large blocks to the kernel (glibc ``mmap``/``munmap``
above 32 MiB at most), so every ``LOAD`` of a CPU virtual device wrote into fresh pages: measured on
this project's benchmark model (``benchmarks/cpu_scaling.py``: one 37 MiB fused stage per device),
9,500 page faults per device per step and a 35-50 ms upload, against 14-22 ms into reused memory
with both devices uploading at once (about 6 ms for one thread alone), all of it before the stage's
first microbatch could start.

:class:`BufferCache` keeps the buffers that ``DROP`` hands back (:meth:`give`) and hands one of the
same size to the next ``LOAD`` (:meth:`take`), but only once nothing else references its storage:
its use count (views held by a replica, an autograd graph, a caller) is back to what it was when the
buffer was made. A buffer something still reads is never handed out again; a new one is allocated.
Where the use count cannot be read (a torch without ``torch._C._storage_Use_Count``), nothing is
reused.
"""

from __future__ import annotations

import threading
import weakref

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_uses(tensor: torch.Tensor) -> int | None:
    """References to ``tensor``'s storage (its views and ``tensor`` itself); ``None`` if unknown."""
    if _use_count is None:
        return None
    return int(_use_count(tensor.untyped_storage()._cdata))


class BufferCache:
    """Idle stage weight buffers of one device, by size, for reuse by the next ``LOAD``.

    Args:
        max_idle: most idle buffers kept (>= 0; the oldest is freed first). Default 2: the stages a
            device may hold resident at once (DESIGN.md section 4), so the cache never holds more
            than the device's peak weight bytes.

    Attributes:
        hits: ``take`` calls answered with a kept buffer.
        misses: ``take`` calls that found none (the caller allocates).
    """

    def __init__(self, max_idle: int = 2) -> None:
        if not isinstance(max_idle, int) or isinstance(max_idle, bool) or max_idle < 0:
            raise ValueError(f"`max_idle` must be an int >= 0, got {max_idle!r}.")
        self.max_idle = max_idle
        self.hits = 0
        self.misses = 0
        self._baseline: dict[int, int] = {}  # data_ptr -> use count of the buffer alone
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def register(self, buffer: torch.Tensor) -> None:
        """Record a newly allocated ``buffer`` (nothing else may reference it yet)."""
        if _use_count is None or not self.max_idle:
            return
        key = buffer.data_ptr()
        weakref.finalize(buffer.untyped_storage(), self._baseline.pop, key, None)  # freed: forget it
        uses = storage_uses(buffer)
        with self._lock:
            self._baseline[key] = uses

    def take(self, nbytes: int) -> torch.Tensor | None:
        """An idle buffer of exactly ``nbytes`` bytes that nothing else references, or ``None``."""
        with self._lock:
            for position, buffer in enumerate(self._idle):
                if buffer.numel() == nbytes and storage_uses(buffer) == self._baseline.get(buffer.data_ptr()):
                    del self._idle[position]
                    self.hits += 1
                    return buffer
            self.misses += 1
            return None

    def give(self, buffer: torch.Tensor) -> None:
        """``buffer`` is no longer needed by the program (its stage's ``DROP``)."""
        with self._lock:
            if buffer.data_ptr() not in self._baseline:
                return
            self._idle.append(buffer)
            while len(self._idle) > self.max_idle:
                self._forget(self._idle.pop(0))

    def clear(self) -> None:
        """Free every idle buffer."""
        with self._lock:
            while self._idle:
                self._forget(self._idle.pop())

    @property
    def idle_bytes(self) -> int:
        """Bytes held by idle buffers now."""
        with self._lock:
            return sum(buffer.numel() for buffer in self._idle)

    def _forget(self, buffer: torch.Tensor) -> None:
        self._baseline.pop(buffer.data_ptr(), None)
