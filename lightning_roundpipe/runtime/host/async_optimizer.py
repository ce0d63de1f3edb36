"""`BackgroundStepper`: the CPU thread of the asynchronous optimizer (no Lightning here).

RoundPipe paper (arXiv 2604.27085), section 4 ("RoundPipe" vs "RoundPipe-sync"): the CPU optimizer
step of training step k runs while the devices compute step k+1 on weights one step stale. This
module is the mechanism only: one thread that runs the jobs it is given (optimizer steps) in
submission order, and a
:meth:`BackgroundStepper.wait` the caller puts before everything that reads or writes the master
weights or their ``.grad``. Which reads those are, and when the pipeline's weight snapshot is
refreshed, is decided by the caller (``integration/async_step.py`` for Lightning).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Callable

from lightning_roundpipe.runtime.backends.threads import limit_this_thread
from lightning_roundpipe.runtime.execution.devices import StreamThread


def _lower_priority(niceness: int) -> None:
    """Raise the calling thread's niceness (Linux: ``setpriority`` on the thread id), if possible."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(os.getpriority(os.PRIO_PROCESS, 0), niceness))
    except (AttributeError, OSError):  # not Linux, or not permitted: keep the inherited priority
        pass


def _setup_thread(niceness: int | None, intra_op_threads: int | None) -> None:
    if niceness is not None:
        _lower_priority(niceness)
    if intra_op_threads is not None:
        limit_this_thread(intra_op_threads)


class BackgroundStepper:
    """Runs jobs (optimizer steps) on one CPU thread, in order.

    A job must not set a tensor's ``.grad`` that another thread may read meanwhile (torch's
    ``.grad`` setter and getter are not safe against each other across threads): the caller runs
    such work (``zero_grad``) itself after :meth:`wait`.

    ``pending`` is the caller's own view: ``True`` from a :meth:`submit` until the next
    :meth:`wait` returns, whatever the thread has done meanwhile, so a caller that branches on it
    behaves the same whatever the timing.

    Args:
        name: name of the thread.
        niceness: scheduling niceness of the thread (Linux, 0..19; ``None``: inherit): the devices'
            threads go first, the step takes the idle cycles (ignored where not supported).
        intra_op_threads: intra-op threads of the thread's CPU ops, set for this thread alone
            (:func:`~lightning_roundpipe.runtime.backends.threads.limit_this_thread`; ``None``: torch's default).
    """

    def __init__(self, name: str = "roundpipe-optimizer", niceness: int | None = 10,
                 intra_op_threads: int | None = None) -> None:
        self._thread = StreamThread(name, setup=functools.partial(_setup_thread, niceness, intra_op_threads))
        self._done: list[threading.Event] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._error_job = ""
        self.busy_s = 0.0
        """Seconds the thread spent running jobs since the last :meth:`pop_stats`."""
        self.step_busy_s = 0.0
        """The part of :attr:`busy_s` spent in jobs submitted with ``optimizer_step=True`` (the host's
        optimizer rate is measured on these alone: a weight snapshot refresh on the thread is not an
        optimizer step)."""
        self.waited_s = 0.0
        """Seconds :meth:`wait` blocked the caller since the last :meth:`pop_stats`."""

    @property
    def pending(self) -> bool:
        """Whether a job was submitted and not yet waited for (by the caller, not by the thread)."""
        return bool(self._done)

    def submit(self, fn: Callable[[], object], description: str = "job",
               on_skip: Callable[[], object] | None = None, optimizer_step: bool = True) -> None:
        """Queue ``fn()`` behind the jobs already queued and return at once.

        After a job raised, the jobs queued behind it are skipped (the error is re-raised by the
        next :meth:`wait`); a skipped job's ``on_skip()`` runs instead (on the thread).

        Args:
            fn: the job (e.g. ``optimizer.step``).
            description: what the job is, for the note added to its exception
                (``"optimizer step 12"``).
            on_skip: called instead of ``fn`` when the job is skipped (e.g. to set events others wait for).
            optimizer_step: whether the job's time counts in :attr:`step_busy_s` (``False`` for other
                host work run on the thread, such as the weight snapshot refresh).

        Raises:
            RuntimeError: when the thread was closed.
        """
        if not self._thread.alive:
            raise RuntimeError("RoundPipe: the asynchronous optimizer thread is closed; submit() after close().")

        def job() -> None:
            if self._error is not None:
                if on_skip is not None:
                    on_skip()
                return
            start = time.perf_counter()
            try:
                fn()
            except BaseException as error:  # re-raised in the caller's thread by wait()
                with self._lock:
                    self._error, self._error_job = error, description
            finally:
                with self._lock:
                    elapsed = time.perf_counter() - start
                    self.busy_s += elapsed
                    if optimizer_step:
                        self.step_busy_s += elapsed

        self._done.append(self._thread.submit(job))

    def count_step_time(self, seconds: float) -> None:
        """Add ``seconds`` of optimizer work run elsewhere (a staleness correction of the gradient in
        the main thread, a weight prediction in a snapshot refresh) to :attr:`step_busy_s`, so the
        host's measured optimizer rate includes it."""
        with self._lock:
            self.step_busy_s += seconds

    def wait(self, raise_errors: bool = True) -> None:
        """Block until every submitted job has run.

        Args:
            raise_errors: re-raise the first exception a job raised (else drop it: teardown after
                the error was already raised).

        Raises:
            The first job's exception itself (its type and attributes kept) with a note naming the
            job, when ``raise_errors``.
        """
        if self._done:
            start = time.perf_counter()
            for done in self._done:
                done.wait()
            self._done.clear()
            self.waited_s += time.perf_counter() - start
        with self._lock:
            error, description = self._error, self._error_job
            self._error, self._error_job = None, ""
        if error is not None and raise_errors:
            error.add_note(f"RoundPipe: raised on the asynchronous optimizer thread by the {description}"
                           " (re-raised at the next wait of the main thread).")
            raise error

    def pop_stats(self) -> tuple[float, float]:
        """``(busy_s, waited_s)`` since the last call (seconds), then reset both."""
        with self._lock:
            out = (self.busy_s, self.waited_s)
            self.busy_s = self.waited_s = self.step_busy_s = 0.0
        return out

    def close(self) -> None:
        """Wait for the queued jobs (dropping their errors) and stop the thread."""
        self.wait(raise_errors=False)
        self._thread.close()
