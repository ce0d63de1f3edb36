"""A device memory budget for CPU virtual devices (issue 10, item 5), so out-of-memory is testable on a CPU.

A CPU virtual device's "device memory" is ordinary host memory, so nothing would ever run out.
With ``device_memory_bytes`` set, each :class:`~lightning_roundpipe.runtime.backends.cpu.CpuBackend`
keeps a :class:`DeviceMemoryLedger` of the bytes that live on it:

- **the device's pools** (``allocate_bytes``), checked *before* they are allocated: the stage weight
  slots, the transfer slots the ``h2d`` uploads land in (inputs, incoming gradients) and the fp32
  gradient accumulators (:mod:`~lightning_roundpipe.runtime.backends.pool`);
- **everything the device's streams create**: a ``TorchDispatchMode`` around every op of every stream
  (compute, and the copy engines: a buffer the ``weights`` stream clones) counts the storage of every op
  output that is a new storage (a view or an in-place result of an input, e.g. a copy into a host staging
  block, is not an allocation; host staging blocks a download takes are made under :func:`host_side`) (forward, recomputation, autograd's backward, the weight-gradient
  accumulators); this is the sound choice among the two the issue names: torch's CPU allocator has
  no Python hook (its memory reporting needs the profiler), while the ops' outputs *are* the
  tensors a GPU would hold: the saved activations autograd keeps and the per-op transients
  (a kernel's internal scratch space is not visible, as it is not to ``torch.cuda.memory_allocated``).
  An output's bytes are checked when the op returns, before any further op runs; the output is
  dropped with the error.

Measuring without a budget: ``budget_bytes=None`` (``LIGHTNING_ROUNDPIPE_MEASURE_DEVICE_MEMORY=1``
gives every CPU virtual device without ``device_memory_bytes`` such a ledger) counts the same bytes and
never raises, so the peak the memory model predicts can be compared with the measured one
(:mod:`lightning_roundpipe.partition.memory`).

A storage is counted once (views and in-place results share it) and released when it is freed
(``weakref.finalize`` on the storage, which torch keeps alive exactly as long as its data). The
finalizer never takes the ledger's lock: a garbage collection may run it on a thread that holds that
lock (any allocation can start one), so it only queues the release (``queue.SimpleQueue.put`` is
reentrant), and every locked method applies the queued releases first. When a
new storage would take the bytes in use above the budget, :class:`DeviceMemoryError` is raised,
naming the device, the stage and op, the bytes asked, in use and the budget; the executor hands it
to the main thread (the step raises it; nothing hangs) like a CUDA out-of-memory error, which it
subclasses (``torch.OutOfMemoryError``), so one ``except torch.OutOfMemoryError`` serves both.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_roundpipe.runtime.backends.checker import env_flag


_HOST = threading.local()

#: environment variable that gives CPU virtual devices without a budget a measuring ledger (no limit)
MEASURE_ENV = "LIGHTNING_ROUNDPIPE_MEASURE_DEVICE_MEMORY"


def measuring_default() -> bool:
    """Whether CPU virtual devices without ``device_memory_bytes`` measure their memory anyway
    (``LIGHTNING_ROUNDPIPE_MEASURE_DEVICE_MEMORY``: ``1``/``true`` on, ``0``/``false``/unset off; the
    peaks are logged as ``roundpipe/device<i>/peak_memory(GiB)``).

    Raises:
        ValueError: any other value of the variable.
    """
    return env_flag(MEASURE_ENV, "measures every CPU virtual device's memory without a budget")


@contextlib.contextmanager
def host_side():
    """Allocations made in this thread meanwhile are host memory (a staging block a download lands in,
    made inside a ``d2h`` op): no ledger counts them."""
    before = getattr(_HOST, "active", False)
    _HOST.active = True
    try:
        yield
    finally:
        _HOST.active = before


def _size(nbytes: int) -> str:
    """Bytes as MiB, with enough digits that two different sizes never print the same."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 100 * 2**20 else f"{nbytes / 2**20:.3f} MiB ({nbytes} bytes)"


def pool_slots_text(count: int) -> str:
    """``"one slot"``, ``"2 slots"``: stage weight slots, as the messages of the pools write them."""
    return "one slot" if count == 1 else f"{count} slots"


class DeviceMemoryError(torch.OutOfMemoryError):
    """A CPU virtual device would exceed its ``device_memory_bytes`` budget (a ``RuntimeError``).

    Attributes:
        device_index: the device.
        where: the stage and op being run (``"stage 3, B(3, mb 1)"``) or the transfer.
        asked_bytes: bytes of the allocation that did not fit.
        in_use_bytes: bytes already live on the device.
        budget_bytes: the budget.
    """

    def __init__(self, device_index: int, where: str, asked_bytes: int, in_use_bytes: int, budget_bytes: int,
                 unequal_budgets: bool = False) -> None:
        self.device_index, self.where, self.unequal_budgets = device_index, where, unequal_budgets
        self.asked_bytes, self.in_use_bytes, self.budget_bytes = asked_bytes, in_use_bytes, budget_bytes
        hint = ("the stage weight pool's slots (named above) are each as large as the largest stage's weights:"
                " make that stage smaller (`forward_stages`/`backward_stages` with fewer layers; a single layer"
                " cannot be split), or raise `device_memory_bytes` above those slots plus the activations."
                if "weight pool" in where else
                "a stage's weights do not fit: use smaller stages (`forward_stages`/`backward_stages` with fewer"
                " layers each), or raise `device_memory_bytes`."
                if "LOAD" in where else
                "shorten the sequences, cut the batch into more microbatches (`num_microbatches`), use smaller"
                " stages (`partition`), or raise `device_memory_bytes`; `roundpipe max-seq` finds the longest"
                " sequence that fits.")
        super().__init__(
            f"RoundPipe: CPU virtual device {device_index} ran out of its `device_memory_bytes={budget_bytes}` at"
            f" {where}: {asked_bytes} bytes asked with {in_use_bytes} in use ({_size(asked_bytes + in_use_bytes)}"
            f" > {_size(budget_bytes)}). HINT: {hint}"
            + (" The devices' budgets differ (one `device_memory_bytes` entry per device): `dispatch='weighted'` keeps"
               " a stage off a device whose budget cannot hold its pool slots; activations need room beside them, so"
               " give a small device a margin or leave it out." if unequal_budgets else "")
        )

    def __reduce__(self):
        return type(self), (self.device_index, self.where, self.asked_bytes, self.in_use_bytes, self.budget_bytes,
                            self.unequal_budgets)


class DeviceMemoryLedger:
    """Bytes live on one CPU virtual device, against a budget (see the module docstring).

    Args:
        device_index: the device (for messages).
        budget_bytes: the budget, bytes (> 0); ``None``: measure only (never raises).

    Attributes:
        in_use_bytes: bytes live now.
        peak_bytes: most bytes live at once since the last :meth:`pop_peak`.
        step_peak_bytes: the same since the last :meth:`pop_step_peak` (the per-step metric's own counter).
    """

    def __init__(self, device_index: int, budget_bytes: int | None) -> None:
        self.device_index = device_index
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self.unequal_budgets = False
        """Whether the devices' budgets differ (set by :func:`~lightning_roundpipe.runtime.backends.make_backends`):
        the error's HINT then names the weighted dispatch."""
        self._in_use_bytes = 0
        self.peak_bytes = 0
        self.step_peak_bytes = 0
        self._storages: dict[int, int] = {}
        self._deferred: dict[Any, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._released: queue.SimpleQueue = queue.SimpleQueue()  # (storage key, deferral token) from finalizers

    @property
    def in_use_bytes(self) -> int:
        """Bytes live now (the releases queued by finalizers applied)."""
        with self._lock:
            self._apply_releases()
            return self._in_use_bytes

    # ------------------------------------------------------------------ context
    def set_where(self, where: str) -> None:
        """Label of what this thread runs now (the stage and op), for error messages."""
        self._local.where = where

    @property
    def where(self) -> str:
        return getattr(self._local, "where", "an unlabelled allocation")

    def pop_step_peak(self) -> int:
        """:attr:`step_peak_bytes`, then restart it from the bytes in use."""
        with self._lock:
            self._apply_releases()
            out, self.step_peak_bytes = self.step_peak_bytes, self._in_use_bytes
        return out

    def pop_peak(self) -> int:
        """The peak since the last call, then restart it from the bytes in use."""
        with self._lock:
            self._apply_releases()
            out, self.peak_bytes = self.peak_bytes, self._in_use_bytes
        return out

    # ------------------------------------------------------------------ accounting
    def check(self, nbytes: int) -> None:
        """Raise :class:`DeviceMemoryError` if ``nbytes`` more would exceed the budget (nothing is counted)."""
        with self._lock:
            self._apply_releases()
            in_use = self._in_use_bytes
        if self.budget_bytes is not None and in_use + nbytes > self.budget_bytes:
            raise DeviceMemoryError(self.device_index, self.where, nbytes, in_use, self.budget_bytes,
                                    self.unequal_budgets)

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage until it is freed (once per storage).

        Raises:
            DeviceMemoryError: when the storage is new and does not fit (it is not counted then).
        """
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or tensor.device.type != "cpu":
            return
        with self._lock:
            self._apply_releases()
            if key in self._storages:
                return
            in_use = self._in_use_bytes
            if self.budget_bytes is not None and in_use + nbytes > self.budget_bytes:
                error = DeviceMemoryError(self.device_index, self.where, nbytes, in_use, self.budget_bytes,
                                          self.unequal_budgets)
            else:
                error = None
                self._storages[key] = nbytes
                self._in_use_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self._in_use_bytes)
                self.step_peak_bytes = max(self.step_peak_bytes, self._in_use_bytes)
        if error is not None:
            raise error
        weakref.finalize(storage, self._release, key)

    def track_tree(self, tree: Any) -> None:
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)

    def _release(self, key: int) -> None:
        """The storage's finalizer: queue its release (applied under the lock by the next locked method).

        It must not take the lock: a garbage collection can run it on a thread that already holds it."""
        self._released.put((key, getattr(self._local, "deferring", None)))

    def _apply_releases(self) -> None:
        """Apply the queued releases (call with the lock held)."""
        while True:
            try:
                key, token = self._released.get_nowait()
            except queue.Empty:
                return
            nbytes = self._storages.pop(key, 0)
            if token is None:
                self._in_use_bytes -= nbytes
            else:
                self._deferred[token] = self._deferred.get(token, 0) + nbytes

    @contextlib.contextmanager
    def deferring(self, token: Any):
        """Storages this thread frees meanwhile stay charged until :meth:`flush` of ``token``: the
        latest point the program allows for them (memory a copy stream frees is reusable by the compute
        stream only once the program orders the compute after that free), so the measured peak does not
        depend on which stream's thread ran first."""
        before = getattr(self._local, "deferring", None)
        self._local.deferring = token
        try:
            yield
        finally:
            self._local.deferring = before

    def flush(self, token: Any = None, prefix: Any = None) -> None:
        """Release the bytes :meth:`deferring` held under ``token`` (with ``prefix``: under every token
        ``(prefix, ...)``)."""
        with self._lock:
            self._apply_releases()
            keys = [token] if prefix is None else [k for k in self._deferred if isinstance(k, tuple) and k[:1] == (prefix,)]
            for key in keys:
                self._in_use_bytes -= self._deferred.pop(key, 0)

    def counting(self) -> "_CountOutputs":
        """A dispatch mode (enter it on the compute thread) that tracks every op's outputs."""
        return _CountOutputs(self)


class _CountOutputs(TorchDispatchMode):
    def __init__(self, ledger: DeviceMemoryLedger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(_HOST, "active", False):
            return out
        inputs = {leaf.untyped_storage().data_ptr() for leaf in pytree.tree_leaves((args, kwargs))
                  if isinstance(leaf, torch.Tensor)}
        for leaf in pytree.tree_leaves(out):
            # a view or an in-place result of an input (a copy into a pooled slot or a host block) is no allocation
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in inputs:
                self.ledger.track(leaf)
        return out
