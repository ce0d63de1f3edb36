"""The ``sanitizer`` step of ``scripts/gpu_check.sh`` (see ``benchmarks/gpu_check.py``): a small model, 2 steps
of RoundPipe under ``TORCH_CUDA_SANITIZER=1``. Torch enables the sanitizer (a thread-local dispatch mode) in
the main thread only; RoundPipe launches its kernels from one issuing thread per (device, stream), so this
check also enters the sanitizer's mode in every CUDA stream thread of the runtime, after proving that a
race in such a thread is caught (a positive control: two streams writing one tensor without an event).
Run through ``benchmarks/gpu_check.py sanitizer``."""

from __future__ import annotations

import argparse
import os
import threading
from typing import Any

import torch


def _sanitizer() -> Any | None:
    """torch's CUDA sanitizer when ``TORCH_CUDA_SANITIZER`` enabled it at ``import torch``, else None."""
    try:
        import torch.cuda._sanitizer as csan
    except Exception:  # noqa: BLE001 - no sanitizer in this torch build
        return None
    return csan if getattr(csan.cuda_sanitizer, "enabled", False) else None


def sanitize_runtime_threads(csan: Any) -> list[str]:
    """The runtime's CUDA stream threads enter the sanitizer's dispatch mode themselves
    (``CudaBackend._thread_setup``; torch enters it in the main thread only); this records the names of
    the threads started from now on in which the mode is active (the check that every one is covered)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from lightning_roundpipe.runtime.backends.cuda import CudaBackend

    entered: list[str] = []
    original = CudaBackend._thread_setup

    def setup(self, stream: str) -> None:
        original(self, stream)
        if any(mode is csan.cuda_sanitizer.dispatch for mode in _get_current_dispatch_mode_stack()):
            entered.append(threading.current_thread().name)

    CudaBackend._thread_setup = setup
    return entered


def sanitizer_positive_control(csan: Any, device: torch.device) -> str | None:
    """In a new thread with the mode entered as in the runtime's: write one tensor on two streams
    without an event between them. Returns the sanitizer's message (``None``: not caught)."""
    caught: list[str] = []

    def race() -> None:
        torch.cuda.set_device(device)
        csan.cuda_sanitizer.dispatch.__enter__()
        first, second = torch.cuda.Stream(device), torch.cuda.Stream(device)
        with torch.cuda.stream(first):
            x = torch.empty(1 << 20, device=device)
            x.fill_(1.0)
        with torch.cuda.stream(second):
            try:
                x.add_(1.0)
            except csan.CUDASanitizerErrors as error:
                caught.append(str(error).strip().splitlines()[0])
        torch.cuda.synchronize(device)

    thread = threading.Thread(target=race, name="sanitizer-positive-control")
    thread.start()
    thread.join()
    return caught[0] if caught else None


def check_sanitizer(core: Any, args: argparse.Namespace, report: Any) -> bool:
    csan = _sanitizer() if args.accelerator == "cuda" else None
    info: dict[str, Any] = {"env": os.environ.get("TORCH_CUDA_SANITIZER"), "enabled": csan is not None}
    threads: list[str] = []
    if csan is not None:
        info["positive_control"] = sanitizer_positive_control(csan, args.device_list[0])
        threads = sanitize_runtime_threads(csan)
    report.update(sanitizer=info)
    module, _ = core.fit(args, core.make_model(args), True, 2, "adamw", args.lr, partition="default")
    losses = [float(x) for x in module.losses]
    info["runtime_threads_sanitized"] = len(threads)
    problems = []
    if len(losses) != 2 or not all(map(core._finite, losses)):
        problems.append(f"losses {losses}")
    if args.accelerator == "cuda":
        if csan is None:
            problems.append("the sanitizer is off: run with TORCH_CUDA_SANITIZER=1")
        else:
            if info["positive_control"] is None:
                problems.append("the positive control's race was not caught in a worker thread")
            if not threads:
                problems.append("no runtime stream thread ran under the sanitizer")
    report.update(sanitizer=info, losses=losses, problems=problems, ok=not problems)
    return not problems
