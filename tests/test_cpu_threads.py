"""The CPU driver's threads run on one intra-op thread each and leave the process's settings alone.

Issue 20: ``torch.set_num_threads(1)`` in the CPU virtual devices' threads also switched MKL's
per-call thread choice off for the whole process and made every thread started later use one
thread; the main thread's AdamW step then forked an OpenMP team for every parameter's ``sqrt``
(0.24-0.57 s a step on average where a plain step took 8-28 ms, on 2 shared cores:
``benchmarks/optimizer_step.py``).

Oracles: torch's own settings measured before any backend exists (the main thread's count, the
count a new thread gets, MKL's dynamic flag), the driver's contract that a compute stream uses one
core, and the operating system's list of the process's threads (an op that runs on more than one
intra-op thread starts an OpenMP team).
"""

from __future__ import annotations

import os
import threading

import lightning as L
import pytest
import torch

from _helpers import MLPModule, VectorData, fit_params
from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.runtime.backends import make_backends
from lightning_roundpipe.runtime.backends.threads import limit_this_thread, mkl_dynamic
from lightning_roundpipe.schedule.program import STREAMS

PARALLEL_NUMEL = 1 << 18  # above ATen's grain size (32768): runs on every intra-op thread the thread has


def _new_thread_num_threads() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def _count_after_parallel_op() -> int:
    torch.ones(PARALLEL_NUMEL).mul_(2.0).sqrt_()  # a parallel op first: ATen's lazy per-thread setup has run
    return torch.get_num_threads()


def test_cpu_device_threads_use_one_thread_and_leave_the_process_settings_as_they_were():
    main_before, new_before, dynamic_before = torch.get_num_threads(), _new_thread_num_threads(), mkl_dynamic()
    backends = make_backends([torch.device("cpu")] * 2)
    try:
        counts: dict[tuple[int, str, str], int] = {}
        for backend in backends:
            for stream in STREAMS:
                def on_worker(key=(backend.device_index, stream, "worker")) -> None:
                    counts[key] = _count_after_parallel_op()

                backend.launch(stream, on_worker)  # runs on the stream's worker thread
                backend.host_wait(backend.record(stream))
                key = (backend.device_index, stream, "issuing")
                backend.threads[stream].submit(lambda key=key: counts.__setitem__(key, _count_after_parallel_op())).wait()
        assert counts == {key: 1 for key in counts} and len(counts) == 2 * len(STREAMS) * 2
        # the process-wide settings torch.set_num_threads changes are untouched
        assert torch.get_num_threads() == main_before
        assert _new_thread_num_threads() == new_before
        assert mkl_dynamic() == dynamic_before
    finally:
        for backend in backends:
            backend.close()


class ThreadCounts(L.Callback):
    """During the first batch end: the intra-op thread count of RoundPipe's host threads (the
    executor's gradient and refresh threads, the asynchronous optimizer's thread)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.counts:
            return
        executor = trainer.strategy.engine.executor
        threads = {"host-grads": executor.host, "host-refresh": executor.refresher,
                   "optimizer": trainer.strategy.async_optimizer.stepper._thread}
        for name, thread in threads.items():
            thread.submit(lambda name=name: self.counts.__setitem__(name, _count_after_parallel_op())).wait()


def test_roundpipe_host_threads_use_one_thread_on_cpu_devices_and_fit_leaves_the_process_settings():
    main_before, new_before, dynamic_before = torch.get_num_threads(), _new_thread_num_threads(), mkl_dynamic()
    probe = ThreadCounts()
    fit_params(lambda: MLPModule(scheduler=False), VectorData(), strategy=RoundPipeStrategy(num_microbatches=2, optimizer="async"),
               devices=2, max_steps=2, callbacks=[probe])
    # the devices own the cores: the threads that work while they compute use one each
    assert probe.counts == {"host-grads": 1, "host-refresh": 1, "optimizer": 1}
    assert torch.get_num_threads() == main_before
    assert _new_thread_num_threads() == new_before
    assert mkl_dynamic() == dynamic_before


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc/self/task")
def test_a_limited_thread_starts_no_openmp_team_and_the_main_thread_keeps_its_count():
    main_before = torch.get_num_threads()
    if main_before < 2:
        pytest.skip("torch runs one intra-op thread in this process: nothing to limit")

    def tasks() -> set[str]:  # the process's OS threads (an exiting thread leaves, it never joins)
        return set(os.listdir("/proc/self/task"))

    seen: dict[str, object] = {}

    def limited() -> None:
        seen["per_thread"] = limit_this_thread(1)
        before = tasks()
        seen["count"] = _count_after_parallel_op()
        torch.randn(256, 256) @ torch.randn(256, 256)  # MKL's gemm in this thread
        seen["new_tasks"] = len(tasks() - before)

    def unlimited() -> None:  # the oracle that the op would start a team: a fresh thread, torch's default count
        before = tasks()
        torch.ones(PARALLEL_NUMEL).mul_(2.0).sqrt_()
        seen["unlimited_new_tasks"] = len(tasks() - before)

    for target in (limited, unlimited):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert seen["count"] == 1
    assert seen["new_tasks"] == 0 < seen["unlimited_new_tasks"]
    if seen["per_thread"]:  # this torch build lets one thread be set alone (the fallback sets the process)
        assert torch.get_num_threads() == main_before
        assert _new_thread_num_threads() == main_before


def test_limit_this_thread_refuses_a_count_below_one():
    with pytest.raises(ValueError, match="`num_threads` must be at least 1"):
        limit_this_thread(0)
