"""`DeviceWorker`: one thread per device that runs the jobs given to it, in order.

- CUDA: the thread binds its GPU and owns its streams (weight upload, activation upload, compute,
  download; see ``transfer.py``).
- CPU virtual devices: the thread calls ``torch.set_num_threads(1)``; an "upload" is a distinct
  copy in the compute dtype (``store.py``), so residency and memory accounting are real.

Workers hold nothing between stages. Grad mode and autocast are thread-local: jobs set them.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch


class DeviceWorker:
    """A worker thread bound to ``device``.

    Args:
        device_index: position of the device in the strategy's device list (``device_index`` in
            metrics and errors).
        device: ``torch.device("cpu")`` for a CPU virtual device, or ``cuda:i``.
    """

    def __init__(self, device_index: int, device: torch.device) -> None:
        self.device_index = device_index
        self.device = torch.device(device)
        self.streams = None  # transfer.DeviceStreams on CUDA, set in the thread
        self._jobs: "queue.SimpleQueue[tuple[Callable[[DeviceWorker], None], threading.Event] | None]" = queue.SimpleQueue()
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"roundpipe-device{device_index}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _loop(self) -> None:
        try:
            if self.is_cuda:
                from lightning_roundpipe.runtime.transfer import DeviceStreams

                torch.cuda.set_device(self.device)
                self.streams = DeviceStreams(self.device)
            else:
                torch.set_num_threads(1)
        except BaseException as e:  # pragma: no cover - device setup failure
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                fn(self)
            finally:
                done.set()

    def submit(self, fn: Callable[["DeviceWorker"], None]) -> threading.Event:
        """Queue ``fn(worker)``; the returned event is set when it has returned or raised.

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

    def __repr__(self) -> str:
        return f"DeviceWorker(device_index={self.device_index}, device={self.device})"
