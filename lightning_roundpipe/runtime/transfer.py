"""Host<->device copies: the only module that knows streams and events.

CUDA (per device, created in the worker thread):

- ``activation`` stream, high priority: H2D of stage-boundary activations (critical path);
- ``weights`` stream, low priority: H2D weight upload and prefetch of the next stage, so activation
  copies go before weight prefetch (paper section 3.3, priority-aware transfers);
- ``compute`` stream: the layers' kernels;
- ``download`` stream: D2H of activations and gradients into pinned host memory.

Dependencies are CUDA events recorded by the producer and waited on by the consumer stream; the
host waits on an event only where a thread must know data arrived (a D2H the next device reads).

CPU virtual devices: activations are used in place (0 bytes counted), weights are copied into a
distinct tensor in the compute dtype (``upload_tensors``), so a stage's residency is real memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


class DeviceStreams:
    """The four streams of one CUDA device (see module docstring)."""

    def __init__(self, device: torch.device) -> None:
        lo, hi = torch.cuda.Stream.priority_range()
        self.activation = torch.cuda.Stream(device, priority=hi)
        self.weights = torch.cuda.Stream(device, priority=lo)
        self.compute = torch.cuda.Stream(device)
        self.download = torch.cuda.Stream(device)


def tree_nbytes(tree: Any) -> int:
    """Bytes of all tensors in a pytree."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def to_device(tree: Any, worker) -> tuple[Any, int]:
    """Bring a host carry to ``worker``'s device for compute.

    Returns:
        ``(tree_on_device, h2d_bytes)``. On CUDA the copy runs on the activation stream and the
        compute stream waits for it; on CPU virtual devices the tree is returned as is (0 bytes).
    """
    if not worker.is_cuda:
        return tree, 0
    s = worker.streams
    with torch.cuda.stream(s.activation):
        out = pytree.tree_map(lambda t: t.to(worker.device, non_blocking=True) if isinstance(t, torch.Tensor) else t, tree)
        ev = torch.cuda.Event()
        ev.record(s.activation)
    s.compute.wait_event(ev)
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            t.record_stream(s.compute)
    return out, tree_nbytes(out)


def to_host(tree: Any, worker) -> tuple[Any, int]:
    """Bring a device carry to host memory (pinned on CUDA) and wait until it has arrived.

    Returns:
        ``(tree_on_host, d2h_bytes)``; on CPU virtual devices ``(tree, 0)``.
    """
    if not worker.is_cuda:
        return tree, 0
    s = worker.streams
    ev = torch.cuda.Event()
    ev.record(s.compute)
    s.download.wait_event(ev)

    def down(t):
        if not isinstance(t, torch.Tensor):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        t.record_stream(s.download)
        return host

    with torch.cuda.stream(s.download):
        out = pytree.tree_map(down, tree)
        done = torch.cuda.Event()
        done.record(s.download)
    done.synchronize()  # the next stage may run on another device: the host must know it arrived
    return out, tree_nbytes(out)


def upload_tensors(masters: list[torch.Tensor], dtypes: list[torch.dtype], worker) -> tuple[list[torch.Tensor], Any, int]:
    """H2D copies of ``masters`` in ``dtypes`` (a distinct tensor each, also on CPU).

    Returns:
        ``(copies, ready_event, h2d_bytes)``; ``ready_event`` is ``None`` on CPU, else a CUDA event
        recorded on the weights stream that the compute stream must wait on before first use
        (see :func:`wait_ready`), so a prefetch never blocks the stage computing now.
    """
    if not worker.is_cuda:
        copies = [m.detach().to(dtype=dt, copy=True) for m, dt in zip(masters, dtypes)]
        return copies, None, sum(c.numel() * c.element_size() for c in copies)
    s = worker.streams
    with torch.cuda.stream(s.weights):
        copies = [m.detach().to(worker.device, non_blocking=True).to(dt) for m, dt in zip(masters, dtypes)]
        ev = torch.cuda.Event()
        ev.record(s.weights)
    return copies, ev, sum(m.numel() * m.element_size() for m in masters)


def wait_ready(ready_event: Any, copies: list[torch.Tensor], worker) -> None:
    """Make the compute stream wait for an upload (no-op on CPU)."""
    if ready_event is None:
        return
    worker.streams.compute.wait_event(ready_event)
    for c in copies:
        c.record_stream(worker.streams.compute)


def grad_to_host(grad: torch.Tensor, dtype: torch.dtype, worker) -> torch.Tensor:
    """D2H of one gradient into ``dtype`` on the host (blocking on CUDA)."""
    if not worker.is_cuda:
        return grad if grad.dtype == dtype else grad.to(dtype)
    with torch.cuda.stream(worker.streams.download):
        worker.streams.download.wait_stream(worker.streams.compute)
        out = grad.to("cpu", non_blocking=False).to(dtype)
    return out


def compute_context(worker):
    """Context manager that makes the worker's compute stream current (nullcontext on CPU)."""
    import contextlib

    if not worker.is_cuda:
        return contextlib.nullcontext()
    return torch.cuda.stream(worker.streams.compute)
