"""`generate()` (with its KV cache) under RoundPipe: in `validation_step`, in a callback, after `fit`.

Generation runs un-pipelined on the host (the model's own forward on the CPU master weights). Oracles:
the default Lightning strategy on the same module (same weights before training, weights within the
parity tolerance after it), and plain transformers `generate` on the weights RoundPipe held at the
call (the same forward on the same tensors; last bits may differ with torch's CPU thread settings).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from lightning.pytorch import Callback
from peft import LoraConfig, get_peft_model

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, loader, tiny_hf, trainer

PROMPT = 4
NEW_TOKENS = 5


def _generate(model, input_ids: torch.Tensor, sample: bool):
    """Greedy, or top-k sampling from a fixed seed; the scores (logits per new token) come back too."""
    prompt = input_ids[:, :PROMPT]
    kwargs = dict(do_sample=True, top_k=20, temperature=0.9) if sample else dict(do_sample=False)
    if sample:
        torch.manual_seed(1234)
    return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, use_cache=True, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True, **kwargs)


class GenerateModule(CausalLMModule):
    """Generates in `validation_step` (greedy and sampled), then logs the validation loss."""

    def __init__(self, model, lr: float = 0.1) -> None:
        super().__init__(model, lr=lr)
        self.generated: list[tuple] = []

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        for sample in (False, True):
            out = _generate(self.model, batch["input_ids"], sample)
            self.generated.append((out.sequences, torch.stack(out.scores)))
        super().validation_step(batch, batch_idx)


def _lora(model):
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights="gaussian"))


def _run(make_model, strategy, devices: int) -> GenerateModule:
    """validate (generation on the initial weights), fit 3 steps, then the epoch-end validation."""
    module = GenerateModule(make_model())
    t = trainer(strategy, devices, max_epochs=1, limit_train_batches=3, limit_val_batches=1)
    t.validate(module, loader(TokenData(n=14, seed=5)), verbose=False)
    t.fit(module, loader(TokenData()), loader(TokenData(n=14, seed=5)))
    return module


@pytest.mark.parametrize("make_model", [lambda: tiny_hf("llama"), lambda: _lora(tiny_hf("llama"))], ids=["llama", "lora"])
def test_generate_in_validation_step_matches_the_default_strategy(make_model):
    ref = _run(make_model, "auto", 1)
    got = _run(make_model, lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), 2)
    assert len(got.generated) == len(ref.generated) == 4  # (greedy, sampled) before and after fit
    for (seq_ref, scores_ref), (seq_got, scores_got) in zip(ref.generated, got.generated):
        assert seq_got.shape == (7, PROMPT + NEW_TOKENS)
        assert torch.equal(seq_got, seq_ref)
        assert torch.allclose(scores_got, scores_ref, atol=1e-4)
    # before training both generate from the same weights (CPU matmuls may differ in the last bits:
    # the CPU virtual devices' compute threads change torch's thread settings)
    for k in (0, 1):
        assert torch.allclose(got.generated[k][1], ref.generated[k][1], atol=1e-6)
    # the samples are not the greedy tokens (the sampled case tests something)
    assert not torch.equal(got.generated[0][0], got.generated[1][0])


class GenerateAfterStep(Callback):
    """In `on_train_batch_end`: generate, then record the weights the pipeline holds once the
    optimizer step in flight (async) has landed."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, dict]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scores = torch.stack(_generate(pl_module.model, batch["input_ids"], sample=False).scores)
        trainer.strategy.wait_for_optimizer()
        self.seen.append((scores, {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}))


class SlowSGD(torch.optim.SGD):
    """SGD that sleeps before its update: a read that does not wait for the step in flight sees the old weights."""

    def step(self, closure=None):
        time.sleep(0.2)
        return super().step(closure)


class SlowModule(CausalLMModule):
    def configure_optimizers(self):
        return SlowSGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


@pytest.mark.parametrize("optimizer", ["sync", "async"])
def test_generate_in_a_callback_uses_the_current_weights(optimizer):
    module = SlowModule(tiny_hf("llama"), lr=0.5)
    callback = GenerateAfterStep()
    t = trainer(lightning_roundpipe.RoundPipeStrategy(optimizer=optimizer), 2, max_steps=3, callbacks=[callback])
    t.fit(module, loader(TokenData()))
    assert len(callback.seen) == 3
    oracle = copy.deepcopy(module.model)  # after fit: the model's own forward again (the engine is closed)
    first = next(iter(loader(TokenData())))
    for step, (scores, weights) in enumerate(callback.seen):
        oracle.load_state_dict(weights)
        batch = first if step == 0 else list(loader(TokenData()))[step]
        expected = torch.stack(_generate(oracle, batch["input_ids"], sample=False).scores)
        assert torch.allclose(scores, expected, atol=1e-6), (step, (scores - expected).abs().max())
    # the weights change between steps far more than that: generating on stale weights would fail above
    finite = torch.isfinite(callback.seen[0][0])
    assert (callback.seen[1][0] - callback.seen[0][0])[finite].abs().max() > 1e-3


def test_generate_after_fit_and_a_kv_cache_call_in_no_grad():
    module = CausalLMModule(tiny_hf("llama"))
    t = trainer(lightning_roundpipe.RoundPipeStrategy(), 2, max_steps=2)
    t.fit(module, loader(TokenData()))
    oracle = copy.deepcopy(module.model)
    ids = TokenData().ids[:3]
    assert torch.equal(_generate(module.model, ids, False).sequences, _generate(oracle, ids, False).sequences)


def test_kv_cache_call_with_gradients_is_explained():
    """A forward with `use_cache=True` inside `training_step` (grad on) is refused with a hint."""

    class CacheInTraining(CausalLMModule):
        def training_step(self, batch, batch_idx):
            return self.model(**batch, use_cache=True).loss

    with pytest.raises(ValueError, match=r"use_cache.*un-pipelined on the host.*HINT: call it under `torch.no_grad\(\)`"):
        trainer(lightning_roundpipe.RoundPipeStrategy(), 2, max_steps=1).fit(CacheInTraining(tiny_hf()), loader(TokenData()))
