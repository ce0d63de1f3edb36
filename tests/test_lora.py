"""PEFT LoRA: only adapter weights change, the frozen base is bitwise unchanged, parity holds."""

import pytest
from peft import LoraConfig, get_peft_model

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, fit_params, max_diff, params, tiny_hf


def _lora_module():
    model = get_peft_model(tiny_hf("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        lora_dropout=0.0, init_lora_weights="gaussian"))
    return CausalLMModule(model, lr=0.5)


@pytest.mark.parametrize("devices,num_microbatches", [(1, 2), (2, 5), (3, 3)])
def test_lora_parity_and_frozen_base(devices, num_microbatches):
    before = params(_lora_module())
    ref = fit_params(_lora_module, TokenData(), max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
    got = fit_params(_lora_module, TokenData(), strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=num_microbatches),
                     devices=devices, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
    assert max_diff(ref, got) <= 1e-5
    lora = [k for k in got if "lora_" in k]
    base = [k for k in got if "lora_" not in k]
    assert lora and base
    assert all((got[k] == before[k]).all() for k in base)  # frozen base bitwise unchanged
    assert all(not (got[k] == before[k]).all() for k in lora)  # every adapter trained
