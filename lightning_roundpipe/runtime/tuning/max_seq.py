"""The longest sequence that trains one step without running out of device memory, measured (issue 10, item 5).

Bisection on real steps: ``step(seq_len)`` runs one full training step (forward, loss, backward) at
that sequence length and either returns or raises ``torch.OutOfMemoryError``, which is what a GPU
raises and what a CPU virtual device with ``device_memory_bytes`` raises
(:class:`~lightning_roundpipe.runtime.backends.budget.DeviceMemoryError` subclasses it). The
length doubles from ``start`` until a step fails (or ``limit`` is reached), then the interval
between the last success and the first failure is bisected down to ``resolution`` tokens. Memory
grows with the sequence, so the search is sound; any other exception propagates. Each length is
tried once: a device's peak depends slightly on thread timing (whether the next upload has landed
while a stage computes), so lengths within a few percent of the limit may run in one trial and not
in another.

The planner's counterpart (the cost model's prediction for the same stages) is
:func:`lightning_roundpipe.partition.seqlen.planned_max_seq_len`.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True, kw_only=True)
class MaxSeqResult:
    """Outcome of :func:`measure_max_seq_len`.

    Attributes:
        max_seq_len: the longest sequence (tokens) whose step ran; 0 if not even ``start`` ran.
        first_failing: the shortest sequence that ran out of memory (``None``: none did up to ``limit``).
        trials: ``(seq_len, ran)`` of every step tried, in order.
        error: the message of the out-of-memory error at ``first_failing``.
    """

    max_seq_len: int
    first_failing: int | None
    trials: tuple[tuple[int, bool], ...]
    error: str | None = None


def measure_max_seq_len(step: Callable[[int], Any], *, start: int = 16, limit: int = 1 << 16,
                        resolution: int = 1, collect: bool = True) -> MaxSeqResult:
    """Longest ``seq_len`` in ``[start, limit]`` for which ``step(seq_len)`` does not run out of memory.

    Args:
        step: runs one training step at a sequence length; raises ``torch.OutOfMemoryError`` when
            it does not fit.
        start: first length tried, tokens (>= 1).
        limit: longest length tried, tokens (>= ``start``).
        resolution: the bisection stops when the interval is this narrow, tokens (>= 1).
        collect: run the garbage collector after every step (a failed step's traceback holds
            reference cycles to its device tensors; ``torch.cuda.empty_cache()`` too on CUDA).

    Raises:
        ValueError: for bad ``start`` / ``limit`` / ``resolution``.
    """
    for name, value in (("start", start), ("limit", limit), ("resolution", resolution)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    if limit < start:
        raise ValueError(f"`limit` ({limit}) must be >= `start` ({start}).")
    trials: list[tuple[int, bool]] = []
    errors: dict[int, str] = {}

    def fits(seq_len: int) -> bool:
        try:
            step(seq_len)
            ok = True
        except torch.OutOfMemoryError as error:
            errors[seq_len] = str(error).splitlines()[0]
            ok = False
        if collect:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        trials.append((seq_len, ok))
        return ok

    if not fits(start):
        return MaxSeqResult(max_seq_len=0, first_failing=start, trials=tuple(trials), error=errors[start])
    lo, hi = start, min(2 * start, limit)
    while lo < limit and fits(hi):
        lo, hi = hi, min(2 * hi, limit)
    if lo >= limit:
        return MaxSeqResult(max_seq_len=lo, first_failing=None, trials=tuple(trials))
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return MaxSeqResult(max_seq_len=lo, first_failing=hi, trials=tuple(trials), error=errors.get(hi))


def causal_lm_step(model: torch.nn.Module, batch_rows: int, vocab_size: int, seed: int = 0) -> Callable[[int], None]:
    """``step(seq_len)`` for :func:`measure_max_seq_len`: one training step of a (pipelined) Hugging
    Face causal LM on random tokens, ``batch_rows`` sequences, labels = inputs; gradients are reset
    after it (``zero_grad(set_to_none=True)``)."""

    def step(seq_len: int) -> None:
        g = torch.Generator().manual_seed(seed + seq_len)
        ids = torch.randint(0, vocab_size, (batch_rows, seq_len), generator=g)
        try:
            model(input_ids=ids, labels=ids).loss.backward()
        finally:
            model.zero_grad(set_to_none=True)

    return step
