"""Adapters: every supported family pipelines to the same outputs and gradients as its own forward."""

import copy

import pytest
import torch
from torch import nn

from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
from _helpers import TokenData, VOCAB


def _tiny(kind: str) -> nn.Module:
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=kind != "mistral")
    cfgs = {
        "llama": lambda: tf.LlamaConfig(**common),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(head_dim=8, **common),
        "mistral": lambda: tf.MistralConfig(sliding_window=4, **common),
    }
    cfg = cfgs[kind]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_family_forward_and_grads(kind, fused):
    model = _tiny(kind)
    ref = copy.deepcopy(model)
    data = TokenData(n=5)
    batch = {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}
    seq = make_layer_sequence(model)
    assert len(seq) == model.config.num_hidden_layers + 2 and seq.family == kind
    engine = RoundPipeEngine(seq, [torch.device("cpu")] * 2, num_microbatches=3, fused_loss=fused)
    engine.install()
    try:
        out = model(**batch)
        expected = ref(**batch)
        if fused:  # logits never leave the device on the fused path; reading them explains why
            assert list(out.keys()) == ["loss"] and not hasattr(out, "logits")
            with pytest.raises(AttributeError, match=r"RoundPipeStrategy\(fused_loss=False\)"):
                out.logits
        else:
            assert torch.allclose(out.logits, expected.logits, atol=1e-5)
        assert torch.allclose(out.loss, expected.loss, atol=1e-6)
        (out.loss * 2).backward()  # any use of the scalar: gradients are linear in the seed
        (expected.loss * 2).backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), n
        with torch.no_grad():  # evaluation: forward stages only
            assert torch.allclose(model(input_ids=data.ids).logits, ref(input_ids=data.ids).logits, atol=1e-5)
    finally:
        engine.close()
    assert "forward" not in model.__dict__  # uninstalled


def test_logits_gradient_path():
    """A loss computed by the user from the logits (no labels) flows back through every stage."""
    model = _tiny("llama")
    ref = copy.deepcopy(model)
    ids = TokenData(n=4).ids
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * 3, num_microbatches=4)
    engine.install()
    try:
        model(input_ids=ids).logits.pow(2).mean().backward()
        ref(input_ids=ids).logits.pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6)
    finally:
        engine.close()


def test_peft_wrapped_model_is_unwrapped():
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(_tiny("qwen3"), LoraConfig(r=2, target_modules=["q_proj"]))
    seq = make_layer_sequence(peft_model)
    assert seq.family == "qwen3"
    assert any("lora_A" in n for n, _ in seq.layers[1].named_parameters())


def test_unsupported_inputs_with_gradients_are_rejected():
    model = _tiny("llama")
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")], num_microbatches=2)
    engine.install()
    try:
        with pytest.raises(ValueError, match=r"inputs_embeds.*un-pipelined on the host.*HINT"):
            model(inputs_embeds=torch.zeros(2, 3, 32))
        with pytest.raises(ValueError, match="use_cache"):
            model(input_ids=torch.zeros(2, 3, dtype=torch.long), use_cache=True)
    finally:
        engine.close()


def test_unsupported_model_error_names_families():
    with pytest.raises(TypeError, match=r"llama.*qwen3.*nn\.Sequential"):
        make_layer_sequence(nn.Linear(3, 3))


@pytest.mark.parametrize("kwargs", [dict(output_hidden_states=True), dict(logits_to_keep=1), dict(output_attentions=True),
                                    dict(use_cache=True)])
def test_arguments_the_pipeline_does_not_run_go_to_the_host(kwargs):
    """With gradients they are refused (no pipelined backward); without, the model's own forward runs
    on the host and returns what the plain model returns."""
    model = _tiny("llama")
    ref = copy.deepcopy(model)
    ids = TokenData(n=2).ids
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")], num_microbatches=2)
    engine.install()
    try:
        with pytest.raises(ValueError, match="un-pipelined on the host"):
            model(input_ids=ids, **kwargs)
        with torch.no_grad():
            got, expected = model(input_ids=ids, **kwargs), ref(input_ids=ids, **kwargs)
        assert list(got.keys()) == list(expected.keys())
        assert torch.equal(got.logits, expected.logits)
        for key in ("hidden_states", "attentions"):
            if key in expected:
                assert all(torch.equal(a, b) for a, b in zip(got[key], expected[key]))
        # the same arguments at their defaults are pipelined
        model(input_ids=ids, use_cache=False, output_hidden_states=False, logits_to_keep=0)
        assert engine.pop_timelines()
    finally:
        engine.close()


def test_hf_gradient_checkpointing_is_turned_off():
    model = _tiny("qwen3")
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match="gradient checkpointing"):
        make_layer_sequence(model)
    assert not model.is_activation_checkpointing


def test_none_arguments_are_ignored():
    """PEFT's forward passes `inputs_embeds=None`, `output_attentions=None`... explicitly."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(_tiny("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    engine = RoundPipeEngine(make_layer_sequence(peft_model), [torch.device("cpu")], num_microbatches=2)
    engine.install()
    try:
        ids = torch.zeros(2, 3, dtype=torch.long)
        assert peft_model(input_ids=ids, inputs_embeds=None, past_key_values=None).logits.shape == (2, 3, VOCAB)
    finally:
        engine.close()
