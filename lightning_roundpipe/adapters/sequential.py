"""``nn.Sequential`` taken layer by layer."""

from __future__ import annotations

from torch import nn

from lightning_roundpipe.adapters.base import LayerSequence


class SequentialLayer(nn.Module):
    """One child of an ``nn.Sequential``: ``{"x": input} -> {"x": child(input)}``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, carry: dict) -> dict:
        return {"x": self.module(carry["x"])}


def sequential_adapter(model: nn.Sequential) -> LayerSequence:
    """Layer sequence of an ``nn.Sequential``: one layer per child.

    The model takes one positional input whose tensors have the batch on dim 0; its output must
    have the batch on dim 0 too (it is concatenated over microbatches).

    Raises:
        ValueError: for an empty ``nn.Sequential``.
    """
    if len(model) == 0:
        raise ValueError("Cannot pipeline an empty `nn.Sequential`: it has no layers.")

    def prepare(args: tuple, kwargs: dict) -> dict:
        if kwargs or len(args) != 1:
            raise TypeError(
                f"A pipelined `nn.Sequential` takes exactly one positional input, got {len(args)} positional and"
                f" keyword arguments {sorted(kwargs)}. HINT: call it as `model(x)`."
            )
        return {"x": args[0]}

    names = [f"{name}:{type(child).__name__}" for name, child in model.named_children()]
    return LayerSequence(
        target=model,
        layers=[SequentialLayer(child) for child in model],
        layer_names=names,
        grad_keys=("x",),
        prepare=prepare,
        finalize=lambda merged: merged["x"],
        family="nn.Sequential",
    )
