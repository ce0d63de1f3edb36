"""Recomputation replays the forward's dropout masks exactly, whichever device runs the stage."""

import pytest
import torch
from torch import nn

import lightning_roundpipe
from _helpers import CausalLMModule, MLPModule, TokenData, VectorData, fit_params, max_diff, tiny_hf


class MaskRecorder(nn.Module):
    """Dropout that records (grad enabled?, mask) of every call, in call order."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p)
        self.calls: list = []

    def forward(self, x):
        out = self.dropout(torch.ones_like(x))
        self.calls.append((torch.is_grad_enabled(), out != 0))
        return x * out


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_recompute_replays_forward_masks(devices):
    recorders = []

    class Module(MLPModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = nn.Sequential(nn.Linear(8, 16), MaskRecorder(), nn.Linear(16, 4), MaskRecorder(0.3))
            recorders.extend([self.model[1], self.model[3]])

    strategy = lightning_roundpipe.RoundPipeStrategy(
        num_microbatches=4, forward_stages=[(0, 4)], backward_stages=[(3, 4), (2, 3), (1, 2), (0, 1)])
    fit_params(Module, VectorData(), strategy=strategy, devices=devices, max_steps=2)
    for rec in recorders:
        # per step: 4 forwards (no grad), then the 4 recomputations (grad) of the same microbatches
        assert [g for g, _ in rec.calls] == ([False] * 4 + [True] * 4) * 2
        for step in range(2):
            calls = rec.calls[step * 8:(step + 1) * 8]
            for mb in range(4):
                assert torch.equal(calls[mb][1], calls[4 + mb][1])
            assert not torch.equal(calls[0][1][:1], calls[1][1][:1])  # masks differ between microbatches


def test_dropout_run_independent_of_device_count():
    results = [fit_params(lambda: MLPModule(dropout=0.3), VectorData(),
                          strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), devices=d, max_steps=3)
               for d in (1, 2, 3)]
    assert max_diff(results[0], results[1]) == 0.0
    assert max_diff(results[0], results[2]) == 0.0
    no_dropout = fit_params(lambda: MLPModule(dropout=0.0), VectorData(),
                            strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), devices=2, max_steps=3)
    diffs = [(a - b).abs().max().item() for a, b in zip(results[0].values(), no_dropout.values())]
    assert max(diffs) > 1e-4  # dropout was active


def test_hf_attention_dropout_independent_of_device_count():
    results = [fit_params(lambda: CausalLMModule(tiny_hf("llama", dropout=0.2)), TokenData(),
                          strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), devices=d, max_steps=2)
               for d in (1, 3)]
    assert max_diff(results[0], results[1]) <= 1e-6
