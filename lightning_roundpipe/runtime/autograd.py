"""The autograd node of the transparent path (DESIGN.md section 2).

The pipelined forward runs every forward stage without autograd, merges the outputs on the CPU
and returns them through :class:`PipelineOutputs`. When autograd reaches that node (Lightning's own
``loss.backward()``), its backward runs the backward stages with the incoming output gradients and
the parameter gradients land in the masters' ``.grad`` before ``backward()`` returns; the node itself
returns no input gradient. So hooks, gradient accumulation, clipping and manual optimization see
ordinary ``.grad`` s.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class PipelineOutputs(torch.autograd.Function):
    """Identity on the merged outputs whose backward runs the backward phase.

    ``apply(anchor, run_backward, *outputs)``: ``anchor`` is a 0-element tensor requiring grad (so
    the node is recorded even though no real input needs grad); ``run_backward(grads)`` receives one
    gradient (or ``None``) per output.
    """

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, run_backward: Callable[[list], None], *outputs: torch.Tensor):
        ctx.run_backward = run_backward
        ctx.set_materialize_grads(False)
        outs = tuple(o.detach() for o in outputs)  # a fresh tensor object shares storage, no copy
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.run_backward(list(grads))
        return (None, None) + (None,) * len(grads)


def attach(outputs: Sequence[torch.Tensor], run_backward: Callable[[list], None]) -> tuple[torch.Tensor, ...]:
    """Return ``outputs`` attached to a :class:`PipelineOutputs` node."""
    anchor = torch.empty(0, requires_grad=True)
    return PipelineOutputs.apply(anchor, run_backward, *outputs)
