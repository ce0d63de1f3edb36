"""Stage boundaries carry only what cannot be rebuilt (DESIGN.md section 4): for Hugging Face
decoders, every carry uploaded to a device at a stage boundary (a forward stage's input, a backward
stage's saved input) holds the hidden states, the 2D attention mask and the position ids (plus the
labels and their count when the call has labels), never an ``O(seq^2)`` mask nor the rotary tables;
each stage rebuilds those on its device, and the results still equal the model's own."""

import copy
import functools

import pytest
import torch

from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.runtime.backends.cpu import CpuBackend
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine

HIDDEN = 32
VOCAB = 64
TOL = 1e-5


def tiny(kind: str, sliding_window: int = 64) -> torch.nn.Module:
    """Tiny random fp32 models with eager attention (a float 4D mask: the largest one to carry)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    cfg = {
        "llama": lambda: tf.LlamaConfig(**common),
        # the window is shorter than the sequences: the sliding mask changes the outputs
        "mistral": lambda: tf.MistralConfig(sliding_window=sliding_window, **common),
        "gemma2": lambda: tf.Gemma2Config(head_dim=8, sliding_window=64, **common,
                                          layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    }[kind]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg)


def capture_uploads(monkeypatch) -> list[dict]:
    """Every decoder-boundary carry the executor uploads: ``{key: (shape, dtype)}`` of its tensors."""
    seen: list[dict] = []
    upload = CpuBackend.to_device

    def to_device(self, tree, publish, *args, **kwargs):
        if isinstance(tree, dict) and "hidden_states" in tree:
            seen.append({k: (tuple(v.shape), v.dtype) for k, v in tree.items() if isinstance(v, torch.Tensor)})
            assert not any(isinstance(v, (dict, tuple, list)) for v in tree.values()), sorted(tree)
        return upload(self, tree, publish, *args, **kwargs)

    monkeypatch.setattr(CpuBackend, "to_device", to_device)
    return seen


def nbytes(spec: dict) -> int:
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in spec.values())


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("seq", [512, 2048])
def test_boundary_carries_hidden_states_mask_and_positions_only(kind, seq, monkeypatch):
    if kind == "gemma2" and seq == 2048:
        pytest.skip("one sliding-window family at 2048 (mistral) is enough for the O(seq^2) check")
    model = tiny(kind)
    ref = copy.deepcopy(model)
    batch, microbatches = 2, 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 5:] = 0  # padding: the 4D mask is not the plain causal one
    labels = ids.masked_fill(mask == 0, -100)
    seq_obj = make_layer_sequence(model)
    engine = RoundPipeEngine(seq_obj, [torch.device("cpu")] * 2, num_microbatches=microbatches)
    engine.install()
    seen = capture_uploads(monkeypatch)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        forward_carries = list(seen)
        seen.clear()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        train_carries = list(seen)
    finally:
        engine.close()

    # oracle from shapes: per microbatch of `rows` rows
    rows = batch // microbatches
    hidden_b = rows * seq * HIDDEN * 4  # fp32 hidden states
    mask_b = rows * seq * 8  # the int64 2D mask as given
    pos_b = 1 * seq * 8  # int64 position ids (1, seq), made by the prefix
    labels_b = rows * seq * 8 + 8  # int64 labels and their int64 count (num_items_in_batch)
    want_forward = {"hidden_states": ((rows, seq, HIDDEN), torch.float32), "attention_mask": ((rows, seq), torch.int64),
                    "position_ids": ((1, seq), torch.int64)}
    want_train = {**want_forward, "labels": ((rows, seq), torch.int64), "num_items_in_batch": ((), torch.int64)}
    # forward: 2 forward stages (layers 0-2, 3-4): one decoder boundary hop per microbatch
    assert forward_carries and all(c == want_forward for c in forward_carries), forward_carries[:1]
    # training: that hop, and every backward stage's saved input (layers 1..4: one per layer)
    assert len(train_carries) == microbatches * (1 + 4), len(train_carries)
    assert all(c == want_train for c in train_carries), train_carries[:1]
    per_hop = nbytes(forward_carries[0])
    assert per_hop == hidden_b + mask_b + pos_b
    assert nbytes(train_carries[0]) == hidden_b + mask_b + pos_b + labels_b
    # no O(seq^2) entry: the biggest is the hidden states (rows * seq * hidden elements, hidden < seq)
    assert max(torch.Size(s).numel() for c in train_carries for s, _ in c.values()) == rows * seq * HIDDEN
    # the adapter's own count of a boundary, all microbatches together
    assert seq_obj.boundary_bytes({"input_ids": ids, "attention_mask": mask}, torch.float32, microbatches) == \
        microbatches * (hidden_b + mask_b + pos_b)
    assert seq_obj.boundary_bytes({"input_ids": ids, "attention_mask": mask, "labels": labels}, torch.float32,
                                  microbatches) == microbatches * (hidden_b + mask_b + pos_b + labels_b)
    print(f"{kind} seq={seq}: {per_hop} bytes per microbatch per hop (hidden states {hidden_b})")

    # the masks and rotary tables each stage rebuilt are the model's own
    with torch.no_grad():
        want_logits = ref(input_ids=ids, attention_mask=mask).logits
    want_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    want_loss.backward()
    assert (logits - want_logits).abs().max().item() <= TOL
    assert abs(loss.item() - want_loss.item()) <= TOL
    grads = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert grads <= TOL


def test_each_stage_builds_the_mask_once(monkeypatch):
    """The 4D mask is built on each stage's device by its first decoder layer, once per stage and
    microbatch: not once per layer, and not once for all stages (then it would have to cross)."""
    from transformers import masking_utils

    model = tiny("llama")
    calls = []
    build = masking_utils.create_causal_mask

    @functools.wraps(build)  # the adapter passes the arguments its signature has
    def counting(*args, **kwargs):
        calls.append(kwargs["inputs_embeds"].shape)
        return build(*args, **kwargs)

    monkeypatch.setattr(masking_utils, "create_causal_mask", counting)
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * 2, num_microbatches=3)
    engine.install()
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(0, VOCAB, (3, 16)))
    finally:
        engine.close()
    # forward stages: layers 0-2 (decoders 1, 2: one build), layers 3-4 (decoder 3: one build)
    assert len(calls) == 2 * 3, calls


def test_derived_entries_follow_the_carried_ones():
    """A caller's ``position_ids`` tensor used again with another attention mask (or dtype) gets
    masks rebuilt from that mask, not the ones kept from the first call."""
    model = tiny("mistral")
    seq_obj = make_layer_sequence(model)
    ids = torch.randint(0, VOCAB, (2, 96), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(96).unsqueeze(0).expand(2, 96)
    full = torch.ones(2, 96, dtype=torch.long)
    padded = full.clone()
    padded[0, 80:] = 0

    def run(mask):
        carry = seq_obj.prepare((), {"input_ids": ids, "attention_mask": mask, "position_ids": pos})
        for layer in seq_obj.layers:
            carry = layer(carry)
        return carry["logits"]

    with torch.no_grad():
        for mask in (full, padded, full):
            want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            assert (run(mask) - want).abs().max().item() <= TOL
        padded[0, 40:] = 0  # the same mask tensor changed in place
        want = model(input_ids=ids, attention_mask=padded, position_ids=pos).logits
        assert (run(padded) - want).abs().max().item() <= TOL
        # another model (the same weights, a shorter window: other masks) given the same tensors,
        # on which the first model has just kept its masks
        other = tiny("mistral", sliding_window=16)
        other_seq = make_layer_sequence(other)
        carry = other_seq.prepare((), {"input_ids": ids, "attention_mask": padded, "position_ids": pos})
        for layer in other_seq.layers:
            carry = layer(carry)
        want = other(input_ids=ids, attention_mask=padded, position_ids=pos).logits
        assert (want - model(input_ids=ids, attention_mask=padded, position_ids=pos).logits).abs().max() > 2 * TOL
        assert (carry["logits"] - want).abs().max().item() <= TOL


def test_moe_boundary_adds_only_the_load_balancing_scalar(monkeypatch):
    """GPT-OSS (sliding and full layers, mixture of experts, the load-balancing loss on): the carry
    adds the differentiable fp32 scalar ``router_aux`` (the only other entry with a gradient); the
    token mask the aux loss reads is the carried 2D mask, not a second copy."""
    import transformers as tf

    cfg = tf.GptOssConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, intermediate_size=16,
                          num_local_experts=8, num_experts_per_tok=2, sliding_window=64, output_router_logits=True,
                          router_aux_loss_coef=0.1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    ref = copy.deepcopy(model)
    seq, rows = 512, 1
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[0, seq - 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    seq_obj = make_layer_sequence(model)
    assert seq_obj.grad_keys == ("hidden_states", "router_aux")
    engine = RoundPipeEngine(seq_obj, [torch.device("cpu")] * 2, num_microbatches=2)
    engine.install()
    seen = capture_uploads(monkeypatch)
    try:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    finally:
        engine.close()
    want = {"hidden_states": ((rows, seq, HIDDEN), torch.float32), "attention_mask": ((rows, seq), torch.int64),
            "position_ids": ((1, seq), torch.int64), "labels": ((rows, seq), torch.int64),
            "num_items_in_batch": ((), torch.int64), "router_aux": ((), torch.float32)}
    assert seen and all(c == want for c in seen), seen[:1]
    assert nbytes(seen[0]) == rows * seq * (HIDDEN * 4 + 8 + 8) + seq * 8 + 8 + 4
    assert abs(loss.item() - ref(input_ids=ids, attention_mask=mask, labels=labels).loss.item()) <= TOL


def test_derived_entries_under_inference_mode():
    """Tensors made under ``torch.inference_mode`` (Lightning's validation) have no version counter."""
    model = tiny("gemma2")
    seq_obj = make_layer_sequence(model)
    ids = torch.randint(0, VOCAB, (2, 80), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        carry = seq_obj.prepare((), {"input_ids": ids})
        for layer in seq_obj.layers:
            carry = layer(carry)
        want = model(input_ids=ids).logits
    assert (carry["logits"] - want).abs().max().item() <= TOL
