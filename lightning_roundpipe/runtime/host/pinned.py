"""Exact-size pinned host memory (DESIGN.md section 4).

``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds every
block up to a power of two (a model's shadows take 10-15 % more pinned memory than their bytes; one
large staging block up to twice its size) and keeps freed blocks for itself. :func:`pinned_bytes`
instead page-locks an ordinary allocation of the requested size (rounded up to whole pages) with
``cudaHostRegister``, as ``torch.distributed``'s checkpoint stager does, and unregisters it when its
storage is freed. :func:`is_pinned` knows these blocks (so does ``Tensor.is_pinned()`` on current
CUDA drivers; the registry does not depend on it).

Without CUDA, :func:`pinned_bytes` returns ordinary memory (nothing to page-lock for CPU virtual
devices). No device is touched.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import weakref

import torch

_PAGE = mmap.PAGESIZE
_lock = threading.Lock()
_starts: list[int] = []  # registered ranges, sorted by start address
_ends: dict[int, int] = {}


def _unregister(start: int) -> None:
    with _lock:
        position = bisect.bisect_left(_starts, start)
        if position < len(_starts) and _starts[position] == start:
            _starts.pop(position)
            _ends.pop(start, None)
    try:
        torch.cuda.cudart().cudaHostUnregister(start)
    except Exception:  # noqa: BLE001 - at interpreter exit the CUDA runtime may be gone; the OS frees it
        pass


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
    offset = (-raw.data_ptr()) % _PAGE
    block = raw[offset:offset + size]
    start = block.data_ptr()
    error = int(torch.cuda.cudart().cudaHostRegister(start, size, 1))  # 1: cudaHostRegisterPortable
    if error != 0:
        raise RuntimeError(f"RoundPipe could not page-lock {size} bytes of host memory (cudaError {error})."
                           " HINT: the machine's page-lockable memory is exhausted (`ulimit -l`, other pinned"
                           " buffers); use smaller microbatches or fewer of them.")
    with _lock:
        position = bisect.bisect_left(_starts, start)
        _starts.insert(position, start)
        _ends[start] = start + size
    weakref.finalize(block.untyped_storage(), _unregister, start)
    return block[:nbytes]


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
