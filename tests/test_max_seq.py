"""Device memory budget on CPU virtual devices and `roundpipe max-seq` (issue 10, item 5)."""

from __future__ import annotations

import argparse
import copy
import gc

import pytest
import torch

from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.cli import main
from lightning_roundpipe.cli.max_seq_cmd import make_report
from lightning_roundpipe.recipes.smollm2 import tiny_smollm2
from lightning_roundpipe.runtime.backends.budget import DeviceMemoryError
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
from lightning_roundpipe.runtime.tuning.max_seq import causal_lm_step, measure_max_seq_len

MiB = 2**20


def _engine(model, budget, devices=2, microbatches=2):
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * devices, microbatches,
                             device_memory_bytes=budget)
    engine.install()
    return engine


def test_bisection_finds_the_threshold():
    """A fake step that runs out of memory above 1000 tokens: the search lands on 1000 exactly."""

    def step(seq_len):
        if seq_len > 1000:
            raise torch.OutOfMemoryError("too long")

    r = measure_max_seq_len(step, start=3, limit=10**6, collect=False)
    assert r.max_seq_len == 1000 and r.first_failing == 1001 and r.error == "too long"
    assert measure_max_seq_len(step, start=2000, collect=False).max_seq_len == 0
    assert measure_max_seq_len(lambda s: None, start=4, limit=100, collect=False).max_seq_len == 100
    with pytest.raises(ValueError, match="limit"):
        measure_max_seq_len(step, start=10, limit=5)


def test_weights_over_budget_fail_before_allocation():
    """The tail's LM head (49152 x 64 fp32 = 12 MiB) cannot fit 8 MiB: the LOAD of its stage raises."""
    model = tiny_smollm2()
    engine = _engine(model, 8 * MiB)
    try:
        ids = torch.randint(0, 49152, (2, 8))
        with pytest.raises(DeviceMemoryError) as info:
            model(input_ids=ids, labels=ids)
        err = info.value
        assert isinstance(err, torch.OutOfMemoryError) and isinstance(err, RuntimeError)
        assert err.budget_bytes == 8 * MiB and err.asked_bytes >= 49152 * 64 * 4 and "stage" in err.where
        assert "`device_memory_bytes=8388608`" in str(err) and "HINT" in str(err)
        assert all(b.memory.in_use_bytes == 0 for b in engine.backends)
    finally:
        engine.close()


def test_out_of_memory_leaves_nothing_behind_and_the_next_step_is_right():
    """A step that runs out of device memory frees everything; the next, shorter step trains
    exactly like the plain model (oracle: its own loss and gradients)."""
    model = tiny_smollm2()
    ref = copy.deepcopy(model)
    engine = _engine(model, 64 * MiB)
    try:
        long_ids = torch.randint(0, 49152, (2, 256))
        with pytest.raises(DeviceMemoryError, match="ran out of its|does not fit device"):  # the memory model checks first
            model(input_ids=long_ids, labels=long_ids)
        gc.collect()  # the failed step's traceback holds reference cycles
        assert all(b.memory.in_use_bytes == b.pool_bytes for b in engine.backends)
        model.zero_grad(set_to_none=True)
        ids = torch.randint(0, 49152, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        expected = ref(input_ids=ids, labels=ids).loss
        expected.backward()
        assert abs(loss.item() - expected.item()) < 1e-5
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
        # devices hold nothing between steps but their pools (no replica keeps anything else alive)
        assert all(b.memory.in_use_bytes == b.pool_bytes for b in engine.backends)
        assert max(engine.pop_device_memory_peaks()) <= 64 * MiB
    finally:
        engine.close()


def test_max_seq_agrees_with_the_planner_within_20_percent():
    args = argparse.Namespace(tiny=True, model=None, devices=2, accelerator="cpu", device_memory_mib=64.0,
                              microbatches=None, microbatch_size=1, start=16, limit=4096, resolution=8)
    r = make_report(args)
    assert r.measured > 0 and r.first_failing is not None  # the budget was reached
    assert r.measured_peak_bytes <= r.device_memory_bytes
    assert abs(r.planned - r.measured) <= 0.2 * r.measured, r
    assert any(not ran for _, ran in r.trials) and "ran out of its" in r.error


def test_cli_requires_a_budget_on_cpu(capsys):
    assert main(["max-seq", "--tiny", "--devices", "1"]) == 2
    assert "--device-memory-mib" in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [
    (["--model", "/nonexistent", "--device-memory-mib", "96"], "no Hugging Face config at /nonexistent"),
    (["--tiny", "--accelerator", "cuda"], "needs 2 CUDA devices"),
])  # not even the shortest sequence: test_cli_out_of_memory_hint_gives_more_room_per_device
def test_cli_errors_are_explained(argv, match, capsys):
    import torch

    if "cuda" in argv and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    assert main(["max-seq", *argv]) == 2
    assert match in capsys.readouterr().err


def test_strategy_validates_the_budget():
    from lightning_roundpipe import RoundPipeStrategy

    assert RoundPipeStrategy(device_memory_bytes=64 * MiB).device_memory_bytes == 64 * MiB
    for bad in (0, -1):
        with pytest.raises(ValueError, match="device_memory_bytes"):
            RoundPipeStrategy(device_memory_bytes=bad)
    with pytest.raises((TypeError, ValueError), match="device_memory_bytes"):
        RoundPipeStrategy(device_memory_bytes=1.5)


def test_causal_lm_step_resets_gradients():
    model = tiny_smollm2(vocab_size=128)
    causal_lm_step(model, 2, 128)(8)
    assert all(p.grad is None for p in model.parameters())


def test_planner_peak_memory_formula():
    """Round robin on 2 devices: a stage's memory, its weights counted as the device's pool of two slots
    of the largest stage (one slot when every device runs one stage)."""
    from types import SimpleNamespace

    from lightning_roundpipe.partition import LayerProfile, peak_device_memory_bytes

    profiles = [LayerProfile(forward_s=1.0, backward_s=2.0, param_bytes=100 * (i + 1), activation_bytes=10) for i in range(3)]
    mp = SimpleNamespace(profiles=profiles, saved_activation_bytes=(5, 5, 5))
    stages = [("forward", range(0, 2)), ("fused", range(2, 3)), ("backward", range(1, 2)), ("backward", range(0, 1))]
    # largest stage: 300 bytes of weights (forward 0, fused tail), so the pool is 2 x 300 = 600;
    # forward 0: 600 + 20 in/out + 2 microbatches x (output 10 + the boundary it saves at layer 1, 10) = 660;
    # fused tail: 600 + 300 grads + 10 in/out + max(5 saved, 300 fresh grad) + 2 x 10 outgoing gradients = 1230
    # (backward 0 on the tail's device: 600 + 100 + 20 + 100 + 20 + the tail's 300 gradients not yet dropped = 1140)
    assert peak_device_memory_bytes(mp, stages, 2) == 1230
    assert peak_device_memory_bytes(mp, stages, 4) == 930  # one stage per device: one slot, 300 + 630


@pytest.mark.slow  # about 30 s: sequences up to 2048 tokens
def test_max_seq_decoder_bound_agrees_with_the_planner(tmp_path):
    """A small vocabulary: the decoder layers' activations (not the LM head) set the longest sequence."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1 << 16, tie_word_embeddings=True).save_pretrained(tmp_path)
    args = argparse.Namespace(tiny=False, model=str(tmp_path), devices=2, accelerator="cpu", device_memory_mib=16.0,
                              microbatches=None, microbatch_size=1, start=16, limit=8192, resolution=32)
    r = make_report(args)
    assert r.first_failing is not None and "stage" in r.error
    assert abs(r.planned - r.measured) <= 0.2 * r.measured, r


def test_fit_raises_device_memory_error_through_lightning():
    """Trainer.fit with a budget below one stage's weights: the step raises the budget error."""
    from lightning_roundpipe import RoundPipeStrategy
    from _helpers import CausalLMModule, TokenData, loader, tiny_hf, trainer

    module = CausalLMModule(tiny_hf("llama", layers=2))  # vocab 512 x hidden 32 fp32 = 64 KiB per embedding
    t = trainer(RoundPipeStrategy(device_memory_bytes=32 * 1024, partition="default"), devices=2, max_steps=1)
    with pytest.raises(DeviceMemoryError, match="device_memory_bytes=32768"):
        t.fit(module, loader(TokenData(n=8), batch_size=4))


@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 7, 8, 100, 1023, 1024, 1025, 5000])
def test_largest_fitting_finds_the_threshold(threshold):
    """Doubling + bisection returns the largest length that fits (oracle: the threshold itself), capped at the limit."""
    from lightning_roundpipe.partition.seqlen import largest_fitting

    calls = []

    def fits(n):
        calls.append(n)
        return n <= threshold

    assert largest_fitting(fits, limit=1025) == min(threshold, 1025)
    assert len(calls) <= 2 * 11 + 2  # O(log limit) probes


def test_cli_out_of_memory_hint_gives_more_room_per_device(capsys):
    """Not even the first length fits: the HINT names changes that give each device more room (a larger
    `--device-memory-mib`, at least the planner's peak at 1 token; a smaller microbatch; a lower `--start`),
    never more devices (each still holds its pool of the largest stage's weights)."""
    import re

    assert main(["max-seq", "--tiny", "--device-memory-mib", "1", "--microbatch-size", "2", "--start", "8"]) == 2
    captured = capsys.readouterr()
    err, out = captured.err, captured.out
    # the measured error (the stage weight pool): its HINT agrees with the slots it names; one budget for all
    # devices, so nothing about devices of unequal memory
    assert re.search(r"stage weight pool, before any LOAD: (one slot|\d+ slots) of \d+ bytes", out)
    assert "HINT: the stage weight pool's slots (named above)" in out and "two slots" not in out
    assert "dispatch='weighted'" not in out
    assert "dispatch='weighted'" in str(DeviceMemoryError(0, "stage 1, F(1, mb 0)", 10, 5, 12, unequal_budgets=True))
    assert "--devices" not in err
    assert "shortest sequence tried (8 tokens) fits 1.0 MiB per device" in err
    assert "`--microbatch-size 1`" in err and "a lower `--start` (now 8 tokens)" in err
    peak_mib = float(re.search(r"planner's peak at 1 token is ([0-9.]+) MiB", err).group(1))
    assert peak_mib > 1.0  # the suggested memory is more than the budget that failed
