"""CUDA path (marked `gpu`, skipped without a GPU): run by `scripts/gpu_check.sh` on a GPU machine."""

import pytest
import torch

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, fit_params, max_diff, tiny_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _devices() -> int:
    return min(2, torch.cuda.device_count())


def test_cuda_parity_fp32():
    kw = dict(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), **kw)  # CPU reference
    got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(),
                     strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), accelerator="cuda",
                     devices=_devices(), **kw)
    assert max_diff(ref, got) <= 1e-4  # CUDA vs CPU kernels differ slightly
    assert all(p.device.type == "cpu" for p in got.values())


def test_cuda_bf16_mixed_trains():
    module = CausalLMModule(tiny_hf("qwen3"))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    from _helpers import loader, trainer

    t = trainer("roundpipe", devices=_devices(), accelerator="cuda", precision="bf16-mixed", max_steps=3)
    t.fit(module, loader(TokenData()))
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in module.parameters())
    assert any(not torch.equal(before[n], p) for n, p in module.named_parameters())
