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

A second backward through the same node (``retain_graph=True``: manual optimization with several
losses or optimizers) runs as under the default strategy: the node tells ``run_backward`` whether
autograd keeps the graph after this backward, so the call keeps what its backward needs (the saved
stage inputs, the fused path's gradient buffers) until the last backward that does not, and every
backward adds its gradients into ``.grad``. The node saves its anchor with ``save_for_backward``, so a
backward after the graph was freed raises torch's own "Trying to backward through the graph a second
time" ``RuntimeError``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

RunBackward = Callable[[list, bool], Sequence[torch.Tensor | None]]


def graph_retained() -> bool:
    """Whether the backward running in this thread keeps the graph afterwards (``retain_graph=True``).

    Reads the current graph task's ``keep_graph`` (``torch._C._autograd._get_current_graph_task_keep_graph``,
    the flag torch's own compiled backward reads for the same purpose; torch 2.13), valid inside a
    node's backward."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


class PipelineOutputs(torch.autograd.Function):
    """Identity on the merged outputs whose backward runs ``run_backward``.

    ``apply(anchor, run_backward, num_outputs, *outputs, *inputs)``: ``anchor`` is a 0-element tensor
    requiring grad (so the node is recorded even when no real input needs grad; saved, so that a
    backward after the graph was freed raises torch's error); ``run_backward`` receives one gradient
    (or ``None``) per output and whether the graph is retained after this backward
    (:func:`graph_retained`), and returns one gradient (or ``None``) per input.
    """

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, run_backward: RunBackward, num_outputs: int, *tensors: torch.Tensor):
        ctx.run_backward = run_backward
        ctx.num_outputs = num_outputs
        ctx.num_inputs = len(tensors) - num_outputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(anchor)
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
        ctx.saved_tensors  # noqa: B018 -- raises torch's error when a backward without retain_graph freed the graph
        input_grads = list(ctx.run_backward(list(grads), graph_retained()))
        return (None, None, None) + (None,) * ctx.num_outputs + tuple(input_grads)


def attach(outputs: Sequence[torch.Tensor], run_backward: RunBackward,
           inputs: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, ...]:
    """Return ``outputs`` attached to a :class:`PipelineOutputs` node that also depends on ``inputs``."""
    anchor = torch.empty(0, requires_grad=True)
    return PipelineOutputs.apply(anchor, run_backward, len(outputs), *outputs, *inputs)
