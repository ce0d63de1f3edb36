"""`StreamThread`: one host thread that runs the jobs given to it, in order.

Every stream of every device (``weights``, ``h2d``, ``compute``, ``d2h``) has one such *issuing*
thread, which walks that stream's op list of the stream program (:mod:`lightning_roundpipe.runtime.execution.executor`)
and enqueues each op through the driver: on CUDA the op's kernels go on its CUDA stream; on CPU virtual
devices the op goes to the stream's worker (:class:`~lightning_roundpipe.runtime.backends.cpu.CpuStream`),
which runs it later. Grad mode and autocast are thread-local: ops set them where they run.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from lightning_roundpipe.runtime.execution.jitter import pause as jitter_pause


class StreamThread:
    """A daemon thread that runs ``fn()`` jobs in submission order.

    Args:
        name: thread name (``roundpipe-device0-compute``).
        setup: called once in the thread before the first job (bind a device, set thread counts);
            an exception there is re-raised by the constructor.
    """

    def __init__(self, name: str, setup: Callable[[], None] | None = None) -> None:
        self._jobs: "queue.SimpleQueue[tuple[Callable[[], None], threading.Event] | None]" = queue.SimpleQueue()
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._setup = setup
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error

    def _loop(self) -> None:
        try:
            if self._setup is not None:
                self._setup()
        except BaseException as error:  # device setup failure: reported by the constructor
            self._init_error = error
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done = job
            job = None
            try:
                jitter_pause()  # schedule jitter (`runtime/execution/jitter.py`): off unless asked for
                fn()
            finally:
                fn = None  # the job's closure (a program run, a failed run's traceback) must not outlive it
                done.set()

    def submit(self, fn: Callable[[], None]) -> threading.Event:
        """Queue ``fn()``; the returned event is set when it has returned or raised.

        ``fn`` must catch its own exceptions (the executor records them for the main thread).
        """
        done = threading.Event()
        self._jobs.put((fn, done))
        return done

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after its queued jobs; wait up to ``timeout_s`` seconds."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
