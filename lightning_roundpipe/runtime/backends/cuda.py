"""CUDA backend: one GPU, four CUDA streams, ordering by events only (DESIGN.md section 4).

Streams (created once per device): ``weights`` (low priority: weight chunks from the pinned
compute-dtype shadows), ``h2d`` (high priority: activations and incoming gradients), ``compute``,
``d2h`` (high priority: activations, input gradients, weight gradients into pinned host memory).
Every op is *enqueued* by its stream's host thread without waiting for the GPU: a consumer waits
(on the host) only until its producers are enqueued, then makes its stream wait for their CUDA
events, across devices too. The host blocks on an event only where the CPU consumes the data: the
host gradient accumulation (``host_wait``) and the end of a program (``synchronize``: loss, outputs
and input gradients handed back to Lightning).

Buffers (:mod:`~lightning_roundpipe.runtime.backends.pool`), the same code path as CPU virtual
devices: stage weights, upload destinations (activations, incoming gradients) and fp32 gradient
accumulators come from the device's pools, allocated once and reused along the program's edges, so
no pooled buffer is ever ``record_stream``-ed and the caching allocator never has to synchronise the
device to find room. Host staging (download destinations; pageable upload sources, copied first)
is exact-size page-locked memory (:mod:`~lightning_roundpipe.runtime.host.pinned`), not torch's
power-of-two pinned cache. What the compute stream itself makes and the ``d2h`` stream downloads
(boundary outputs, input gradients, fp32 ``view.grad``) stays with the caching allocator of the
compute stream: the download keeps it referenced until the copy's event has completed
(:meth:`CudaBackend.release_after`), so its memory goes back to the allocator only when no stream
uses it (what ``record_stream`` would do, without tying the block to another stream's events). Stream
priority alone does not order the copy engine's DMA; the stream program's edges do (activations
before weights, paper section 3.3). Op times come from CUDA events (``enable_timing``) relative to
one reference event per program.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

import torch

from lightning_roundpipe.runtime.backends.base import Backend
from lightning_roundpipe.runtime.host.pinned import is_pinned, pinned_bytes


class CudaBackend(Backend):
    """One CUDA device.

    Args:
        device_index: position in the device list.
        device: ``cuda:i``.

    Raises:
        RuntimeError: CUDA is not available.
    """

    is_cuda = True

    def __init__(self, device_index: int, device: torch.device) -> None:
        super().__init__(device_index, device)
        if not torch.cuda.is_available():
            raise RuntimeError("RoundPipe was given a CUDA device but CUDA is not available."
                               " HINT: use `Trainer(accelerator='cpu', devices=N)` for CPU virtual devices.")
        low, high = torch.cuda.Stream.priority_range()  # (lowest, highest) = (0, -k)
        with torch.cuda.device(self.device):
            self.streams = {
                "weights": torch.cuda.Stream(self.device, priority=low),
                "h2d": torch.cuda.Stream(self.device, priority=high),
                "compute": torch.cuda.Stream(self.device),
                "d2h": torch.cuda.Stream(self.device, priority=high),
            }
        self._reference: tuple[torch.cuda.Event, float] | None = None
        # (event, tensors): compute-stream tensors a d2h copy reads, held until the event completed
        self._held: collections.deque[tuple[torch.cuda.Event, list[torch.Tensor]]] = collections.deque()
        self._held_lock = threading.Lock()
        self._start_threads()

    def _thread_setup(self, stream: str) -> None:
        torch.cuda.set_device(self.device)
        sanitizer = getattr(getattr(torch.cuda, "_sanitizer", None), "cuda_sanitizer", None)
        if sanitizer is not None and sanitizer.enabled:
            # TORCH_CUDA_SANITIZER=1 enters its dispatch mode in the thread that imported torch only;
            # this stream's issuing thread launches kernels too, so it enters the same mode (one
            # event handler sees every thread's accesses)
            sanitizer.dispatch.__enter__()

    # ------------------------------------------------------------------ ordering
    def launch(self, stream: str, work, access=None, label: str = "", op: Any = None) -> None:
        self._release_done()
        work()  # on the issuing thread, inside torch.cuda.stream(...): enqueues the op's kernels and copies

    def stream_context(self, stream: str):
        return torch.cuda.stream(self.streams[stream])

    def record(self, stream: str) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.streams[stream])
        return event

    def wait_event(self, stream: str, event: Any) -> None:
        self.streams[stream].wait_event(event)

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        # only what completed: a d2h issuing thread may have appended a copy while this thread waited
        # (overlapped runs), and clearing would free its source before the copy reads it
        self._release_done()

    def release_after(self, tensors: list[torch.Tensor], stream: str) -> None:
        if not tensors:
            return
        event = torch.cuda.Event()
        event.record(self.streams[stream])
        with self._held_lock:
            self._held.append((event, list(tensors)))

    def _release_done(self) -> None:
        """Drop the held tensors whose copies have completed (events complete in order per stream;
        a non-blocking ``query``, never a wait)."""
        with self._held_lock:
            while self._held and self._held[0][0].query():
                self._held.popleft()

    # ------------------------------------------------------------------ timing
    def begin(self) -> None:
        """Record the reference event of a program's timeline (host clock at the same moment)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.streams["compute"])
        self._reference = (event, time.perf_counter())

    def timer_start(self, stream: str) -> torch.cuda.Event:
        if self._reference is None:
            self.begin()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.streams[stream])
        return event

    def timer_span(self, stream: str, start: Any) -> Callable[[], tuple[float, float]]:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.streams[stream])
        reference, host = self._reference

        def span() -> tuple[float, float]:
            # the end marker follows the op's event on its stream: a host that waited for that event
            # (a newer run in flight) may get here first, and `elapsed_time` of an incomplete event
            # raises "device not ready"
            for event in (reference, start, end):
                event.synchronize()
            return host + reference.elapsed_time(start) / 1e3, host + reference.elapsed_time(end) / 1e3

        return span

    def measure_link(self, nbytes: int = 64 * 2**20) -> tuple[float, float]:
        """This GPU's pinned H2D and D2H rates, bytes/s, measured with every GPU of its group copying
        at once (:func:`measure_links`; GPUs behind one PCIe switch share it); cached."""
        cached = getattr(self, "_link", None)
        if cached is None:
            measure_links([self], nbytes)
        return self._link

    # ------------------------------------------------------------------ data
    def needs_staging(self, tensor: torch.Tensor) -> bool:
        # cudaMemcpyAsync from pageable memory blocks the issuing thread until the copy is done
        return tensor.device.type == "cpu" and not (tensor.is_contiguous() and is_pinned(tensor))

    def copy_h2d(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> None:
        # destinations are pooled device slots, sources pinned pooled host blocks or shadows: the
        # program's edges keep both from reuse until this copy has completed (no record_stream)
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)

    def copy_d2h(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int, gradients: bool = False) -> None:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        # the sources were made on the compute stream (or are pooled): hold them until the copies
        # completed instead of record_stream (see the module docstring)
        self.release_after([src for _, src in pairs if src.device.type == "cuda"], "d2h")

    def allocate_host_bytes(self, nbytes: int) -> torch.Tensor:
        return pinned_bytes(nbytes)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_s(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def pop_step_memory_peak(self) -> int:
        peak = int(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        self._run_peak = max(getattr(self, "_run_peak", 0), peak)
        return peak

    def measured_stage_budget(self) -> int:
        """Bytes one stage may use: the memory this process can still have on the GPU (free memory
        plus what torch's allocator holds, so the CUDA context and other processes are left out),
        minus the measured peak of everything that is not a stage weight slot (activations, gradients,
        outputs waiting for download, cuBLAS workspaces: the peak since the run started minus the
        pool), minus a margin of ``max(512 MiB, 5 % of the card)`` for fragmentation, halved for the
        two slots of the pool (the stage computing and the one prefetched)."""
        free, total = torch.cuda.mem_get_info(self.device)
        peak = max(getattr(self, "_run_peak", 0), int(torch.cuda.max_memory_allocated(self.device)))
        others = max(0, peak - self.pool.nbytes)
        margin = max(512 * 2**20, total // 20)
        usable = free + torch.cuda.memory_reserved(self.device) - others - margin
        return max(0, usable // 2)

    def device_budget_bytes(self) -> int:
        """Bytes this process may hold on the GPU (:func:`usable_device_bytes`); logical devices sharing
        one GPU each see all of it (the check before a program counts each one's own peak)."""
        return usable_device_bytes(self.device)

    def allocate_bytes(self, nbytes: int, what: str | None = None) -> torch.Tensor:
        # the pool keeps the buffer for the run; reuse is ordered by the program's edges (DROP -> LOAD
        # for stage slots, reader -> refill for transfer slots), so no record_stream (which would keep
        # the block from the allocator until its events completed). A slot that grows inside a program
        # keeps its old buffer until the program has completed (SlotPool.take).
        with torch.cuda.device(self.device):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_chunk(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> None:
        for dst, src in pieces:
            dst.copy_(src, non_blocking=True)


#: the margin :func:`usable_device_bytes` leaves: at least this many bytes...
USABLE_MARGIN_BYTES = 512 * 2**20
#: ... or this fraction of the card, whichever is larger
USABLE_MARGIN_FRACTION = 0.05


def usable_device_bytes(device: torch.device) -> int:
    """Bytes this process may hold on ``device``, measured: free memory (``torch.cuda.mem_get_info``)
    plus what torch's caching allocator already reserves (RoundPipe's pools among it), less a margin of
    ``max(512 MiB, 5 %`` of the card) for fragmentation, the CUDA context's growth and library
    workspaces (cuBLAS, cuDNN). Other processes' memory and the CUDA context are left out, unlike
    ``total_memory``."""
    free, total = torch.cuda.mem_get_info(device)
    margin = max(USABLE_MARGIN_BYTES, int(total * USABLE_MARGIN_FRACTION))
    return max(0, free + torch.cuda.memory_reserved(device) - margin)


def measure_links(backends: list, nbytes: int = 64 * 2**20) -> tuple[float, float]:
    """Pinned H2D and D2H rates, bytes/s, measured with all ``backends``' GPUs copying at once (one
    warm-up copy, then one ``nbytes`` copy per GPU and direction, all enqueued before any is waited
    for, timed with CUDA events): what each GPU gets when all of them stream weights, as in a
    RoundPipe step, not what one GPU gets alone. Logical devices on one GPU are measured once.
    Returns the slowest GPU's ``(h2d, d2h)`` and caches each backend's own rates as ``_link``."""
    distinct: dict[torch.device, Any] = {}
    for backend in backends:
        distinct.setdefault(backend.device, backend)
    buffers = {}
    for device in distinct:
        with torch.cuda.device(device):
            buffers[device] = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
                               torch.empty(nbytes, dtype=torch.uint8, device=device))
    measured: list[dict[torch.device, float]] = []
    for to_device in (True, False):  # H2D on every GPU at once, then D2H on every GPU at once
        events = {}
        for device, (host, dev) in buffers.items():
            dst, src = (dev, host) if to_device else (host, dev)
            with torch.cuda.device(device):
                dst.copy_(src, non_blocking=True)  # warm-up
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                events[device] = (start, end)
        for start, end in events.values():
            end.synchronize()
        measured.append({device: nbytes / (start.elapsed_time(end) / 1e3) for device, (start, end) in events.items()})
    h2d, d2h = measured
    rates = {device: (h2d[device], d2h[device]) for device in distinct}
    for backend in backends:
        backend._link = rates[backend.device]
    return min(h2d.values()), min(d2h.values())
