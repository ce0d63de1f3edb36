"""The adapter contract: a model turned into a sequence of layers that pass a *carry* dict along.

Every layer is an ``nn.Module`` whose ``forward(carry: dict) -> dict`` takes the carry of the layer
before it. The runtime saves carries at stage boundaries (on the CPU), cuts batches into
microbatches before layer 0, and merges the last layer's carries back into the model's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class LayerSequence:
    """A pipelinable view of one model.

    Attributes:
        target: the module whose ``forward`` the strategy replaces by the pipelined one.
        layers: the layer modules in order; ``layers[i](carry) -> carry``. They reference the
            model's own submodules (no copies), so the model's parameters stay the master weights.
        layer_names: one label per layer for tables and error messages.
        grad_keys: carry keys whose floating-point tensors carry gradients between stages (e.g.
            ``("hidden_states",)``); other carry entries (masks, rotary tables, labels) are constants.
        prepare: ``prepare(args, kwargs) -> carry`` for the whole batch (before the split into
            microbatches); raises ``TypeError``/``ValueError`` for inputs the adapter cannot pipeline.
        finalize: ``finalize(merged_carry) -> output`` builds what the original ``forward`` would return
            from the last layer's carry merged over microbatches (tensors of dim >= 1 concatenated
            along dim 0, 0-dim tensors summed).
        family: a short name of the model family (``"llama"``, ``"nn.Sequential"``...).
        loss_key: key of the last layer's carry that holds the model's own scalar loss, when the
            model can compute one (HF causal LM called with ``labels``); enables the fused path.
        has_loss: ``has_loss(batch_carry) -> bool``: whether this call computes that loss.
        additive_scalars: 0-dim outputs are per-microbatch contributions that sum to the batch's
            value (the HF loss normalised by the whole batch's label tokens). Otherwise every output
            must carry the batch on dim 0, and a 0-dim output is an error.
        routing: mixture-of-experts layers: which layers route tokens (their routing is recorded
            in the forward and replayed in recomputation) and how the whole batch's routing
            enters the outputs (:class:`RoutingSpec`); ``None`` for dense models.
        host_call: ``host_call(args, kwargs) -> bool``: whether this call must run the model's own
            forward, un-pipelined on the host (a KV cache, hidden states...: what ``prepare`` cannot
            pipeline); ``None``: every call is pipelined.
    """

    target: nn.Module
    layers: list[nn.Module]
    layer_names: list[str]
    grad_keys: tuple[str, ...]
    prepare: Callable[[tuple, dict], dict]
    finalize: Callable[[dict], Any]
    family: str = ""
    loss_key: str | None = None
    has_loss: Callable[[dict], bool] | None = None
    additive_scalars: bool = False
    routing: "RoutingSpec | None" = None
    host_call: Callable[[tuple, dict], bool] | None = None

    def __len__(self) -> int:
        return len(self.layers)

    def parameters(self):
        """Unique parameters of all layers (tied ones once), in layer order."""
        seen: set[int] = set()
        for layer in self.layers:
            for p in layer.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p


@dataclass
class RoutingSpec:
    """Routing layers of a mixture-of-experts :class:`LayerSequence` (issue 10 item 1).

    Attributes:
        layers: indices of the layers whose calls run inside
            :func:`~lightning_roundpipe.runtime.routing.routing_scope` (record in the forward,
            replay in recomputation).
        needs_totals: ``needs_totals(batch_carry) -> bool``: whether this call's recomputation
            reads whole-batch routing statistics (the load-balancing loss is on); the engine then
            starts no recomputation of a routing layer before every microbatch's forward passed
            every routing layer.
        outputs: ``outputs(store, batch_carry) -> {key: 0-dim tensor}``: values added to the merged
            outputs after the forward (the load-balancing loss from the whole batch's statistics;
            its gradient the recomputation adds), or ``None``.
    """

    layers: frozenset[int]
    needs_totals: Callable[[dict], bool]
    outputs: Callable[[Any, dict], dict] | None = None


def module_uses_rng(module: nn.Module) -> bool:
    """Whether ``module`` draws random numbers in its current mode.

    True when some submodule sets ``roundpipe_uses_rng = True`` (an opt-in for randomness drawn
    otherwise), or, in training mode, is a dropout (``nn.Dropout*``, also PEFT's ``lora_dropout``)
    with ``p > 0``, an ``nn.RReLU``, or carries a float ``attention_dropout``/``dropout`` attribute
    above 0 (Hugging Face attention modules and ``nn.MultiheadAttention`` apply dropout
    functionally). Such layers run under :func:`~lightning_roundpipe.runtime.rng.rng_scope` with a
    per-(layer, microbatch) seed, so recomputation replays the forward's masks exactly, whichever
    device runs it; other layers run without a private generator (no overhead), and one that draws
    from torch's global generator makes the step raise ``ValueError``.
    """
    for m in module.modules():
        if getattr(m, "roundpipe_uses_rng", False) is True:
            return True
        if not m.training:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if isinstance(m, nn.RReLU):
            return True
        for attr in ("attention_dropout", "dropout"):
            v = getattr(m, attr, None)
            if isinstance(v, float) and v > 0:
                return True
    return False


def is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()
