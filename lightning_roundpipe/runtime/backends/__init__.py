"""Device backends: one interface (:class:`Backend`), CUDA and CPU virtual devices (DESIGN.md section 4)."""

from __future__ import annotations

import os
import warnings
from typing import Sequence

import torch

from lightning_roundpipe.runtime.backends.base import Backend, tree_nbytes
from lightning_roundpipe.runtime.backends.budget import DeviceMemoryError, DeviceMemoryLedger, measuring_default
from lightning_roundpipe.runtime.backends.checker import StreamChecker, StreamCheckError, checking_default
from lightning_roundpipe.runtime.backends.cpu import CpuBackend, Link

__all__ = ["Backend", "CpuBackend", "DeviceMemoryError", "DeviceMemoryLedger", "Link", "StreamCheckError",
           "StreamChecker", "make_backends", "per_device_bytes", "smallest_stage_budget", "stage_memory_bytes", "step_memory_peaks",
           "tree_nbytes"]


def step_memory_peaks(backends: Sequence[Backend]) -> list[int] | None:
    """Per device, the most bytes allocated at once since the last call, bytes
    (:meth:`Backend.pop_step_memory_peak`); logical devices sharing one GPU share its allocator's peak,
    read once. ``None`` when a device measures none (CPU virtual devices without a budget)."""
    by_gpu: dict = {}
    peaks = []
    for backend in backends:
        key = backend.device if backend.is_cuda else id(backend)
        if key not in by_gpu:
            by_gpu[key] = backend.pop_step_memory_peak()
        peaks.append(by_gpu[key])
    return None if any(p is None for p in peaks) else peaks


def per_device_bytes(device_memory_bytes: int | Sequence[int] | None, num_devices: int) -> list[int | None]:
    """``device_memory_bytes`` (one budget for every device, one per device, or ``None``) as one entry
    per device.

    Raises:
        ValueError: an entry that is not a positive int, or a list of another length than the devices.
    """
    if device_memory_bytes is None:
        return [None] * num_devices
    values = [device_memory_bytes] * num_devices if isinstance(device_memory_bytes, int) else list(device_memory_bytes)
    if len(values) != num_devices:
        raise ValueError(f"`device_memory_bytes` has {len(values)} entries for {num_devices} devices. HINT: one int (bytes)"
                         " per device, in the order of the devices, or one int for all of them.")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise ValueError(f"`device_memory_bytes` must be a positive int (bytes), one per device ({num_devices}), or None,"
                         f" got {device_memory_bytes!r}. HINT: e.g. `device_memory_bytes=64 * 2**20` for 64 MiB per CPU"
                         " virtual device, or `[256 * 2**20, 64 * 2**20]` for two devices of unequal memory.")
    return values


def smallest_stage_budget(device_memory_bytes: int | Sequence[int] | None) -> int | None:
    """Half of the smallest device's memory (the per-stage budget every device can give: the next stage
    is prefetched), bytes; ``None`` without a budget."""
    if device_memory_bytes is None:
        return None
    return (device_memory_bytes if isinstance(device_memory_bytes, int) else min(device_memory_bytes)) // 2


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one, else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def warn_if_oversubscribed(num_devices: int) -> None:
    """Warn when CPU virtual devices outnumber the usable cores: each device's compute thread runs one
    intra-op thread and needs a core of its own, while the prediction (``roundpipe/predicted_step(s)``)
    and the automatic partition take the devices to run in parallel."""
    cores = usable_cores()
    if num_devices > cores:
        warnings.warn(
            f"RoundPipe: {num_devices} CPU virtual devices on {cores} usable core(s): the devices' compute threads share"
            " cores, so steps run slower than `roundpipe/predicted_step(s)`, and the automatic partition, which takes the"
            " devices to run in parallel, may not pick the plan that is fastest on this machine. HINT: use at most"
            f" {cores} CPU virtual devices (`Trainer(accelerator='cpu', devices={cores})`), or GPUs.", stacklevel=3)


def make_backends(devices: Sequence[torch.device], cpu_link_bytes_per_s: float | None = None,
                  debug_copy_delay_s: float = 0.0, device_memory_bytes: int | Sequence[int] | None = None,
                  check_streams: bool | None = None) -> list[Backend]:
    """One backend per device: :class:`CpuBackend` for ``cpu`` entries, ``CudaBackend`` for ``cuda:i``.

    Args:
        devices: the devices, in ``device_index`` order (all of one type).
        cpu_link_bytes_per_s: CPU virtual devices: modelled host link rate per direction, bytes/s
            (``None``: unthrottled).
        debug_copy_delay_s: CPU virtual devices: every copy lands this many seconds late (debugging).
        device_memory_bytes: CPU virtual devices: each device's memory budget, bytes, one for all or one
            per device (mixed devices), enforced as
            :class:`~lightning_roundpipe.runtime.backends.budget.DeviceMemoryError` (``None``: unlimited);
            GPUs have their real memory (a CUDA out-of-memory error is the same exception's base class).
        check_streams: CPU virtual devices: the checking mode (one
            :class:`~lightning_roundpipe.runtime.backends.checker.StreamChecker` for all devices);
            ``None``: on when ``LIGHTNING_ROUNDPIPE_CHECK_STREAMS=1`` (the test suite sets it).

    Raises:
        ValueError: mixed device types, a bad link rate (below 1e6 bytes/s too) or delay, or an accelerator other than CPU
            and CUDA (MPS, XPU... are not supported yet).
    """
    devices = [torch.device(d) for d in devices]
    types = {d.type for d in devices}
    if len(types) > 1:
        raise ValueError(f"RoundPipe devices must all be of one type, got {sorted(types)}.")
    if cpu_link_bytes_per_s is not None and not (isinstance(cpu_link_bytes_per_s, (int, float))
                                                 and not isinstance(cpu_link_bytes_per_s, bool) and cpu_link_bytes_per_s > 0):
        raise ValueError(f"`cpu_link_bytes_per_s` must be a positive number of bytes/s or None, got {cpu_link_bytes_per_s!r}."
                         " HINT: 25e9 models PCIe 4.0 x16 one way.")
    if cpu_link_bytes_per_s is not None:
        from lightning_roundpipe.config import check_link_rate

        check_link_rate(cpu_link_bytes_per_s)
    if not (isinstance(debug_copy_delay_s, (int, float)) and 0 <= debug_copy_delay_s < float("inf")):
        raise ValueError(f"`debug_copy_delay_s` must be a finite number of seconds >= 0, got {debug_copy_delay_s!r}.")
    budgets = per_device_bytes(device_memory_bytes, len(devices))
    kind = devices[0].type if devices else "cpu"
    # the checking mode's variables are read again on the worker threads: a bad value is refused here,
    # once, on the calling thread, not once per worker behind a "stream worker stopped" error
    from lightning_roundpipe.runtime.execution.jitter import active_jitter

    active_jitter()
    measuring_default()
    if kind == "cpu":
        warn_if_oversubscribed(len(devices))
        checker = StreamChecker() if (checking_default() if check_streams is None else check_streams) else None
        backends = [CpuBackend(i, cpu_link_bytes_per_s, debug_copy_delay_s, budgets[i], checker)
                    for i in range(len(devices))]
        for backend in backends:
            if backend.memory is not None:
                backend.memory.unequal_budgets = len(set(budgets)) > 1
        return backends
    if kind == "cuda":
        from lightning_roundpipe.runtime.backends.cuda import CudaBackend

        if cpu_link_bytes_per_s is not None or debug_copy_delay_s:
            raise ValueError("`cpu_link_bytes_per_s` and `debug_copy_delay_s` apply to CPU virtual devices only;"
                             " a GPU's link is real. HINT: drop them, or use `accelerator='cpu'`.")
        return [CudaBackend(i, d) for i, d in enumerate(devices)]
    raise ValueError(
        f"RoundPipe does not support accelerator `{kind}` yet; supported: 'cuda' (GPUs) and 'cpu' (CPU virtual devices)."
        " HINT: use `Trainer(accelerator='cuda')` or `Trainer(accelerator='cpu', devices=N)`."
    )


def stage_memory_bytes(devices: Sequence[torch.device], device_memory_bytes: int | Sequence[int] | None) -> int | None:
    """The memory budget of one stage on one worker: half of a device's memory (double buffering: the
    next stage is prefetched). ``device_memory_bytes`` (one worker's memory; with one per worker, the
    smallest) when given; else, on GPUs, the first GPU's measured usable memory
    (:func:`~lightning_roundpipe.runtime.backends.cuda.usable_device_bytes`: free memory less a margin,
    not ``total_memory``) shared by the logical workers on one GPU
    (``parallel_devices=[torch.device("cuda:0")] * 4``: four workers with their own streams on one
    GPU; the most crowded GPU counts); ``None`` on CPU virtual devices without a budget."""
    if device_memory_bytes is not None:
        return smallest_stage_budget(device_memory_bytes)
    first = torch.device(devices[0])
    if first.type != "cuda":
        return None
    counts: dict[int, int] = {}
    for d in map(torch.device, devices):
        index = d.index if d.index is not None else torch.cuda.current_device()
        counts[index] = counts.get(index, 0) + 1
    from lightning_roundpipe.runtime.backends.cuda import usable_device_bytes

    return usable_device_bytes(first) // (2 * max(counts.values()))
