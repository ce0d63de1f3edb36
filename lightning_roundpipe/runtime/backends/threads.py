"""One thread's intra-op thread count, set without touching the rest of the process.

The CPU driver runs each stream of a CPU virtual device on its own thread, and a compute stream must
use one core (:mod:`~lightning_roundpipe.runtime.backends.cpu`). ``torch.set_num_threads(1)`` would
do that, but in an OpenMP build of torch it also changes three settings of the whole process
(``aten/src/ATen/ParallelOpenMP.cpp``):

- MKL's "dynamic" flag is set to false, so MKL stops choosing a thread count per call and splits
  even a 1000-element ``sqrt`` (AdamW calls one per parameter) over all its threads: an OpenMP fork
  and join per call in the main thread, each waiting for a team thread that may not get a core.
  On a 2-core machine shared with other jobs, the tiny Llama's AdamW step in a fit on 2 CPU
  virtual devices took 0.24-0.57 s on average where a plain step took 8-28 ms, and plain steps
  after the fit stayed slow (issue 20, ``benchmarks/optimizer_step.py``);
- the count every thread initialises itself with at its first parallel op becomes 1: threads
  started later (the user's own, after ``fit``), and the main thread itself when its first
  parallel op comes after the devices started;
- the process's pthreadpool (XNNPACK, QNNPACK) shrinks to one thread.

:func:`limit_this_thread` sets only the calling thread's OpenMP and MKL thread counts (both are
per-thread settings: ``omp_set_num_threads`` and ``mkl_set_num_threads_local``), found in the
OpenMP runtime and MKL that ``libtorch_cpu`` links; where torch has neither (another parallel
backend, a build without these symbols) it falls back to ``torch.set_num_threads``.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any, NamedTuple

import torch

_LIBRARY_NAMES = ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll")


class _Runtime(NamedTuple):
    omp_set_num_threads: Any
    mkl_set_num_threads_local: Any  # None without MKL
    mkl_get_dynamic: Any  # None where the build does not export it


@functools.lru_cache(maxsize=1)
def _runtime() -> _Runtime | None:
    """The per-thread setters of the OpenMP runtime and MKL that torch's CPU library uses (``None``
    when they cannot be found): a lookup through ``libtorch_cpu``'s handle finds the symbols in it
    and in the libraries it links, so the OpenMP runtime is torch's own even where another one is
    loaded in the process."""
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in _LIBRARY_NAMES:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        try:
            library = ctypes.CDLL(path)  # already loaded by torch: the same handle, nothing runs again
        except OSError:
            return None
        omp = getattr(library, "omp_set_num_threads", None)
        if omp is None:
            return None
        omp.argtypes, omp.restype = [ctypes.c_int], None
        # MKL's C functions are the CamelCase ones (its lower-case names are C macros for them, and
        # the exported lower-case symbols are the Fortran interface, which takes pointers)
        mkl = getattr(library, "MKL_Set_Num_Threads_Local", None)
        if mkl is not None:
            mkl.argtypes, mkl.restype = [ctypes.c_int], ctypes.c_int
        dynamic = None
        for symbol in ("MKL_Get_Dynamic", "mkl_serv_get_dynamic"):
            dynamic = getattr(library, symbol, None)
            if dynamic is not None:
                dynamic.argtypes, dynamic.restype = [], ctypes.c_int
                break
        return _Runtime(omp, mkl, dynamic)
    return None


def limit_this_thread(num_threads: int = 1) -> bool:
    """Run the calling thread's CPU ops on ``num_threads`` intra-op threads, leaving every other
    thread's count and the process-wide settings of ``torch.set_num_threads`` as they are.

    Args:
        num_threads: intra-op threads for the calling thread (>= 1).

    Returns:
        ``True`` when only the calling thread was set; ``False`` when this torch build offers no
        per-thread setting and ``torch.set_num_threads(num_threads)`` was called instead (process-wide).

    Raises:
        ValueError: when ``num_threads`` < 1.
    """
    if num_threads < 1:
        raise ValueError(f"`num_threads` must be at least 1, got {num_threads}. HINT: 1 runs the thread's ops on one core.")
    # ATen initialises a thread's count at its first parallel op (from the process-wide count): do it
    # now, or it would overwrite the count set below
    torch.get_num_threads()
    runtime = _runtime()
    if runtime is not None:
        runtime.omp_set_num_threads(num_threads)
        if runtime.mkl_set_num_threads_local is not None:
            runtime.mkl_set_num_threads_local(num_threads)
        if torch.get_num_threads() == num_threads:
            return True
    torch.set_num_threads(num_threads)
    return False


def mkl_dynamic() -> bool | None:
    """Whether MKL may choose its thread count per call (MKL's default; ``torch.set_num_threads``
    turns it off for the whole process); ``None`` where the build does not tell."""
    runtime = _runtime()
    if runtime is None or runtime.mkl_get_dynamic is None:
        return None
    return bool(runtime.mkl_get_dynamic())
