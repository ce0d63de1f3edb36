"""Data parallelism across processes: bucketed averaging of the host fp32 gradients (no Lightning here).

One RoundPipe process per node holds the master weights and their ``.grad`` on the host (DESIGN.md
section 4, "Across nodes"). After the pipeline's backward every process holds the gradient of its
own batch; :class:`GradientAllReduce` averages them over the processes of a ``torch.distributed``
process group, so every process ends with the gradient of the global batch (the mean of the
processes' gradients: exact when every process's loss is normalised by the global batch, see
:func:`global_item_count`), before clipping and the optimizer step.

Buckets (as ``torch.nn.parallel.DistributedDataParallel``'s reducer, 25 MiB by default): the
pipelined layers are grouped, last layer first, into runs of consecutive layers of at most
``bucket_bytes`` fp32 gradient bytes (a layer larger than that is a bucket alone). Each bucket is
flattened into one fp32 buffer and reduced with one ``dist.all_reduce`` (``SUM``, then divided by the
world size: gloo has no ``AVG``). A parameter shared by several layers (tied embeddings) belongs to
the bucket of its first layer, whose gradient is complete last.

Overlap: the executor's host thread calls :meth:`GradientAllReduce.layers_final` after it added a
backward stage's last gradients into the masters' ``.grad`` (the ``WD2H`` of the stage's last
microbatch); a bucket whose layers are all final is launched there with ``async_op=True``, while
the backward stages of earlier layers still run. Buckets are launched strictly in order (bucket 0
holds the last layers), so the sequence of collectives is the same on every process whatever
partition each one runs. :meth:`finish` (main thread) waits for the launched buckets, writes the
averaged gradients back, and reduces everything not launched yet (parameters outside the pipelined
model; with ``accept_sink`` off, the fused path) synchronously, in the same buckets and in a fixed
order.

Fused path (``accept_sink``): the stage's gradients land in the engine's CPU buffers (the sink)
instead of ``.grad``; buckets are launched from those buffers, and :meth:`sink_barrier` waits for
them and writes the mean back into the buffers right before the loss's backward adds them (times
the loss's incoming gradient, the same on every process) into ``.grad``. That is the global
gradient when ``.grad`` is ``None`` there (the first backward of an optimizer step: Lightning zeroes
the gradients between the forward and the backward). The caller turns ``accept_sink`` off for a
backward that follows accumulated, unsynchronised ones (their ``.grad`` differ per process); should
a launched bucket's ``.grad`` still hold a gradient at :meth:`sink_barrier`, or gradients reach
``.grad`` after their bucket was launched (buffers that were not accepted, a second pipelined call
in the same backward), :meth:`finish` reduces every bucket once more from ``.grad`` (the mean of
``prev_r + c`` is ``mean(prev_r) + c`` for an averaged part ``c``: exact, at more bytes). Every
decision depends only on the program structure and on which ``.grad`` are ``None``, the same on
every process.

Parameters without a gradient: inside a launched (overlapped) bucket a trainable parameter whose
``.grad`` is ``None`` takes part as zeros and keeps a zero gradient; in :meth:`finish` one small
all-reduce of a presence mask first decides which parameters got a gradient on some process:
those take part (``None`` as zeros), the others keep ``.grad = None`` everywhere.

Errors: a collective that fails (a process died or was killed, the group's ``timeout`` passed)
raises :class:`DataParallelError` naming this rank and the operation, with the backend's error as
``__cause__``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from lightning_roundpipe.config import DEFAULT_BUCKET_BYTES  # 25 MiB of fp32 gradients, as DDP's bucket_cap_mb


class DataParallelError(RuntimeError):
    """A collective of the data-parallel gradient synchronisation failed on this rank (another
    process failed, was killed or is unreachable, or the process group's ``timeout`` passed)."""


def _world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _fail(what: str, error: BaseException) -> DataParallelError:
    rank, world = _world() if dist.is_initialized() else (-1, -1)
    return DataParallelError(
        f"RoundPipe data parallel: rank {rank} of {world} could not complete {what}: {error}."
        " Another process probably failed or was killed (see its log), or the process group's `timeout` passed."
        " HINT: every process must run the same number of training steps; the run is stopped on every rank."
    )


def global_item_count(local_count: torch.Tensor | int) -> torch.Tensor:
    """The normaliser of a token-mean loss so that averaging the processes' gradients gives the
    gradient of the global batch: ``(sum over processes of local_count) / world_size``.

    A process's loss ``sum_r / N_global * world_size`` (``sum_r`` its summed token losses), averaged
    over the processes, is ``sum over r of sum_r / N_global``: the global batch's token mean, also
    when the processes hold unequal numbers of label tokens (as ``transformers``' Trainer does for
    DDP with ``average_tokens_across_devices``). A collective: every process must call it.

    Args:
        local_count: label tokens of this process's batch (an int or a 0-dim integer tensor).

    Returns:
        A 0-dim float64 CPU tensor (the mean count; not an integer in general).

    Raises:
        DataParallelError: when the all-reduce fails.
    """
    count = torch.as_tensor(local_count).detach().to("cpu", torch.float64).reshape(())
    buf = count.clone()
    try:
        dist.all_reduce(buf)
    except Exception as error:  # noqa: BLE001 - torch raises DistBackendError/RuntimeError
        raise _fail("the all-reduce of `num_items_in_batch`", error) from error
    return buf / dist.get_world_size()


@dataclass
class _Bucket:
    layers: frozenset[int]
    params: list[torch.Tensor]
    handle: object = None
    buffer: torch.Tensor | None = None
    sink: dict | None = None  # launched from the fused path's gradient buffers
    rereduce: bool = False  # .grad held a gradient when the buffers were added: reduce again from .grad


@dataclass
class AllReduceStats:
    """What the gradient synchronisation cost since the last :meth:`GradientAllReduce.pop_stats`.

    Attributes:
        seconds: main-thread seconds spent waiting for or running all-reduces (the overlapped part
            running during the backward is not counted).
        bytes: fp32 bytes this process contributed to all-reduces (the buffers' sizes).
        buckets: number of all-reduce calls of gradient buckets.
    """

    seconds: float = 0.0
    bytes: int = 0
    buckets: int = 0


@dataclass
class GradientAllReduce:
    """Bucketed all-reduce (mean) of the host gradients of one pipelined model over a process group.

    Args:
        layer_params: per layer of the pipelined layer sequence, its trainable master parameters
            (``layer_params[layer_index]``); identical structure on every process.
        bucket_bytes: largest bucket, bytes of fp32 gradients (a larger layer is a bucket alone).

    Attributes:
        sync: whether the current backward synchronises (``False`` inside Lightning's
            ``block_backward_sync``, the accumulating batches: as DDP's ``no_sync``).
        accept_sink: launch buckets from the fused path's gradient buffers (the engine must then
            call :meth:`sink_barrier` before it adds them into ``.grad``).

    Raises:
        ValueError: for ``bucket_bytes < 1``.
    """

    layer_params: Sequence[Sequence[torch.Tensor]]
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    sync: bool = True
    accept_sink: bool = False
    _dirty: bool = field(default=False, init=False)
    _buckets: list[_Bucket] = field(default_factory=list, init=False)
    _final: set[int] = field(default_factory=set, init=False)
    _next: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _stats: AllReduceStats = field(default_factory=AllReduceStats, init=False)
    _error: BaseException | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"`bucket_bytes` must be a positive int, got {self.bucket_bytes!r}. HINT: 25 * 2**20 (25 MiB).")
        first_layer: dict[int, int] = {}
        for layer_index, params in enumerate(self.layer_params):
            for p in params:
                first_layer.setdefault(id(p), layer_index)
        current: list[int] = []
        current_bytes = 0
        for layer_index in reversed(range(len(self.layer_params))):
            owned = [p for p in self.layer_params[layer_index] if first_layer[id(p)] == layer_index]
            nbytes = sum(p.numel() * 4 for p in owned)
            if current and current_bytes + nbytes > self.bucket_bytes:
                self._buckets.append(self._make(current, first_layer))
                current, current_bytes = [], 0
            current.append(layer_index)
            current_bytes += nbytes
        if current:
            self._buckets.append(self._make(current, first_layer))

    def _make(self, layers: list[int], first_layer: dict[int, int]) -> _Bucket:
        params = [p for i in layers for p in self.layer_params[i] if first_layer[id(p)] == i]
        return _Bucket(frozenset(layers), params)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The pipelined model's trainable parameters in bucket order (last layers first)."""
        return [p for b in self._buckets for p in b.params]

    # ------------------------------------------------------------------ host thread (overlap)
    def layers_final(self, layers: Sequence[int], sink: dict | None = None) -> None:
        """Host thread: the gradients of ``layers`` are complete for this backward, in the
        masters' ``.grad`` (``sink=None``) or in the fused path's buffers ``sink``; launch
        (``async_op=True``) every bucket, in order, whose layers are all complete. A no-op while
        :attr:`sync` is off. Errors are kept and raised by :meth:`finish`."""
        if not self.sync or self._error is not None:
            return
        with self._lock:
            if (sink is not None and not self.accept_sink) or not self._final.isdisjoint(layers):
                # gradients that reach .grad after the launched copies (buffers added later, a second
                # pipelined call in the same backward): finish() reduces everything from .grad
                self._dirty = True
            if self._dirty:
                return
            self._final.update(layers)
            try:
                while self._next < len(self._buckets) and self._buckets[self._next].layers <= self._final:
                    bucket = self._buckets[self._next]
                    bucket.buffer = _flatten(bucket.params, sink)
                    bucket.sink = sink
                    bucket.handle = dist.all_reduce(bucket.buffer, async_op=True)
                    self._next += 1
            except Exception as error:  # noqa: BLE001
                self._error = error

    def sink_barrier(self, sink: dict) -> None:
        """Fused path, main thread, before the loss's backward adds ``sink`` into ``.grad``: wait
        for the buckets launched from ``sink`` and write the mean into its buffers (a parameter
        without a buffer on this process gets one: the mean, its own part counted as zeros).

        Raises:
            DataParallelError: when a collective failed.
        """
        start = time.perf_counter()
        world = dist.get_world_size()
        with self._lock:
            launched = [b for b in self._buckets[:self._next] if b.sink is sink and b.handle is not None]
        try:
            for bucket in launched:
                bucket.handle.wait()
                bucket.handle = None
                buffer = bucket.buffer.div_(world)
                offset = 0
                for p in bucket.params:
                    n = p.numel()
                    chunk = buffer[offset:offset + n].view(p.shape)
                    entry = sink.get(id(p))
                    if entry is None:
                        sink[id(p)] = (p, chunk.to(p.dtype).clone())
                    else:
                        entry[1].copy_(chunk)
                    offset += n
                self._count(buffer)
                bucket.buffer = None
                bucket.rereduce = any(p.grad is not None for p in bucket.params)
        except Exception as exc:  # noqa: BLE001
            raise _fail("the gradient all-reduce", exc) from exc
        finally:
            self._stats.seconds += time.perf_counter() - start

    # ------------------------------------------------------------------ main thread
    def finish(self, extra_params: Sequence[torch.Tensor] = ()) -> None:
        """Average every gradient over the processes: wait for the launched buckets and write them
        back, then reduce the buckets not launched and ``extra_params`` (trainable parameters
        outside the pipelined model, in a fixed order) synchronously. Resets for the next backward.

        Raises:
            DataParallelError: when a collective failed.
        """
        start = time.perf_counter()
        world = dist.get_world_size()
        with self._lock:
            launched, rest_buckets = self._buckets[:self._next], self._buckets[self._next:]
            all_launched = launched
            error, self._error = self._error, None
            dirty, self._dirty = self._dirty, False
            self._next = 0
            self._final.clear()
        try:
            if error is not None:
                raise error
            if dirty or any(b.rereduce for b in launched):
                # some gradient reached .grad after its bucket was launched: reduce every bucket from .grad
                # (the mean of `prev_r + c` is `mean(prev_r) + c` for an already averaged part c)
                for bucket in launched:
                    if bucket.handle is not None:
                        bucket.handle.wait()
                launched, rest_buckets = [], self._buckets
            for bucket in launched:
                if bucket.sink is not None:  # written into the buffers by sink_barrier (or unused: no loss backward)
                    if bucket.handle is not None:
                        bucket.handle.wait()
                    continue
                bucket.handle.wait()
                _unflatten(bucket.buffer.div_(world), bucket.params, zeros_for_none=True)
                self._count(bucket.buffer)
                bucket.handle = bucket.buffer = None
            rest = [p for b in rest_buckets for p in b.params]
            seen = {id(p) for b in self._buckets for p in b.params}
            rest += [p for p in extra_params if id(p) not in seen]
            if rest:
                present = torch.tensor([p.grad is not None for p in rest], dtype=torch.uint8)
                dist.all_reduce(present, op=dist.ReduceOp.MAX)
                chosen = [p for p, hit in zip(rest, present.tolist()) if hit]
                for group in _groups(chosen, self.bucket_bytes):
                    buffer = _flatten(group)
                    dist.all_reduce(buffer)
                    _unflatten(buffer.div_(world), group, zeros_for_none=True)
                    self._count(buffer)
        except DataParallelError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _fail("the gradient all-reduce", exc) from exc
        finally:
            for bucket in all_launched:
                bucket.handle = bucket.buffer = bucket.sink = None
                bucket.rereduce = False
            self._stats.seconds += time.perf_counter() - start

    def discard(self) -> None:
        """Forget launched buckets without waiting (after an error in the backward)."""
        with self._lock:
            for bucket in self._buckets:
                bucket.handle = bucket.buffer = bucket.sink = None
            self._next = 0
            self._final.clear()
            self._error = None
            self._dirty = False

    def _count(self, buffer: torch.Tensor) -> None:
        self._stats.bytes += buffer.numel() * buffer.element_size()
        self._stats.buckets += 1

    def pop_stats(self) -> AllReduceStats:
        """The cost since the last call (and reset)."""
        out, self._stats = self._stats, AllReduceStats()
        return out


def _groups(params: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = []
    current_bytes = bucket_bytes + 1
    for p in params:
        nbytes = p.numel() * 4
        if current_bytes + nbytes > bucket_bytes:
            out.append([])
            current_bytes = 0
        out[-1].append(p)
        current_bytes += nbytes
    return out


def _flatten(params: Sequence[torch.Tensor], sink: dict | None = None) -> torch.Tensor:
    """One fp32 CPU buffer ``(sum of numel,)`` of the parameters' gradients, from ``.grad`` or
    from the buffers ``sink[id(param)] = (param, grad)``; missing ones as zeros."""
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
    offset = 0
    for p in params:
        n = p.numel()
        grad = p.grad if sink is None else (sink[id(p)][1] if id(p) in sink else None)
        if grad is not None:
            buffer[offset:offset + n].copy_(grad.detach().reshape(-1))
        offset += n
    return buffer


def _unflatten(buffer: torch.Tensor, params: Sequence[torch.Tensor], zeros_for_none: bool) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        chunk = buffer[offset:offset + n].view(p.shape)
        if p.grad is None:
            if zeros_for_none:
                p.grad = chunk.to(p.dtype).clone()
        else:
            p.grad.copy_(chunk)
        offset += n
