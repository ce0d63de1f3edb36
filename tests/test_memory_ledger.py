"""The device memory ledger as the CUDA allocator's view (issue 30, What to build 1): every device
allocation on a CPU virtual device is charged while alive, on every stream, and nothing else is."""

from __future__ import annotations

import torch

from lightning_roundpipe.runtime.backends import CpuBackend
from lightning_roundpipe.runtime.backends.budget import DeviceMemoryError, DeviceMemoryLedger


def _run(backend: CpuBackend, stream: str, work) -> None:
    with backend.op_scope(stream, f"a test op on {stream}"):
        work()


def test_a_clone_on_a_copy_engine_stream_is_device_memory():
    """The ``weights`` stream clones a stage's buffers (``WeightStore.own_buffers``): on a GPU that is
    an allocation on the device, so the ledger counts it (only the compute stream was counted before)."""
    backend = CpuBackend(0, device_memory_bytes=None)
    backend.memory = DeviceMemoryLedger(0, None)  # measure only
    try:
        kept = []
        source = torch.ones(1000)
        backend.launch("weights", lambda: _run(backend, "weights", lambda: kept.append(source.clone())))
        backend.synchronize()
        assert backend.memory.in_use_bytes == 4000 and backend.memory.peak_bytes == 4000
        kept.clear()
        assert backend.memory.in_use_bytes == 0  # freed: released
    finally:
        backend.close()


def test_a_download_into_a_host_block_is_not_device_memory():
    """A ``d2h`` op copies into host staging (made inside the op on the first step): neither the block nor
    the copy's in-place result is device memory; a view of a device buffer is no new allocation."""
    backend = CpuBackend(0, device_memory_bytes=10**6)
    try:
        device = backend.allocate_bytes(4096, "a test slot")
        held = []

        def download() -> None:
            block = backend.allocate_host_bytes(4096)
            block.copy_(device[:4096])
            held.append((block, device[:1024].view(torch.float32)))

        backend.launch("d2h", lambda: _run(backend, "d2h", download))
        backend.synchronize()
        assert backend.memory.in_use_bytes == 4096  # the slot alone
    finally:
        backend.close()


def test_a_measuring_ledger_never_raises_and_a_budget_does():
    ledger = DeviceMemoryLedger(1, None)
    big = torch.empty(2**20, dtype=torch.uint8)
    ledger.track(big)
    assert ledger.peak_bytes == 2**20
    tight = DeviceMemoryLedger(1, 2**10)
    try:
        tight.track(big)
    except DeviceMemoryError as error:
        assert isinstance(error, torch.OutOfMemoryError) and error.device_index == 1
    else:
        raise AssertionError("the budget did not raise")


def test_the_environment_variable_gives_devices_without_a_budget_a_ledger(monkeypatch):
    monkeypatch.setenv("LIGHTNING_ROUNDPIPE_MEASURE_DEVICE_MEMORY", "1")
    backend = CpuBackend(0)
    try:
        assert backend.memory is not None and backend.memory.budget_bytes is None
    finally:
        backend.close()
    monkeypatch.delenv("LIGHTNING_ROUNDPIPE_MEASURE_DEVICE_MEMORY")
    backend = CpuBackend(0)
    try:
        assert backend.memory is None
    finally:
        backend.close()


def test_storages_freed_while_deferring_stay_charged_until_their_flush():
    """What a ``DROP`` frees on the ``d2h`` stream (a stage's gradients) is reusable by the compute
    stream only where the program orders the compute after that ``DROP``: the ledger keeps it charged
    until then (:meth:`DeviceMemoryLedger.flush`), so the measured peak does not depend on which
    stream's thread ran first. A storage freed outside the scope is released at once; its address may be
    reused by a new storage meanwhile, which is counted."""
    ledger = DeviceMemoryLedger(0, None)
    held = [torch.empty(1000, dtype=torch.uint8)]
    ledger.track(held[0])
    with ledger.deferring(("run", 3, 0)):
        held.clear()  # freed: still charged
    assert ledger.in_use_bytes == 1000
    fresh = torch.empty(1000, dtype=torch.uint8)
    ledger.track(fresh)
    assert ledger.in_use_bytes == 2000 and ledger.peak_bytes == 2000
    ledger.flush(("run", 3, 0))
    assert ledger.in_use_bytes == 1000
    del fresh
    assert ledger.in_use_bytes == 0
    with ledger.deferring(("run", 5, 0)):
        gone = torch.empty(10, dtype=torch.uint8)
        ledger.track(gone)
        del gone
    ledger.flush(prefix="run")  # the end of the run: everything it deferred
    assert ledger.in_use_bytes == 0


def test_a_storage_freed_by_the_garbage_collector_inside_the_ledger_does_not_deadlock():
    """A storage freed by a garbage collection that runs while the ledger's lock is held (any allocation
    there may start one; a clean-clone run hung so, all compute workers waiting in the finalizer) is
    released, not waited for: the call returns and the bytes come back."""
    import gc
    import threading

    ledger = DeviceMemoryLedger(0, None)

    class CollectingLock:
        """The ledger's lock, with a garbage collection at its first acquisition (as an allocation made
        while it is held may start one)."""

        def __init__(self) -> None:
            self.lock, self.collected = threading.Lock(), False

        def __enter__(self):
            self.lock.acquire()
            if not self.collected:
                self.collected = True
                gc.collect()
            return self

        def __exit__(self, *exc) -> None:
            self.lock.release()

    done = threading.Event()

    def free_inside_the_lock() -> None:
        cycle = [torch.empty(1024)]
        cycle.append(cycle)  # only the cycle collector frees it
        ledger.track(cycle[0])
        del cycle
        ledger._lock = CollectingLock()
        ledger.flush()
        done.set()

    worker = threading.Thread(target=free_inside_the_lock, daemon=True)
    worker.start()
    # a hang guard, not a timing: the call takes microseconds; a deadlocked worker never sets `done`
    assert done.wait(120), "the ledger deadlocked: a finalizer waited for the lock its own thread holds"
    assert ledger.pop_peak() == 4096 and ledger.in_use_bytes == 0, ledger.in_use_bytes
