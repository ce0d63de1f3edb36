"""Mixture-of-experts decoder layers of Hugging Face causal LMs: Qwen3-MoE and GPT-OSS (issue 10 item 1).

The decoder layers are Hugging Face's own; two things are added around them.

**Routing replay** (:mod:`~lightning_roundpipe.runtime.replay.routing`): a forward hook on every router
module (``Qwen3MoeTopKRouter`` at ``mlp.gate``, ``GptOssTopKRouter`` at ``mlp.router``) records the
selected expert indices in the forward and, in a backward stage's recomputation, replaces the
router's output by the recorded indices with the routing weights recomputed from the recomputed
router logits at those indices, as the router computes them:

- Qwen3-MoE: ``softmax(logits, fp32)`` gathered at the indices, renormalised over the top-k when
  ``norm_topk_prob``, cast to the logits' dtype;
- GPT-OSS: the logits gathered at the indices, ``softmax`` over the top-k.

The weights are thus the same differentiable functions of the router logits as in the forward,
and a near-tie can never send a token to another expert in recomputation. The hooks do nothing
outside a routing scope (the model's own forward, the default strategy).

**Load-balancing loss** (``output_router_logits=True`` in the call or the config): Hugging Face's
``load_balancing_loss_func`` (Switch Transformer, arXiv 2101.03961, eqs. 4-6) over all routing
layers and all (unmasked) tokens of the batch is

    aux = E * sum_e (C_e / N) * (P_e / N),

``C_e`` the top-k assignments to expert ``e`` (not differentiable), ``P_e`` the summed router
probabilities (differentiable), ``N`` = routing layers x unmasked tokens; the loss gets
``router_aux_loss_coef * aux``. A product of whole-batch sums is not a sum over microbatches, but
with ``C`` fixed it is linear in ``P``: ``aux = sum over (layer, microbatch) of (E / N^2) <C, P_lm>``.
So the forward records each (layer, microbatch)'s counts and probability sums on the host; the
*value* of ``aux`` is computed from the whole batch's sums after the forward (and added to the
merged ``loss``); for the *gradient*, each recomputation of a routing layer (which runs once
every microbatch's forward has passed every routing layer: the engine guarantees it) adds
``(E / N^2) <C, P_lm>`` with the whole batch's ``C`` to a differentiable scalar in the carry
(``router_aux``), and the tail adds ``coef * (router_aux - router_aux.detach())`` to the loss
(value 0, gradient ``coef``). Loss and gradients equal the model's own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lightning_roundpipe.adapters.base import RoutingSpec
from lightning_roundpipe.adapters.hf_causal_lm import HFDecoderLayer
from lightning_roundpipe.runtime.replay import routing


def _scores_softmax_then_topk(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's ``Qwen3MoeTopKRouter`` weights for given top-k ``indices``."""
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    top = probs.gather(-1, indices)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def _scores_topk_then_softmax(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's ``GptOssTopKRouter`` weights for given top-k ``indices``."""
    top = logits.gather(-1, indices)
    return torch.nn.functional.softmax(top, dim=1, dtype=top.dtype)


@dataclass(frozen=True)
class RouterSpec:
    """Where a family's router sits and how it turns logits into weights.

    Attributes:
        path: attribute path of the router inside a decoder layer (``("mlp", "gate")``).
        class_suffix: the router's class name ends with it (dense layers have none).
        scores: ``scores(router, logits, indices) -> weights``, exactly as the router's forward.
        num_experts_attr: the config attribute with the number of experts.
    """

    path: tuple[str, ...]
    class_suffix: str
    scores: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    num_experts_attr: str


ROUTERS: dict[str, RouterSpec] = {
    "qwen3_moe": RouterSpec(("mlp", "gate"), "TopKRouter", _scores_softmax_then_topk, "num_experts"),
    "gpt_oss": RouterSpec(("mlp", "router"), "TopKRouter", _scores_topk_then_softmax, "num_local_experts"),
}


def _router_of(layer: nn.Module, spec: RouterSpec) -> nn.Module | None:
    module: Any = layer
    for name in spec.path:
        module = getattr(module, name, None)
    if isinstance(module, nn.Module) and type(module).__name__.endswith(spec.class_suffix):
        return module
    return None


def _aux_stats(logits: torch.Tensor, mask: torch.Tensor, num_experts: int, top_k: int) -> dict[str, torch.Tensor]:
    """One router call's share of ``load_balancing_loss_func``'s sums, with the attention mask:
    ``counts`` (top-k assignments per expert) and ``probs`` (summed router probabilities), fp32 ``(E,)``."""
    probs = torch.nn.functional.softmax(logits.detach(), dim=-1)
    _, selected = torch.topk(probs, top_k, dim=-1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=logits.device).scatter_add_(
        0, selected.reshape(-1), mask.repeat_interleave(top_k))
    return {"counts": counts, "probs": (probs.float() * mask.unsqueeze(-1)).sum(dim=0)}


def _router_hook(spec: RouterSpec, num_experts: int, module: nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook of a router: record (forward) or replay (recomputation) its routing."""
    scope = routing.current()
    if scope is None:
        return None
    logits, scores, indices = output
    key = scope.next_key()
    aux = scope.batch.get("aux")
    if not scope.recompute:
        stats = _aux_stats(logits, aux["mask"], num_experts, indices.shape[-1]) if aux is not None else {}
        scope.store.record(key, indices, stats)
        return None
    if scope.replay:
        indices = scope.store.replay(key, logits.device, scope.wait)
        scores = spec.scores(module, logits, indices)
    if aux is not None:  # this (layer, microbatch)'s share of the load-balancing loss, for its gradient
        counts = scope.store.totals(scope.wait, logits.device)["counts"]  # no host sync inside the op
        probs = torch.nn.functional.softmax(logits, dim=-1).float() * aux["mask"].unsqueeze(-1)
        scope.aux_terms.append(aux["weight"] * (counts * probs.sum(dim=0)).sum())
    return (logits, scores, indices)


class HFMoeDecoderLayer(nn.Module):
    """One mixture-of-experts decoder layer: the dense wrapper's call, plus the token mask and the
    load-balancing weight for its router hooks, and their gradient terms added to ``router_aux``."""

    def __init__(self, dense: nn.Module, num_experts: int) -> None:
        super().__init__()
        self.dense = dense
        self.num_experts = num_experts

    def forward(self, carry: dict) -> dict:
        scope = routing.current()
        if scope is not None and carry.get("router_aux_on"):
            h = carry["hidden_states"]
            mask = carry.get("attention_mask")  # the carried 2D mask: the tokens the loss counts
            flat = (mask.reshape(-1).to(torch.float32) if mask is not None
                    else torch.ones(h.shape[0] * h.shape[1], dtype=torch.float32, device=h.device))
            scope.batch["aux"] = {"mask": flat, "weight": self.num_experts / carry["router_rows"] ** 2}
        out = self.dense(carry)
        if scope is not None and scope.aux_terms:
            out["router_aux"] = carry["router_aux"] + torch.stack(scope.aux_terms).sum()
        return out


def _tail_hook(coef: float, module: nn.Module, args: tuple, out: dict) -> dict:
    """The tail's outputs with the load-balancing loss's gradient path: ``router_aux`` enters the
    loss as ``coef * (a - a.detach())`` (value 0; the value comes from the whole batch's sums)."""
    carry = args[0]
    if not carry.get("router_aux_on"):
        return out
    a = carry["router_aux"]
    delta = a - a.detach()
    out = dict(out)
    if out.get("loss") is not None:
        out["loss"] = out["loss"] + coef * delta
    out["aux_loss"] = delta
    return out


class MoeParts:
    """What the causal-LM adapter needs for a mixture-of-experts family (built by :func:`moe_parts`)."""

    kwargs = ("output_router_logits",)
    grad_keys = ("hidden_states", "router_aux")

    def __init__(self, model: nn.Module, spec: RouterSpec) -> None:
        self.config = model.config
        self.spec = spec
        self.num_experts = int(getattr(self.config, spec.num_experts_attr))
        self.coef = float(self.config.router_aux_loss_coef)
        self.routing_decoders: list[int] = []
        self._index = 0

    def decoder(self, layer: nn.Module, layer_type: str, derived: nn.Module) -> nn.Module:
        index, self._index = self._index, self._index + 1
        dense = HFDecoderLayer(layer, layer_type, derived)
        router = _router_of(layer, self.spec)
        if router is None:
            return dense
        old = getattr(router, "_roundpipe_hook", None)
        if old is not None:  # the adapter is built again (a new fit): one hook per router
            old.remove()
        router._roundpipe_hook = router.register_forward_hook(
            functools.partial(_router_hook, self.spec, self.num_experts))
        self.routing_decoders.append(index)
        return HFMoeDecoderLayer(dense, self.num_experts)

    def tail(self, tail: nn.Module) -> nn.Module:
        tail.register_forward_hook(functools.partial(_tail_hook, self.coef))
        return tail

    def prepare(self, carry: dict, kwargs: dict) -> None:
        flag = kwargs.get("output_router_logits")
        on = bool(self.config.output_router_logits if flag is None else flag)
        carry["router_aux_on"] = on
        if not on:
            return
        mask = kwargs.get("attention_mask")
        tokens = float(mask.sum()) if mask is not None else float(carry["input_ids"].numel())
        carry["router_rows"] = len(self.routing_decoders) * tokens
        carry["router_aux"] = torch.zeros((), dtype=torch.float32)

    def finalize(self, merged: dict) -> Any:
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        if "logits" not in merged:  # the fused path: the loss (and the load-balancing loss's value) only
            from lightning_roundpipe.adapters.hf_outputs import FusedMoeCausalLMOutput

            return FusedMoeCausalLMOutput(loss=merged.get("loss"), aux_loss=merged.get("aux_loss"))
        return MoeCausalLMOutputWithPast(loss=merged.get("loss"), aux_loss=merged.get("aux_loss"),
                                         logits=merged.get("logits"))

    def outputs(self, store: routing.RoutingStore, batch_carry: dict) -> dict:
        """The load-balancing loss from the whole batch's routing (``load_balancing_loss_func``)."""
        if not batch_carry.get("router_aux_on"):
            return {}
        totals = store.totals()
        rows = batch_carry["router_rows"]
        aux = torch.sum((totals["counts"] / rows) * (totals["probs"] / rows).unsqueeze(0)) * self.num_experts
        extra = {"aux_loss": aux}
        if batch_carry.get("labels") is not None:
            extra["loss"] = self.coef * aux
        return extra

    def routing_spec(self, layer_offset: int) -> RoutingSpec:
        return RoutingSpec(layers=frozenset(i + layer_offset for i in self.routing_decoders),
                           needs_totals=lambda carry: bool(carry.get("router_aux_on")), outputs=self.outputs)


def moe_parts(model: nn.Module) -> MoeParts:
    """The :class:`MoeParts` of a Qwen3-MoE or GPT-OSS causal LM (PEFT-unwrapped)."""
    return MoeParts(model, ROUTERS[model.config.model_type])
