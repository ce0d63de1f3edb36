"""Chunked LM head + causal-LM loss: the logits exist one chunk of tokens at a time (issue 10, item 2).

The fused tail's memory is dominated by the ``[tokens, vocab]`` logits (SmolLM2: 49152 x 4 bytes =
192 KiB per token in fp32, 1.5 GiB at 8192 tokens, and about as much again for their gradient). Here
the final hidden states are cut into chunks of ``chunk_tokens`` tokens; each chunk's logits are
computed, reduced to a summed token loss and dropped. In backward each chunk's logits are
**recomputed** from the chunk's hidden states (``torch.utils.checkpoint`` per chunk, non-reentrant),
back-propagated and dropped before the next chunk, so the tail's peak memory grows with the chunk,
not with the sequence. The LM head weight's gradient is accumulated chunk by chunk by autograd (one
buffer: the weight is one leaf); this also holds for an LM head tied to the embedding and for a
PEFT-wrapped head, since the head is called as a module. Cost: one more LM-head GEMM per token in
backward (the recomputation), the trade the chunked losses of Liger-Kernel and torchtune make.
Within a chunk, :class:`ChunkCrossEntropy` holds two fp32 ``[tokens, vocab]`` tensors at most
(:data:`LOSS_BYTES_PER_LOGIT`). fp64 logits (``64-true``) take ``F.cross_entropy`` on the fp32 logits
instead, the ops ``ForCausalLMLoss`` runs, so a 64-true fused step gives the default strategy's
gradients to fp64 rounding (a numerics check, where memory is not the concern).

The loss is the one of transformers' ``ForCausalLMLoss`` (``transformers/loss/loss_utils.py``):
labels shifted left by one (the last position ignored), ``ignore_index`` positions skipped, logits
upcast to fp32, token losses summed and divided by ``num_items_in_batch`` (when ``None``: by the
number of non-ignored shifted labels, i.e. the mean).

:data:`LOSS_ONLY` tells the tail that nobody reads the logits (the RoundPipe executor's fused ``X``
op sets it around the fused tail's forward): only then does the tail take the chunked path; the
transparent path, calls without labels and ``fused_loss=False`` still get full logits.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: Default budget of one chunk's logits, bytes (in the logits' compute dtype): 256 MiB.
DEFAULT_LOSS_CHUNK_BYTES = 256 * 2**20

#: Bytes per logit a chunk holds at its peak (the chunk's backward) with fp32 logits: the fp32
#: logits :class:`ChunkCrossEntropy` saves and its fp32 gradient (a compute dtype narrower than fp32
#: adds the compute-dtype logits and gradient around them, transiently).
LOSS_BYTES_PER_LOGIT = 8

#: Set (``True``) while a fused tail runs whose caller needs only the loss (see the module docstring).
LOSS_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("roundpipe_loss_only", default=False)


@contextlib.contextmanager
def loss_only() -> Iterator[None]:
    """Within this block (this thread), a tail called with labels may return the loss without logits."""
    token = LOSS_ONLY.set(True)
    try:
        yield
    finally:
        LOSS_ONLY.reset(token)


def default_chunk_tokens(vocab_size: int, itemsize: int, chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES) -> int:
    """The most tokens whose logits take at most ``chunk_bytes``: ``chunk_bytes // (vocab_size * itemsize)``
    (at least 1).

    Args:
        vocab_size: logits per token.
        itemsize: bytes of one logit in the compute dtype (2 for bf16/fp16, 4 for fp32).
        chunk_bytes: the budget, bytes (default 256 MiB).

    Raises:
        ValueError: for a non-positive argument.
    """
    for name, value in (("vocab_size", vocab_size), ("itemsize", itemsize), ("chunk_bytes", chunk_bytes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    return max(1, chunk_bytes // (vocab_size * itemsize))


def logits_itemsize(hidden: torch.Tensor, head: torch.nn.Module) -> int:
    """Bytes of one logit the head produces for ``hidden``: the autocast dtype when autocast is on for
    ``hidden``'s device, else the dtype of the head's first floating-point parameter (``hidden``'s otherwise)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type).itemsize
    for p in head.parameters():
        if p.is_floating_point():
            return p.dtype.itemsize
    return hidden.dtype.itemsize


def shifted_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Labels shifted left by one token as ``ForCausalLMLoss`` does (``(batch, seq)``, the last column ``ignore_index``)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


class ChunkCrossEntropy(torch.autograd.Function):
    """Summed token cross-entropy of one chunk, ``F.cross_entropy(logits.float(), labels, reduction="sum")``
    with ``ignore_index``, holding less: forward keeps the fp32 logits and the per-token
    ``logsumexp`` only, and backward writes ``softmax - one_hot`` into one fp32 buffer in place. So
    a chunk's loss holds two fp32 ``[tokens, vocab]`` tensors at most (the logits and their
    gradient; plus the compute-dtype logits when that is narrower), where the eager
    ``log_softmax`` + ``nll_loss`` holds about four.

    ``apply(logits, labels, ignore_index)``: logits float ``(tokens, vocab)``, labels int64
    ``(tokens,)``; returns the fp32 scalar sum over non-ignored tokens.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        x = logits.float()
        top = x.amax(dim=-1, keepdim=True)  # logsumexp with one [tokens, vocab] temporary (torch.logsumexp holds two)
        lse = torch.sub(x, top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))
        valid = labels != ignore_index
        safe = torch.where(valid, labels, 0)
        picked = x.gather(1, safe.unsqueeze(1)).squeeze(1)
        ctx.save_for_backward(x, lse, safe, valid)
        ctx.logits_dtype = logits.dtype
        return ((lse - picked) * valid).sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, lse, safe, valid = ctx.saved_tensors
        grad = torch.sub(x, lse.unsqueeze(1)).exp_()  # softmax
        grad.scatter_add_(1, safe.unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
        grad.mul_((grad_output * valid).unsqueeze(1))
        return grad.to(ctx.logits_dtype), None, None


def _chunk_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor],
                    ignore_index: int) -> torch.Tensor:
    logits = logits_fn(hidden)
    if logits.dtype == torch.float64:
        # 64-true (a numerics check): the reference's own ops. `ForCausalLMLoss` calls `.float()`, so it computes
        # the loss of fp64 logits in fp32 too; with the same ops each token's gradient is the default strategy's
        # bit for bit, however the batch is cut. ChunkCrossEntropy's leaner formula rounds differently (relative
        # gradient error about 1e-7: below fp32's resolution, not below fp64's).
        return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")
    return ChunkCrossEntropy.apply(logits, labels, ignore_index)


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    *,
    chunk_tokens: int,
    ignore_index: int = -100,
    recompute: bool = True,
) -> torch.Tensor:
    """``ForCausalLMLoss(logits_fn(hidden), labels, num_items_in_batch=...)`` without the full logits.

    Args:
        hidden: final hidden states after the last norm, float ``(batch, seq, hidden)``.
        logits_fn: ``(tokens, hidden) -> (tokens, vocab)`` logits (the LM head, then any logits
            scaling or soft-capping); called once per chunk in forward and, with several chunks, once
            more per chunk in backward (recomputation); a single chunk keeps its graph (one call).
        labels: int64 ``(batch, seq)``, ``ignore_index`` at ignored positions (not yet shifted).
        num_items_in_batch: the divisor (label tokens of the whole batch after the shift); ``None``:
            the non-ignored shifted labels of ``labels``.
        chunk_tokens: tokens per chunk (see :func:`default_chunk_tokens`).
        ignore_index: label value that contributes no loss.
        recompute: with grad enabled and several chunks, keep no chunk's logits for backward (recompute
            them); ``False`` keeps every chunk's autograd graph (use when ``logits_fn`` draws random numbers).

    Returns:
        The scalar fp32 loss.

    Raises:
        ValueError: for ``chunk_tokens < 1`` or labels whose shape is not ``hidden.shape[:-1]``.
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` must be a positive int, got {chunk_tokens!r}.")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"`labels` must have shape {tuple(hidden.shape[:-1])} (the hidden states' batch and sequence),"
                         f" got {tuple(labels.shape)}.")
    target = shifted_labels(labels, ignore_index).reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    # one chunk holds all the tokens: keep its graph (its logits are within the chunk budget anyway), so the
    # LM head is not run twice; recompute only when there are several chunks to keep out of memory at once
    use_checkpoint = recompute and torch.is_grad_enabled() and flat.shape[0] > chunk_tokens
    total = None
    for h, y in zip(flat.split(chunk_tokens), target.split(chunk_tokens)):
        if use_checkpoint:
            part = checkpoint(_chunk_loss_sum, h, y, logits_fn, ignore_index, use_reentrant=False,
                              preserve_rng_state=False)
        else:
            part = _chunk_loss_sum(h, y, logits_fn, ignore_index)
        total = part if total is None else total + part
    if num_items_in_batch is None:
        divisor = (target != ignore_index).sum()
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=total.device)
    return total / divisor
