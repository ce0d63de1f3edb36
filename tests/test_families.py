"""More decoder families as data (issue 10 item 3): Gemma 2, Gemma 3, Phi-3, OLMo 2, Granite and the
generic entry give the model's own loss, logits and gradients on tiny random configs (fp32); a model
the adapters cannot pipeline gets an error naming what is missing."""

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
from _helpers import TokenData, VOCAB, tiny_family_model

TOL = 1e-5


def tiny_family(kind: str) -> nn.Module:
    """Tiny random configs that switch each family's peculiarity on (soft-capping, sliding windows,
    the multipliers) at values where it changes the outputs: 3 layers, eager attention."""
    return tiny_family_model(kind, attention="eager", layers=3)


FAMILY_CASES = [("gemma2", 2, 3, True), ("gemma3_text", 3, 3, True), ("phi3", 2, 3, False), ("olmo2", 1, 1, True),
                ("granite", 3, 2, False), ("olmo", 2, 3, True)]


@pytest.mark.parametrize("kind,devices,num_microbatches,fused", FAMILY_CASES)
def test_family_parity_with_own_forward(kind, devices, num_microbatches, fused, record_property):
    model = tiny_family(kind)
    ref = copy.deepcopy(model)
    data = TokenData(n=7)
    batch = {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seq = make_layer_sequence(model)
    generic = any("generic decoder-only entry" in str(w.message) for w in caught)
    assert generic == (kind == "olmo") and seq.family == kind
    engine = RoundPipeEngine(seq, [torch.device("cpu")] * devices, num_microbatches=num_microbatches, fused_loss=fused)
    engine.install()
    try:
        out = model(**batch)
        expected = ref(**batch)
        (out.loss * 2).backward()
        (expected.loss * 2).backward()
        with torch.no_grad():
            logits = model(input_ids=data.ids).logits
            want = ref(input_ids=data.ids).logits
    finally:
        engine.close()
    grads = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    diff = max(grads, abs(out.loss.item() - expected.loss.item()), (logits - want).abs().max().item())
    record_property("max_abs_diff", diff)
    print(f"parity {kind} devices={devices} microbatches={num_microbatches} fused={fused}: max abs diff {diff:.2e}")
    assert diff <= TOL


def test_family_peculiarities_matter():
    """Oracle for the parity above: switching off each peculiarity the adapter implements (the tail's
    soft-capping, the prefix's masks and embedding multiplier, the logits scaling) changes the
    model's own loss. (Attention soft-capping and the residual multiplier live inside HF's layers.)"""
    import transformers as tf

    data = TokenData(n=7)
    batch = {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}
    for kind, attr, off in [("gemma2", "final_logit_softcapping", None),
                            ("gemma3_text", "sliding_window", 64),
                            ("gemma3_text", "rope_parameters", None), ("granite", "embedding_multiplier", 1.0),
                            ("granite", "logits_scaling", 1.0)]:
        model = tiny_family(kind)
        cfg = copy.deepcopy(model.config)
        if attr == "rope_parameters":  # Gemma 3: the local layers' rotary table the same as the global one
            off = {**cfg.rope_parameters, "sliding_attention": dict(cfg.rope_parameters["full_attention"])}
        setattr(cfg, attr, off)
        other = tf.AutoModelForCausalLM.from_config(cfg)
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            change = abs(model(**batch).loss.item() - other(**batch).loss.item())
        print(f"{kind} without {attr}: loss changes by {change:.2e}")
        assert change > 2 * TOL, (kind, attr)  # more than the parity tolerance: a missing piece fails it


def test_unsupported_models_get_a_clear_error():
    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(TypeError, match=r"has no `model\.embed_tokens`, `model\.layers`, `model\.norm`, `model\.rotary_emb`"):
        make_layer_sequence(gpt2)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1))
    del llama.model.norm
    with pytest.raises(TypeError, match=r"has no `model\.norm`"):
        make_layer_sequence(llama)
    mixtral = tf.MixtralForCausalLM(tf.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4))
    with pytest.raises(ValueError, match=r"mixture-of-experts model without a RoundPipe entry.*gpt_oss.*qwen3_moe"):
        make_layer_sequence(mixtral)
    cohere = tf.CohereForCausalLM(tf.CohereConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                                  num_attention_heads=2, num_key_value_heads=1, logit_scale=0.5))
    with pytest.raises(ValueError, match=r"config\.logit_scale"):  # the generic entry would leave the scaling out
        make_layer_sequence(cohere)
    gemma3 = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                                      use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        make_layer_sequence(gemma3)
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        make_layer_sequence(nn.Linear(3, 3))
