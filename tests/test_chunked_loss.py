"""Chunked LM head + loss (issue 10, item 2): equal to transformers' ForCausalLMLoss on the full logits."""

import copy

import pytest
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.adapters.chunked_loss import chunked_causal_lm_loss, default_chunk_tokens, loss_only
from lightning_roundpipe.adapters.hf_causal_lm import HFTail
from lightning_roundpipe.partition.costmodel import CostModel, ModelShape
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
from _helpers import TokenData, tiny_hf

V, H = 97, 16


def _case(seed=0, batch=3, seq=11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, H, generator=g, dtype=torch.float64).float().requires_grad_()
    head = nn.Linear(H, V, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 2)  # large logits: a real test of the reduction
        head.bias.copy_(torch.randn(V, generator=g))
    labels = torch.randint(0, V, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < 0.3] = -100  # ignored positions
    labels[1, :] = -100  # a row without any label
    return hidden, head, labels


def _grads(loss, hidden, head):
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    loss.backward()
    return [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]


@pytest.mark.parametrize("chunk", [1, 4, 7, 33, 1000])
@pytest.mark.parametrize("num_items", [None, 17])
def test_equals_hf_loss_and_gradients(chunk, num_items):
    hidden, head, labels = _case()
    n = None if num_items is None else torch.tensor(num_items)
    expected = ForCausalLMLoss(head(hidden), labels, V, num_items_in_batch=n)
    expected_grads = _grads(expected, hidden, head)
    loss = chunked_causal_lm_loss(hidden, head, labels, n, chunk_tokens=chunk)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - expected.item()) <= 1e-6 * max(1.0, abs(expected.item()))
    for got, want in zip(_grads(loss, hidden, head), expected_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_softcap_and_scale_per_chunk():
    hidden, head, labels = _case(seed=3)
    tail = HFTail(nn.Identity(), head, ForCausalLMLoss, V, logit_softcap=5.0, logits_scale=2.0, loss_chunk_tokens=4)
    carry = {"hidden_states": hidden, "labels": labels, "num_items_in_batch": (labels[..., 1:] != -100).sum()}
    reference = 5.0 * torch.tanh(head(hidden) / 2.0 / 5.0)  # Granite's divide, Gemma 2's cap, on the full logits
    expected = ForCausalLMLoss(reference, labels, V, num_items_in_batch=carry["num_items_in_batch"])
    full = tail(carry)  # outside the fused tail: full logits, the model's own loss
    torch.testing.assert_close(full["logits"], reference)
    with loss_only():
        out = tail(carry)
    assert "logits" not in out
    assert abs(out["loss"].item() - expected.item()) <= 1e-6
    torch.testing.assert_close(_grads(out["loss"], hidden, head), _grads(expected, hidden, head), atol=1e-6, rtol=1e-5)


def test_bad_arguments():
    hidden, head, labels = _case()
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_causal_lm_loss(hidden, head, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="labels"):
        chunked_causal_lm_loss(hidden, head, labels[:, 1:], chunk_tokens=2)
    with pytest.raises(ValueError, match="logit_softcap"):
        HFTail(nn.Identity(), head, ForCausalLMLoss, V, logit_softcap=0.0)
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        HFTail(nn.Identity(), head, ForCausalLMLoss, V, loss_chunk_tokens=-1)


def test_default_chunk_is_256_mib_of_logits():
    assert default_chunk_tokens(49152, 4) == 256 * 2**20 // (49152 * 4) == 1365
    assert default_chunk_tokens(151936, 2) == 883
    assert default_chunk_tokens(10**9, 4) == 1


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.filterwarnings("ignore::UserWarning:peft")
def test_fused_path_with_chunks_matches_plain_model(lora, monkeypatch):
    """Tied embedding (tiny Llama ties), chunks of 3 tokens across microbatches: loss and every
    gradient equal the plain model's loss.backward() (also with a LoRA-wrapped LM head)."""
    from lightning_roundpipe.adapters import chunked_loss

    calls = []
    real = chunked_loss.chunked_causal_lm_loss
    monkeypatch.setattr(chunked_loss, "chunked_causal_lm_loss", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = tiny_hf("llama", layers=2)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "lm_head"], lora_dropout=0.0))
        for name, p in model.named_parameters():  # a trained adapter: B != 0
            if "lora_B" in name:
                nn.init.normal_(p, std=0.1)
    ref = copy.deepcopy(model)
    data = TokenData(n=5)
    batch = {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}
    seq = make_layer_sequence(model)
    seq.layers[-1].loss_chunk_tokens = 3
    engine = RoundPipeEngine(seq, [torch.device("cpu")] * 2, num_microbatches=2)
    engine.install()
    try:
        out = model(**batch)
        assert not hasattr(out, "logits")  # the fused path: the loss only (FusedCausalLMOutput)
        assert len(calls) == 2 and all(k["chunk_tokens"] == 3 for k in calls)  # the fused tail took the chunked path
        expected = ref(**batch)
        assert abs(out.loss.item() - expected.loss.item()) <= 1e-6
        out.loss.backward()
        expected.loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    finally:
        engine.close()


def test_cost_model_tail_memory_is_the_chunk():
    """Tail memory: logits of one chunk (not batch * seq * vocab) beyond the chunk size."""
    shape = ModelShape.from_config(dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=49152))
    cm, unchunked = CostModel(), CostModel(loss_chunk_bytes=None)

    def tail(model, seq):
        return model.layer_costs(shape, seq_len=seq, microbatch_size=1, compute_dtype_bytes=4)[-1].saved_activation_bytes

    per_logit, chunk = 8, 1365  # ChunkCrossEntropy: fp32 logits + fp32 gradient
    assert tail(cm, 8192) - tail(cm, 2048) == 2 * (8192 - 2048) * 64 * 4  # only the hidden states grow
    assert tail(cm, 8192) == 2 * 8192 * 64 * 4 + chunk * 49152 * per_logit
    assert tail(unchunked, 8192) == 2 * 8192 * 64 * 4 + 8192 * 49152 * per_logit
    assert tail(cm, 256) == tail(unchunked, 256)  # one chunk holds the whole sequence


def test_one_chunk_runs_the_lm_head_once_several_chunks_recompute():
    """The fused tail's point is that the LM head is never recomputed: when one chunk holds every token
    the head runs once (forward + backward); with several chunks each chunk's logits are recomputed."""
    from lightning_roundpipe.adapters.chunked_loss import chunked_causal_lm_loss

    torch.manual_seed(0)
    head = nn.Linear(8, 11)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    calls = []

    def logits_fn(h):
        calls.append(h.shape[0])
        return head(h)

    for chunk, expected_calls in ((10, 1), (1000, 1), (4, 2 * 3)):  # 10 tokens: 1 chunk, 1 chunk, 3 chunks x 2
        calls.clear()
        loss = chunked_causal_lm_loss(hidden, logits_fn, labels, chunk_tokens=chunk)
        loss.backward()
        assert len(calls) == expected_calls, (chunk, calls)
