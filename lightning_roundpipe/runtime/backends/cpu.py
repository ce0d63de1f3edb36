"""CPU virtual devices: the asynchronous CPU driver (DESIGN.md section 4).

A CPU virtual device has the same four streams as a GPU (``weights``, ``h2d``, ``compute``, ``d2h``),
and the same contract: the executor's issuing thread of a stream *enqueues* each op and runs ahead;
the op runs later, in stream order, on that stream's own worker thread (:class:`CpuStream`), exactly
as a GPU runs a CUDA stream's kernels after the host has moved on. Events are real objects
(:class:`CpuEvent`): ``record`` enqueues a marker that completes the event when the worker reaches it;
``wait_event`` enqueues a marker that blocks the worker until the event completes (on any device);
the host waits only on events (``host_wait``, ``synchronize``). ``compute`` runs the layers on one
intra-op thread (one core; set for the worker thread alone,
:func:`~lightning_roundpipe.runtime.backends.threads.limit_this_thread`, not with the process-wide
``torch.set_num_threads``, which stalled the main thread's optimizer step, issue 20); ``weights``,
``h2d`` and ``d2h`` are the copy engines, whose
copies are real copies into and out of device-local tensors, so transfers overlap compute as on a GPU
and a missing dependency edge is a real race.

Checking mode (``check_streams``; inside each op also :mod:`~lightning_roundpipe.runtime.backends.op_check`:
host syncs and placement): a :class:`~lightning_roundpipe.runtime.backends.checker.StreamChecker`
shared by all devices sees every op's buffer accesses and every wait when they are issued, and raises
when an op touches a buffer it has not waited for (the test suite runs with it on).

Links: the ``weights`` and ``h2d`` streams share one H2D link, ``d2h`` has its own D2H link (a GPU's
two copy engines). A link carries one transfer at a time; when both H2D streams wait for it, the
activation upload goes first (paper section 3.3). With ``link_bytes_per_s`` set, each transfer takes
at least ``bytes / link_bytes_per_s`` seconds (the modelled PCIe regime); ``None``: as fast as the
copy runs.

Memory budget: with ``device_memory_bytes`` set, the device counts the bytes that live on it (its
pools: stage weights, activation transfers, gradient accumulators; everything its streams create) and raises
:class:`~lightning_roundpipe.runtime.backends.budget.DeviceMemoryError` before the budget would be
exceeded (:mod:`~lightning_roundpipe.runtime.backends.budget`).

Speed (mixed devices, DESIGN.md section 12): with :meth:`CpuBackend.set_speed` below 1.0 each op on
the compute worker lasts ``1 / speed`` times the CPU time its thread spent on it: after the op (and,
inside an op, at every :meth:`~CpuBackend.mark`, so the profiled per-layer times slow down alike) the
worker sleeps the difference (``(1 / speed - 1)`` times the op's own time when the host is idle). The
device's work really takes ``1 / speed`` times longer and its stream order is unchanged, so a run on
CPU virtual devices reproduces GPUs of unequal speed; measuring the thread's CPU time rather than the
wall time keeps other threads' use of the host's cores (the fast device's compute, the copies) out of
the slowdown, as a GPU's speed does not depend on the host's load.

Debug: with ``copy_delay_s`` > 0 every copy publishes its (pooled) destination filled with NaN
(floats) or ``-1`` (integers) first, sleeps, and only then copies, so a consumer that does not wait
for the copy (a missing edge) computes on poison and gives a wrong result.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Callable

import torch

from lightning_roundpipe.runtime.backends import op_check
from lightning_roundpipe.runtime.backends.base import Backend
from lightning_roundpipe.runtime.backends.budget import DeviceMemoryLedger, measuring_default
from lightning_roundpipe.runtime.backends.checker import Access, StreamChecker
from lightning_roundpipe.runtime.execution.jitter import pause as jitter_pause
from lightning_roundpipe.runtime.backends.threads import limit_this_thread
from lightning_roundpipe.schedule.program import STREAMS

_ACTIVATION, _WEIGHTS = 0, 1
_POLL_S = 0.05


class CpuEvent:
    """An event of a CPU virtual device's stream: completes when the stream's worker reaches it.

    Attributes:
        time_s: host ``perf_counter`` when it completed (``None`` before), seconds.
        clock: the checking mode's vector clock at record time (``None`` without checking).
    """

    __slots__ = ("_done", "time_s", "clock")

    def __init__(self, clock: dict | None = None) -> None:
        self._done = threading.Event()
        self.time_s: float | None = None
        self.clock = clock

    def complete(self) -> None:
        self.time_s = time.perf_counter()
        self._done.set()

    def query(self) -> bool:
        """Whether the event has completed (as ``torch.cuda.Event.query``)."""
        return self._done.is_set()

    def synchronize(self, alive: Callable[[], bool] | None = None) -> None:
        """Block the calling thread until the event completes (``alive() is False`` stops waiting)."""
        while not self._done.wait(_POLL_S):
            if alive is not None and not alive():
                raise RuntimeError("a RoundPipe CPU stream worker stopped before completing an event")


class CpuStream:
    """One stream of a CPU virtual device: a worker thread that runs enqueued work in order.

    Args:
        name: thread name (``roundpipe-device0-compute-worker``).
        gate: the device's gate: work runs only while it is set (:meth:`CpuBackend.pause`).

    Work items never raise into the worker: ops catch their own errors (the executor records them);
    an unexpected exception is kept in :attr:`error` and the worker goes on, so every event still
    completes and nothing waits forever.
    """

    def __init__(self, name: str, gate: threading.Event) -> None:
        self._items: "queue.SimpleQueue[Callable[[], None] | None]" = queue.SimpleQueue()
        self._gate = gate
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        limit_this_thread(1)
        while True:
            item = self._items.get()
            if item is None:
                return
            while not self._gate.wait(_POLL_S):
                pass
            try:
                jitter_pause()  # schedule jitter (checking mode, `execution/jitter.py`): off unless asked for
                item()
            except BaseException as error:  # noqa: BLE001 - kept for the executor; the stream goes on
                self.error = error
            finally:
                item = None  # the closure (a run, a traceback) must not outlive it

    def put(self, item: Callable[[], None]) -> None:
        self._items.put(item)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self._gate.set()
            self._items.put(None)
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


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


class CpuBackend(Backend):
    """A CPU virtual device: the asynchronous CPU driver (see the module docstring).

    Args:
        device_index: position in the device list.
        link_bytes_per_s: modelled host link rate per direction, bytes/s (``None``: unthrottled).
        copy_delay_s: debug: delay before each copy's data lands, seconds (0: off).
        device_memory_bytes: the device's memory budget, bytes (``None``: unlimited).
        checker: the checking mode's :class:`StreamChecker`, shared by all devices (``None``: off).

    Attributes:
        memory: the :class:`DeviceMemoryLedger` of the budget (``None`` without one).
        streams: ``streams[stream]``, the :class:`CpuStream` worker of each stream.
        checker: the :class:`StreamChecker` (``None`` when checking is off).
    """

    def __init__(self, device_index: int, link_bytes_per_s: float | None = None, copy_delay_s: float = 0.0,
                 device_memory_bytes: int | None = None, checker: StreamChecker | None = None) -> None:
        super().__init__(device_index, torch.device("cpu"))
        self.h2d_link = Link(link_bytes_per_s)
        self.d2h_link = Link(link_bytes_per_s)
        self.copy_delay_s = float(copy_delay_s)
        measure = device_memory_bytes is not None or measuring_default()  # no budget: measure only
        self.memory = DeviceMemoryLedger(device_index, device_memory_bytes) if measure else None
        self.checker = checker
        self._gate = threading.Event()
        self._gate.set()
        self.speed = 1.0
        self._op_since: float | None = None  # compute worker: when the running op's unthrottled span began
        self._cpu_since = 0.0  # compute worker: the thread's CPU time then
        self._owed_s = 0.0  # compute worker: a sleep's overshoot (timer slack), taken off the next sleep
        self.streams = {stream: CpuStream(f"roundpipe-device{device_index}-{stream}-worker", self._gate)
                        for stream in STREAMS}
        self._start_threads()

    def set_speed(self, speed: float) -> None:
        """Make this device's compute ``speed`` times as fast as the host runs it (``0 < speed <= 1``;
        1.0: unthrottled): each compute op, and each span between two :meth:`mark` s inside one, lasts
        its thread's CPU time over ``speed`` (the compute worker sleeps the rest).

        Raises:
            ValueError: ``speed`` not a finite number in (0, 1].
        """
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed <= 1:
            raise ValueError(f"A CPU virtual device's speed must be a number in (0, 1], got {speed!r}."
                             " HINT: relative to the host's own speed, e.g. 0.5 for a device half as fast.")
        self.speed = float(speed)

    @property
    def alive(self) -> bool:
        return super().alive and all(w.alive for w in self.streams.values())

    def close(self) -> None:
        super().close()
        for worker in self.streams.values():
            worker.close()

    def pause(self) -> None:
        """Hold every stream's worker before its next item (the host keeps issuing): tests and
        debugging use it to show what the host issues ahead of the device."""
        self._gate.clear()

    def resume(self) -> None:
        """Let the workers run again after :meth:`pause`."""
        self._gate.set()

    def op_scope(self, stream: str, label: str):
        checks = op_check.op_scope(self, stream, label, self.checker is not None)  # host syncs, placement
        if self.memory is None:
            return checks
        self.memory.set_where(label)
        return op_check.both(checks, self.memory.counting())  # every stream: the copy engines' clones are device memory too

    def _thread_setup(self, stream: str) -> None:
        limit_this_thread(1)

    # ------------------------------------------------------------------ ordering
    def launch(self, stream: str, work: Callable[[], None], access: Access | None = None, label: str = "",
               op: Any = None) -> None:
        if self.checker is not None and access is not None:
            self.checker.issue((self.device_index, stream), label, access, op)
        if stream == "compute" and self.speed != 1.0:
            work = self._throttled(work)
        self.streams[stream].put(work)

    def _throttled(self, work: Callable[[], None]) -> Callable[[], None]:
        """``work`` followed by the sleep that makes it ``1 / speed`` times as long (see :meth:`set_speed`)."""

        def run() -> None:
            self._op_since, self._cpu_since = time.perf_counter(), time.thread_time()
            try:
                work()
            finally:
                self._slow_down()
                self._op_since = None

        return run

    def _slow_down(self) -> None:
        """On the compute worker, inside an op: sleep until the span since the op began (or since the
        last :meth:`mark`) has lasted its CPU time over ``speed``. What a sleep overshoots (the
        kernel's timer slack, tens of microseconds) is taken off the next one, so the device's time is
        ``1 / speed`` times its work however short its ops; a span that the host's load already made
        longer than that sleeps nothing (and owes nothing later)."""
        since = self._op_since
        if since is None:
            return
        owed = (time.thread_time() - self._cpu_since) / self.speed - (time.perf_counter() - since) + self._owed_s
        self._owed_s = 0.0
        if owed > 0:
            slept = time.perf_counter()
            time.sleep(owed)
            self._owed_s = min(0.0, owed - (time.perf_counter() - slept))
        self._op_since, self._cpu_since = time.perf_counter(), time.thread_time()

    def record(self, stream: str) -> CpuEvent:
        event = CpuEvent(self.checker.record((self.device_index, stream)) if self.checker is not None else None)
        self.streams[stream].put(event.complete)
        return event

    def wait_event(self, stream: str, event: Any) -> None:
        if self.checker is not None:
            self.checker.wait((self.device_index, stream), event.clock)
        worker = self.streams[stream]
        self.streams[stream].put(lambda: event.synchronize(lambda: worker.alive))

    def host_wait(self, event: Any) -> None:
        event.synchronize(lambda: self.alive)

    def synchronize(self) -> None:
        for stream in STREAMS:
            self.record(stream).synchronize(lambda: self.alive)

    def stream_errors(self) -> list[BaseException]:
        """Unexpected exceptions the workers caught since the last call (ops report their own)."""
        out = []
        for worker in self.streams.values():
            if worker.error is not None:
                out.append(worker.error)
                worker.error = None
        return out

    # ------------------------------------------------------------------ timing
    def timer_start(self, stream: str) -> CpuEvent:
        event = CpuEvent()
        self.streams[stream].put(event.complete)
        return event

    def timer_span(self, stream: str, start: CpuEvent) -> Callable[[], tuple[float, float]]:
        end = CpuEvent()
        self.streams[stream].put(end.complete)

        def span() -> tuple[float, float]:
            end.synchronize(lambda: self.alive)  # after the op's event, not covered by a wait on it (issue 30)
            return start.time_s, end.time_s

        return span

    # ------------------------------------------------------------------ data
    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int, link: Link, priority: int) -> None:
        with link.transfer(nbytes, priority):
            if self.copy_delay_s:
                time.sleep(self.copy_delay_s)
            for dst, src in pairs:
                dst.copy_(src)

    def copy_h2d(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> None:
        self._copy(pairs, nbytes, self.h2d_link, _ACTIVATION)

    def copy_d2h(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int, gradients: bool = False) -> None:
        self._copy(pairs, nbytes, self.d2h_link, _WEIGHTS if gradients else _ACTIVATION)

    def allocate_bytes(self, nbytes: int, what: str | None = None) -> torch.Tensor:
        if self.memory is not None:
            before = self.memory.where
            where = f"{what} (a slot of {nbytes} bytes), at {before}" if what else None
            self.memory.set_where(where or self.pool_label or f"the stage weight pool (a slot of {nbytes} bytes)")
            self.memory.check(nbytes)  # before the pool's buffer is allocated
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        op_check.track(buffer, id(self), self.device_index)  # device memory (the placement check)
        if self.memory is not None:
            self.memory.track(buffer)
            self.memory.set_where(before)  # the next slot's label names the op, not this slot
        return buffer

    def mark(self) -> float:
        if self._op_since is not None and threading.current_thread() is self.streams["compute"]._thread:
            self._slow_down()  # a throttled op: the span before this mark takes 1 / speed as long
        return time.perf_counter()  # the op runs on this stream's worker: its clock is the stream's

    def elapsed_s(self, start: float, end: float) -> float:
        return end - start

    def pop_step_memory_peak(self) -> int | None:
        return None if self.memory is None else self.memory.pop_step_peak()

    def poison(self, buffers: torch.Tensor | list[torch.Tensor]) -> None:
        if not self.copy_delay_s:
            return
        for buffer in [buffers] if isinstance(buffers, torch.Tensor) else buffers:
            if buffer.dtype == torch.uint8:
                buffer.fill_(255)  # NaN in every float format
            elif buffer.is_floating_point() or buffer.is_complex():
                buffer.fill_(float("nan"))
            else:
                buffer.fill_(-1 if buffer.dtype != torch.bool else True)

    def copy_chunk(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> None:
        with self.h2d_link.transfer(nbytes, _WEIGHTS):
            if self.copy_delay_s:
                time.sleep(self.copy_delay_s)
            for dst, src in pieces:
                dst.copy_(src)
