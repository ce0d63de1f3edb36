"""The autograd node of both paths (DESIGN.md section 2).

Transparent path: the pipelined forward runs every forward stage without autograd, merges the
outputs on the CPU and returns them through :class:`PipelineOutputs`. When autograd reaches that
node (Lightning's own ``loss.backward()``), its backward runs the backward stages with the incoming
output gradients; parameter gradients land in the masters' ``.grad`` before ``backward()`` returns.

Fused path: the whole step already ran inside the forward call; the node's backward scales the CPU
gradient buffers by the incoming gradient.

In both, floating-point *inputs* of the pipelined model that require grad (the output of a trainable
module in front of it) are inputs of the node, and its backward returns their gradients, so autograd
carries on into the modules upstream.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

RunBackward = Callable[[list], Sequence[torch.Tensor | None]]


class PipelineOutputs(torch.autograd.Function):
    """Identity on the merged outputs whose backward runs ``run_backward``.

    ``apply(anchor, run_backward, num_outputs, *outputs, *inputs)``: ``anchor`` is a 0-element tensor
    requiring grad (so the node is recorded even when no real input needs grad); ``run_backward``
    receives one gradient (or ``None``) per output and returns one gradient (or ``None``) per input.
    """

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, run_backward: RunBackward, num_outputs: int, *tensors: torch.Tensor):
        ctx.run_backward = run_backward
        ctx.num_outputs = num_outputs
        ctx.num_inputs = len(tensors) - num_outputs
        ctx.set_materialize_grads(False)
        outs = tuple(o.detach() for o in tensors[:num_outputs])  # fresh tensor objects, shared storage
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "Double backward (`create_graph=True`, e.g. a gradient penalty) through a RoundPipe pipeline is not"
                " supported: its backward runs on the device workers outside autograd's graph."
                " HINT: compute such terms outside the pipelined model, or train with the default strategy."
            )
        input_grads = list(ctx.run_backward(list(grads)))
        return (None, None, None) + (None,) * ctx.num_outputs + tuple(input_grads)


def attach(outputs: Sequence[torch.Tensor], run_backward: RunBackward,
           inputs: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, ...]:
    """Return ``outputs`` attached to a :class:`PipelineOutputs` node that also depends on ``inputs``."""
    anchor = torch.empty(0, requires_grad=True)
    return PipelineOutputs.apply(anchor, run_backward, len(outputs), *outputs, *inputs)
