"""Split a batch carry into microbatches along dim 0, and merge per-microbatch outputs back.

Rules (pytrees of ``torch.utils._pytree``):

- split: a tensor whose dim 0 equals the batch size is cut as ``torch.tensor_split`` cuts (sizes differ
  by at most one, larger first: 7 rows into 5 microbatches gives 2, 2, 1, 1, 1); any other leaf (0-dim
  tensors such as ``num_items_in_batch``, python values, ``None``) is given to every microbatch;
- merge: tensors of dim >= 1 are concatenated along dim 0; 0-dim tensors are summed (they must be
  additive per-microbatch contributions, like a loss already normalised by the whole batch);
- the gradient of a merged output is split back the same way (slices for concatenated leaves, the
  same gradient for summed ones).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree


def batch_size_of(carry: Any) -> int:
    """Size of dim 0 of the first tensor leaf with at least one dimension.

    Raises:
        ValueError: when the input holds no tensor with a batch dimension.
    """
    for leaf in pytree.tree_leaves(carry):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    raise ValueError(
        "Cannot split the input into microbatches: it holds no tensor with a batch dimension (dim 0)."
        " HINT: pass the batch as tensors whose first dimension is the batch."
    )


def split_sizes(rows: int, num_microbatches: int) -> list[int]:
    """Rows of each microbatch when ``rows`` are cut into ``min(num_microbatches, rows)`` (at least
    one): sizes differ by at most one, larger first, as ``torch.tensor_split`` cuts (7 rows into 5:
    ``[2, 2, 1, 1, 1]``). The runtime's cut (:func:`split_microbatches`) and the automatic choice's
    model of it both use this."""
    count = max(1, min(num_microbatches, rows))
    return [rows // count + (1 if i < rows % count else 0) for i in range(count)]


def split_microbatches(carry: Any, num_microbatches: int) -> tuple[list[Any], list[int]]:
    """Cut ``carry`` into ``min(num_microbatches, batch size)`` microbatches (:func:`split_sizes`).

    Returns:
        ``(microbatches, sizes)``: the per-microbatch carries and their batch sizes (rows).
    """
    bsz = batch_size_of(carry)
    sizes = split_sizes(bsz, num_microbatches)
    leaves, spec = pytree.tree_flatten(carry)
    per_leaf = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == bsz:
            per_leaf.append(torch.split(leaf, sizes, dim=0))
        else:
            per_leaf.append([leaf] * len(sizes))
    mbs = [pytree.tree_unflatten([pl[i] for pl in per_leaf], spec) for i in range(len(sizes))]
    return mbs, sizes


def merge_leaves(per_mb_leaves: Sequence[Sequence[Any]]) -> list[Any]:
    """Merge flat leaf lists (one per microbatch, same structure) into one flat list."""
    merged = []
    for column in zip(*per_mb_leaves):
        first = column[0]
        if isinstance(first, torch.Tensor):
            merged.append(torch.stack(column).sum(0) if first.dim() == 0 else torch.cat(column, dim=0))
        else:
            merged.append(first)
    return merged


def split_grads(merged_leaves: Sequence[Any], grads: Sequence[torch.Tensor | None], sizes: Sequence[int]) -> list[list[Any]]:
    """Per-microbatch gradients of merged outputs: ``result[m][i]`` for leaf ``i`` of microbatch ``m``."""
    out: list[list[Any]] = [[] for _ in sizes]
    for leaf, g in zip(merged_leaves, grads):
        if g is None or not isinstance(leaf, torch.Tensor):
            parts = [None] * len(sizes)
        elif leaf.dim() == 0:
            parts = [g] * len(sizes)
        else:
            parts = list(torch.split(g, list(sizes), dim=0))
        for m, p in enumerate(parts):
            out[m].append(p)
    return out


def merge_input_grads(batch_leaves: Sequence[torch.Tensor], per_mb_grads: Sequence[Sequence[torch.Tensor | None]],
                      sizes: Sequence[int]) -> list[torch.Tensor | None]:
    """Gradients of batch inputs from their per-microbatch gradients.

    A leaf that was cut along dim 0 gets its slices concatenated (a missing slice is zeros); a leaf
    given whole to every microbatch gets the sum.
    """
    bsz = sum(sizes)
    out: list[torch.Tensor | None] = []
    for j, leaf in enumerate(batch_leaves):
        grads = [mb[j] for mb in per_mb_grads]
        if all(g is None for g in grads):
            out.append(None)
            continue
        if leaf.dim() >= 1 and leaf.shape[0] == bsz:
            parts = [g if g is not None else torch.zeros((n,) + tuple(leaf.shape[1:]), dtype=leaf.dtype)
                     for g, n in zip(grads, sizes)]
            out.append(torch.cat(parts, dim=0).to(leaf.dtype))
        else:
            out.append(torch.stack([g for g in grads if g is not None]).sum(0).to(leaf.dtype))
    return out


def check_batch_dim(per_mb_leaves: list[list], sizes: list[int], family: str) -> None:
    """Outputs of a model without additive scalars must carry the batch on dim 0 (they are concatenated)."""
    for leaves, rows in zip(per_mb_leaves, sizes):
        for t in leaves:
            if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] != rows):
                raise ValueError(
                    f"The pipelined `{family}` returned a tensor of shape {tuple(t.shape)} for a microbatch of {rows} rows:"
                    " its outputs must carry the batch on dim 0, because RoundPipe concatenates them over microbatches."
                    " HINT: compute reductions (the loss, a mean over the batch) outside the pipelined model."
                )


class BatchStatistics:
    """The batch normalisation layers of a layer sequence, and the microbatch count they allow.

    Batch normalisation (``torch.nn.modules.batchnorm._BatchNorm``: ``BatchNorm1d/2d/3d``, the lazy
    ones, ``SyncBatchNorm``) normalises each row with the mean and variance of the whole batch in
    train mode, and in eval mode without running statistics (``track_running_stats=False``). Cut into
    microbatches it would normalise with each microbatch's statistics instead (and fail on a microbatch
    of one row), so while such a layer uses batch statistics every call runs the whole batch as one
    microbatch, exactly as the un-pipelined model (the stages still run on the devices in turn; the
    microbatches' overlap is lost). In eval mode with running statistics the layer is per-row and the
    calls are cut as usual. Per-row normalisations (``LayerNorm``, ``GroupNorm``, ``InstanceNorm``,
    RMSNorm) never count. Batch statistics computed by other code (a custom layer) cannot be detected.

    Args:
        layers: the sequence's layers (``LayerSequence.layers``).
        target: the pipelined module (``LayerSequence.target``): the warning names the layers by their
            path in it.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], target: torch.nn.Module) -> None:
        paths = {id(module): name for name, module in target.named_modules()}
        self.target_name = type(target).__name__
        self.modules = [(paths.get(id(module), type(module).__name__), module)
                        for layer in layers for module in layer.modules() if isinstance(module, _BatchNorm)]
        self.warned = False

    def active(self) -> list[str]:
        """Labels of the layers that normalise with batch statistics in their current mode."""
        return [label for label, module in self.modules if module.training or module.running_mean is None]

    def num_microbatches(self, num_microbatches: int) -> int:
        """1 while a layer uses batch statistics (warns once, naming it, when that overrides a larger
        ``num_microbatches``), else ``num_microbatches``."""
        if not self.modules or num_microbatches == 1:
            return num_microbatches
        active = self.active()
        if not active:
            return num_microbatches
        if not self.warned:
            self.warned = True
            kinds = sorted({type(module).__name__ for label, module in self.modules if label in active})
            warnings.warn(
                f"RoundPipe: {', '.join(f'`{label}`' for label in active)} of the pipelined `{self.target_name}`"
                f" ({', '.join(kinds)}) {'normalises' if len(active) == 1 else 'normalise'} with the statistics"
                " of the whole batch, which microbatches would change: calls run the whole batch as one microbatch"
                f" (not {num_microbatches}) while such a layer is in train mode, exactly as without the pipeline, but without"
                " the overlap of microbatches. HINT: a per-row normalisation (`nn.LayerNorm`, `nn.GroupNorm`) pipelines"
                " microbatches; so does batch normalisation in eval mode (`layer.eval()`: its running statistics).",
                stacklevel=3)
        return 1
