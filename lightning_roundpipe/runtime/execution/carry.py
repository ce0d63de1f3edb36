"""Carries on a device made safe against in-place ops (DESIGN.md section 9, issue 7 item 2).

A layer may modify its input in place (``nn.ReLU(inplace=True)``, ``x += bias``), as it may in plain
PyTorch, where its input is the non-leaf output of the layer before. Two places of the pipeline
would otherwise break or be corrupted by such a layer:

- **Recomputation** (``R``, ``X``) differentiates with respect to the stage input. The gradient is
  read from a fresh leaf requiring grad, and the layers get a *clone* of it (a non-leaf): an
  in-place op on a leaf that requires grad is an autograd error, and the clone's gradient flows
  back into the leaf. Cost: one copy of the stage input's differentiable tensors per microbatch.
- **Saved boundaries**: a forward stage keeps the inputs of the backward stages' first layers
  (``on_boundary``) for the D2H copy that follows the stage's compute. A later layer of the same
  stage working in place on that very tensor would change what was saved, so the saved carry's
  tensors are snapshots (clones, on the compute stream) taken when the boundary is passed. The
  output of the stage is not snapshotted: no layer runs on it after the stage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_roundpipe.adapters.base import is_float_tensor


def grad_leaves(carry: dict, keys: tuple[str, ...]) -> tuple[dict, list[torch.Tensor]]:
    """Stage input of a recomputation: a copy of ``carry`` whose float tensors under ``keys`` are
    clones of fresh leaves requiring grad.

    Returns:
        ``(carry for the layers, leaves)``; after the backward, ``leaf.grad`` is the gradient of
        the stage input (shape and dtype of the input tensor).
    """
    leaves: list[torch.Tensor] = []

    def mark(t: Any) -> Any:
        if is_float_tensor(t):
            leaf = t.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone()
        return t

    out = dict(carry)
    for k in keys:
        if k in out:
            out[k] = pytree.tree_map(mark, out[k])
    return out, leaves


def grad_positions(carry: Any, positions: tuple) -> tuple[Any, list[torch.Tensor]]:
    """As :func:`grad_leaves` for the leaves of ``carry`` at the flat (pytree) ``positions``."""
    flat, spec = pytree.tree_flatten(carry)
    leaves = []
    for i in positions:
        leaf = flat[i].detach().requires_grad_(True)
        leaves.append(leaf)
        flat[i] = leaf.clone()
    return pytree.tree_unflatten(flat, spec), leaves


def diff_leaves(carry: dict, keys: tuple[str, ...]) -> list[Any]:
    """The floating-point tensors under ``keys`` (the outputs a backward stage differentiates)."""
    return [t for k in keys if k in carry for t in pytree.tree_leaves(carry[k]) if is_float_tensor(t)]


def snapshot(carry: Any) -> Any:
    """A copy of ``carry`` whose tensors are clones: no later in-place op can reach it."""
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, carry)
