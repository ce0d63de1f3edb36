"""Mixture of experts (issue 10 item 1): Qwen3-MoE and GPT-OSS, plain and under LoRA, with the
load-balancing loss on, give the loss, ``aux_loss`` and gradients of the model's own forward
(the default strategy's); routing is replayed in recomputation."""

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model

import lightning_roundpipe
from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.runtime.backends import op_check
from lightning_roundpipe.runtime.replay import routing
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
from _helpers import CausalLMModule, TokenData, VOCAB, fit_params, max_diff

TOL = 1e-5


def tiny_moe(kind: str, aux: bool = True, coef: float = 0.1, layers: int = 3, seed: int = 0):
    """8 experts, top-2, the load-balancing loss on (``output_router_logits``); Qwen3-MoE with one
    dense layer (``mlp_only_layers``), GPT-OSS with sliding and full layers."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=64, output_router_logits=aux, router_aux_loss_coef=coef)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                mlp_only_layers=[1], norm_topk_prob=True, **common)
    else:
        cfg = tf.GptOssConfig(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg)


def _lora(model):
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights="gaussian"))


def _batch(n: int = 7) -> dict:
    data = TokenData(n=n)
    return {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, batch, devices: int, num_microbatches: int, **engine_kw):
    """One pipelined forward and backward; returns (output, gradients)."""
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * devices,
                             num_microbatches=num_microbatches, **engine_kw)
    engine.install()
    try:
        out = model(**batch)
        (out.loss * 2).backward()  # any use of the scalar: gradients are linear in the seed
        return out, _grads(model)
    finally:
        engine.close()


def _reference(model, batch):
    out = model(**batch)
    (out.loss * 2).backward()
    return out, _grads(model)


_REF: dict = {}


def _case(kind: str, lora: bool):
    if (kind, lora) not in _REF:
        model = tiny_moe(kind)
        model = _lora(model) if lora else model
        batch = _batch()
        _REF[(kind, lora)] = (copy.deepcopy(model), batch, _reference(model, batch))
    fresh, batch, ref = _REF[(kind, lora)]
    return copy.deepcopy(fresh), batch, ref


@pytest.mark.parametrize("num_microbatches", [1, 3])
@pytest.mark.parametrize("devices", [1, 2, 3])
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_moe_parity_with_own_forward(kind, lora, devices, num_microbatches, record_property):
    model, batch, (ref_out, ref_grads) = _case(kind, lora)
    out, grads = _step(model, batch, devices, num_microbatches)
    # the fused path: the loss and the load-balancing loss's value only; `.logits` explains (issue 8)
    assert type(out).__name__ == "FusedMoeCausalLMOutput" and not hasattr(out, "logits")
    with pytest.raises(AttributeError, match="fused_loss=False"):
        out.logits
    assert set(out.keys()) == {"loss", "aux_loss"}
    assert grads.keys() == ref_grads.keys() and grads
    diff = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)
    loss_diff = abs(out.loss.item() - ref_out.loss.item())
    aux_diff = abs(out.aux_loss.item() - ref_out.aux_loss.item())
    record_property("max_abs_diff", diff)
    print(f"parity {kind}{' lora' if lora else ''} devices={devices} microbatches={num_microbatches}:"
          f" grads {diff:.2e} loss {loss_diff:.2e} aux_loss {aux_diff:.2e}")
    assert diff <= TOL and loss_diff <= TOL and aux_diff <= TOL
    if lora:
        assert all("lora_" in k for k in grads)


def test_load_balancing_loss_changes_the_gradients():
    """Oracle for the test above: the aux term visibly changes the gradients (so its exactness is tested)."""
    batch = _batch()
    _, with_aux = _reference(tiny_moe("qwen3_moe", coef=0.1), batch)
    _, without = _reference(tiny_moe("qwen3_moe", coef=0.0), batch)
    assert max((with_aux[k] - without[k]).abs().max().item() for k in with_aux) > 100 * TOL


_TAIL_WITH_ROUTER = dict(partition=PartitionPlan((range(0, 3), range(3, 5)), (range(3, 5), range(1, 3), range(0, 1))))


@pytest.mark.parametrize("engine_kw", [dict(fused_loss=False), dict(microbatches_per_round=1), _TAIL_WITH_ROUTER],
                         ids=["transparent", "rounds", "router-in-fused-tail"])
def test_moe_transparent_path_and_rounds(engine_kw):
    """The transparent path, also taken (logits returned) where the fused plan could not wait for the whole
    batch's routing: several rounds, or a routing layer inside the fused tail."""
    model, batch, (ref_out, ref_grads) = _case("gpt_oss", False)
    out, grads = _step(model, batch, 2, 3, **engine_kw)
    assert out.logits is not None and torch.allclose(out.logits, ref_out.logits, atol=TOL)
    assert abs(out.loss.item() - ref_out.loss.item()) <= TOL
    assert max((grads[k] - ref_grads[k]).abs().max().item() for k in grads) <= TOL


def test_second_backward_replays_the_routing():
    """Two backwards through one transparent-path forward (``retain_graph=True`` first): both
    recomputations replay the forward's routing; the gradients equal the model's own forward's."""
    model, batch, _ = _case("gpt_oss", False)
    reference = copy.deepcopy(model)

    def two_backwards(m):
        out = m(**batch)
        out.loss.backward(retain_graph=True)
        (out.logits.square().mean() + out.aux_loss).backward()
        return _grads(m)

    want = two_backwards(reference)
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * 2, num_microbatches=3, fused_loss=False)
    engine.install()
    try:
        got = two_backwards(model)
    finally:
        engine.close()
    assert got.keys() == want.keys() and got
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= TOL


def test_aux_loss_off_and_evaluation():
    model = tiny_moe("qwen3_moe", aux=False)
    ref = copy.deepcopy(model)
    batch = _batch()
    out, grads = _step(model, batch, 3, 3, microbatches_per_round=1)  # the fused path in rounds: replay only
    ref_out, ref_grads = _reference(ref, batch)
    assert out.aux_loss is None and ref_out.aux_loss is None
    assert max((grads[k] - ref_grads[k]).abs().max().item() for k in grads) <= TOL
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * 2, num_microbatches=3)
    engine.install()
    try:
        with torch.no_grad():  # forward stages only; the aux loss from the per-call flag
            got = model(**batch, output_router_logits=True)
            want = ref(**batch, output_router_logits=True)
    finally:
        engine.close()
    assert torch.allclose(got.logits, want.logits, atol=TOL)
    assert abs(got.loss.item() - want.loss.item()) <= TOL and abs(got.aux_loss.item() - want.aux_loss.item()) <= TOL


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_moe_parity_with_default_strategy(kind):
    """Lightning: three steps with accumulation and clipping end with the default strategy's parameters."""
    common = dict(max_steps=2, accumulate_grad_batches=2, gradient_clip_val=0.5)
    ref = fit_params(lambda: CausalLMModule(tiny_moe(kind)), TokenData(n=28), **common)
    got = fit_params(lambda: CausalLMModule(tiny_moe(kind)), TokenData(n=28), devices=3, **common,
                     strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3))
    diff = max_diff(ref, got)
    print(f"fit parity {kind} devices=3 microbatches=3: max abs diff {diff:.2e}")
    assert diff <= TOL


# ---------------------------------------------------------------------------------------------- replay
def _near_tie(model, batch):
    """Make the first MoE router's k-th and (k+1)-th choice of one token so close that a 1-ulp
    increase of the router input swaps them (checked with the router itself).

    Returns the router. Raises AssertionError when no such weights are found.
    """
    router = model.model.layers[0].mlp.gate
    captured = {}
    handle = router.register_forward_pre_hook(lambda module, args: captured.setdefault("x", args[0].detach().clone()))
    with torch.no_grad():
        model(**batch)
    handle.remove()
    x = captured["x"]
    x_up = torch.nextafter(x, torch.full_like(x, math.inf))
    k = router.top_k
    with torch.no_grad():
        logits = torch.nn.functional.linear(x, router.weight)
        weight0 = router.weight.clone()
        for token in range(x.shape[0]):
            order = logits[token].argsort(descending=True)
            a, b = int(order[k - 1]), int(order[k])
            direction = x[token] / x[token].dot(x[token])
            gap = float(logits[token, a] - logits[token, b])
            step = abs(float(logits[token, a])) * 2.0**-26
            for j in range(-64, 65):
                router.weight.copy_(weight0)
                router.weight[b] += (gap + j * step) * direction
                before = set(router(x)[2][token].tolist())
                after = set(router(x_up)[2][token].tolist())
                if before != after:
                    return router
        router.weight.copy_(weight0)
    raise AssertionError("test setup: found no near-tie that a 1-ulp perturbation flips")


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "fresh-top-k"])
def test_routing_replay_under_1ulp_perturbed_recompute(replay, monkeypatch):
    """In recomputation the first router's input is increased by 1 ulp. With replay the gradients
    equal the no-recompute reference; with a fresh top-k the perturbation sends a token to another
    expert (counted in the hook) and the gradients differ, so the test can fail."""
    model = tiny_moe("qwen3_moe")
    batch = _batch()
    router = _near_tie(model, batch)
    ref = copy.deepcopy(model)
    _, ref_grads = _reference(ref, batch)
    flips = []

    def perturb(module, args):
        scope = routing.current()
        if scope is None or not scope.recompute:
            return None
        x = args[0]
        x_up = torch.nextafter(x, torch.full_like(x, math.inf))
        with torch.no_grad():
            fresh = torch.topk(torch.softmax(torch.nn.functional.linear(x_up, module.weight), -1, dtype=torch.float),
                               module.top_k).indices.sort(-1).values
            chosen = torch.topk(torch.softmax(torch.nn.functional.linear(x, module.weight), -1, dtype=torch.float),
                                module.top_k).indices.sort(-1).values
        # kept as a tensor (a host copy): `int()` here, inside the device op, is a host sync the checking mode refuses
        flips.append(op_check.host_copy((fresh != chosen).any(-1).sum()))
        return (x_up,)

    handle = router.register_forward_pre_hook(perturb)
    monkeypatch.setattr(routing, "REPLAY_ROUTING", replay)
    try:
        _, grads = _step(model, batch, devices=2, num_microbatches=1)
    finally:
        handle.remove()
    diff = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)
    flips = [int(f) for f in flips]
    print(f"routing replay={replay}: tokens a fresh top-k sends elsewhere {sum(flips)}, max abs grad diff {diff:.2e}")
    assert flips and sum(flips) >= 1  # the perturbation does change a fresh top-k
    if replay:
        assert diff <= TOL
    else:
        assert diff > 10 * TOL
