"""Exact-size pinned host memory (DESIGN.md section 4).

``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds every
block up to a power of two (a model's shadows take 10-15 % more pinned memory than their bytes; one
large staging block up to twice its size) and keeps freed blocks for itself. :func:`pinned_bytes`
instead page-locks an ordinary allocation of the requested size (rounded up to whole pages) with
``cudaHostRegister``, as ``torch.distributed``'s checkpoint stager does. The registry keeps each block
alive, one registration per block, until :func:`collect` finds nothing else referencing it and
unregisters it: unregistration happens only where :func:`collect` is called (RoundPipe: the main
thread, after a program finished and at the engine's close), never in a finalizer on whichever thread
dropped the last reference (a stream's issuing thread replacing a grown block, the d2h thread, the
garbage collector). :func:`is_pinned` knows these blocks (so does ``Tensor.is_pinned()`` on current
CUDA drivers; the registry does not depend on it); :func:`pinned_stats` counts them.

Without CUDA, :func:`pinned_bytes` returns ordinary memory (nothing to page-lock for CPU virtual
devices). No device is touched.
"""

from __future__ import annotations

import bisect
import mmap
import threading

import torch

_PAGE = mmap.PAGESIZE
_lock = threading.Lock()
_starts: list[int] = []  # registered ranges, sorted by start address
_ends: dict[int, int] = {}
_owned: dict[int, tuple[torch.Tensor, int]] = {}  # start -> (the allocation, its storage's use count alone)


def _use_count(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def collect() -> int:
    """Unregister and free the registered blocks nothing outside this registry references; returns
    their registered bytes (page-rounded). Call it from one thread at known points (RoundPipe: the main thread, after a program
    finished, and at close), where no copy can still read a block: a block is unreferenced only once
    its program dropped it."""
    with _lock:
        unused = [start for start, (raw, alone) in _owned.items() if _use_count(raw) == alone]
        freed, nbytes = [], 0
        for start in unused:
            freed.append(_owned.pop(start)[0])
            _starts.pop(bisect.bisect_left(_starts, start))
            nbytes += _ends.pop(start) - start
    for start in unused:
        try:
            torch.cuda.cudart().cudaHostUnregister(start)
        except Exception:  # noqa: BLE001 - the CUDA runtime is gone (interpreter exit): the OS frees it
            pass
    del freed  # the memory goes back to the host allocator after its unregistration
    return nbytes


def pinned_stats() -> tuple[int, int]:
    """``(blocks, bytes)`` registered now (page-rounded sizes)."""
    with _lock:
        return len(_starts), sum(_ends[start] - start for start in _starts)


def pinned_bytes(nbytes: int, pin: bool = True) -> torch.Tensor:
    """A ``uint8`` host tensor of ``nbytes`` bytes, page-locked when ``pin`` and CUDA is available.

    The block is page-aligned and its registered range covers only its own pages (two registrations
    never share a page), so it costs at most one page more than ``nbytes``.

    Raises:
        RuntimeError: ``cudaHostRegister`` failed (out of page-lockable memory).
    """
    if not (pin and torch.cuda.is_available()):
        return torch.empty(nbytes, dtype=torch.uint8)
    size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
    raw = torch.empty(size + _PAGE, dtype=torch.uint8)
    alone = _use_count(raw)
    offset = (-raw.data_ptr()) % _PAGE
    start = raw.data_ptr() + offset
    error = int(torch.cuda.cudart().cudaHostRegister(start, size, 1))  # 1: cudaHostRegisterPortable
    if error != 0:
        raise RuntimeError(f"RoundPipe could not page-lock {size} bytes of host memory (cudaError {error})."
                           " HINT: the machine's page-lockable memory is exhausted (`ulimit -l`, other pinned"
                           " buffers); use smaller microbatches or fewer of them.")
    with _lock:
        position = bisect.bisect_left(_starts, start)
        _starts.insert(position, start)
        _ends[start] = start + size
        _owned[start] = (raw, alone)
    return raw[offset:offset + nbytes]


def pinned_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """An uninitialised contiguous host tensor, page-locked as :func:`pinned_bytes` (exact size)."""
    numel = 1
    for size in shape:
        numel *= int(size)
    return pinned_bytes(numel * dtype.itemsize, pin).view(dtype).view(shape)


def is_pinned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory is page-locked (torch's pinned allocator or :func:`pinned_bytes`)."""
    if tensor.device.type != "cpu":
        return False
    pointer = tensor.data_ptr()
    with _lock:
        position = bisect.bisect_right(_starts, pointer) - 1
        if position >= 0 and pointer < _ends[_starts[position]]:
            return True
    return bool(torch.cuda.is_available() and tensor.is_pinned())
