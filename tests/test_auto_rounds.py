"""The automatic choice times microbatch rounds with every candidate partition (issue 6: the runtime
adopts the simulator's choices as plan parameters), and the simulator weighs uneven microbatches.

Oracles: closed-form step times of synthetic per-layer costs (transfers free, every layer forward
1 s and backward 2 s: a microbatch through the whole model as one fused stage costs 3 s per layer,
with nothing recomputed), and Lightning's default strategy (parity of a rounds plan).
"""

from __future__ import annotations

import math

import pytest
import torch

import lightning_roundpipe
from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.partition.profile import LayerProfile
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.runtime.autopartition import choose_partition, fused_stages, round_options, simulated_step_s
from lightning_roundpipe.runtime.engine import RoundPipeEngine
from lightning_roundpipe.schedule import build_roundpipe_plan
from lightning_roundpipe.schedule.lower import lower
from lightning_roundpipe.simulate import simulate_program
from _helpers import CausalLMModule, TokenData, fit_params, max_diff, tiny_hf

FWD_S, BWD_S = 1.0, 2.0
_OPEN: list[RoundPipeEngine] = []


@pytest.fixture(autouse=True)
def _close_engines():
    """Engines start their device threads: stop them after each test (later tests count threads)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def _engine(devices: int, num_microbatches: int, sizes: list[int], **kw) -> tuple[RoundPipeEngine, list[LayerProfile]]:
    engine = RoundPipeEngine(make_layer_sequence(tiny_hf()), [torch.device("cpu")] * devices, num_microbatches,
                             auto_partition_after_steps=2, **kw)
    _OPEN.append(engine)
    engine.info = lambda message: None
    engine._last_call, engine._last_sizes = (num_microbatches, True), sizes  # as after a fused training call
    profiles = [LayerProfile(forward_s=FWD_S, backward_s=BWD_S, param_bytes=1000, activation_bytes=100)
                for _ in range(len(engine.seq))]
    return engine, profiles


def test_round_options():
    engine, _ = _engine(2, 8, [1] * 8)
    assert round_options(engine, 8) == [None, 4, 2, 1]  # one round first, then fewest rounds first
    assert round_options(engine, 3) == [None, 2, 1]
    assert round_options(engine, 1) == [None]
    one, _ = _engine(1, 8, [1] * 8)
    assert round_options(one, 8) == [None]  # rounds on one device only add uploads
    pinned, _ = _engine(2, 8, [1] * 8, microbatches_per_round=2)
    assert round_options(pinned, 8) == [2]


def test_whole_model_in_rounds_halves_the_step_on_two_devices():
    """8 equal microbatches, 2 devices: the whole model as one fused stage, in rounds of 4, gives each
    device 4 microbatches at 3 s per layer and nothing recomputed: 12 L s, half the 1-device 24 L s;
    every cut into stages recomputes and so is slower."""
    engine, profiles = _engine(2, 8, [1] * 8)
    num_layers = len(profiles)
    choice = choose_partition(engine, profiles)
    assert choice.partition.forward_stages == (range(0, num_layers),)
    assert choice.microbatches_per_round == 4
    assert choice.simulated_s == pytest.approx(4 * 3 * num_layers)
    one, profiles = _engine(1, 8, [1] * 8)
    single = choose_partition(one, profiles)
    assert single.microbatches_per_round is None
    assert single.simulated_s == pytest.approx(8 * 3 * num_layers)


def test_uneven_microbatches_pick_rounds_of_one():
    """8 rows in 3 microbatches (3, 3, 2): rounds of 2 give one device 6 rows, rounds of 1 give it 5
    (microbatches 0 and 2); the simulator sees the sizes and the step is 5/(8/3) microbatches long."""
    sizes = [3, 3, 2]
    engine, profiles = _engine(2, 3, sizes)
    num_layers, mean = len(profiles), sum(sizes) / len(sizes)
    whole = PartitionPlan((range(0, num_layers),), (range(0, num_layers),))
    per_microbatch = 3 * num_layers  # s, at the mean size
    assert simulated_step_s(engine, whole, profiles, 2) == pytest.approx((3 + 3) / mean * per_microbatch)
    assert simulated_step_s(engine, whole, profiles, 1) == pytest.approx((3 + 2) / mean * per_microbatch)
    choice = choose_partition(engine, profiles)
    assert choice.simulated_s <= (3 + 2) / mean * per_microbatch + 1e-9
    assert choice.microbatches_per_round != 2


def test_microbatch_weights_scale_compute():
    profiles = [LayerProfile(forward_s=FWD_S, backward_s=BWD_S, param_bytes=1, activation_bytes=0) for _ in range(3)]
    whole = PartitionPlan((range(0, 3),), (range(0, 3),))
    plan = build_roundpipe_plan(fused_stages(whole), 1, 3)
    program = lower(plan, stage_weight_bytes=[3], stage_grad_bytes=[3])
    assert simulate_program(program, profiles).iteration_s == pytest.approx(3 * 9)
    weighted = simulate_program(program, profiles, microbatch_weights=[1.5, 0.5, 2.0]).iteration_s
    assert weighted == pytest.approx((1.5 + 0.5 + 2.0) * 9)
    for bad in ([1.0, 1.0], [1.0, -1.0, 1.0], [1.0, math.nan, 1.0], [1.0, "1", 1.0]):
        with pytest.raises(ValueError, match="microbatch_weights"):
            simulate_program(program, profiles, microbatch_weights=bad)


def test_engine_microbatch_weights():
    engine, _ = _engine(2, 3, [3, 3, 2])
    assert engine.microbatch_weights(3) == pytest.approx([9 / 8, 9 / 8, 6 / 8])
    assert engine.microbatch_weights(4) is None  # another shape than the last call's
    engine._last_sizes = [2, 2, 2]
    assert engine.microbatch_weights(3) is None


@pytest.mark.parametrize("per_round", [1, 2])
def test_whole_model_stage_in_rounds_keeps_parity(per_round):
    """What the automatic choice picks on CPU virtual devices (one fused stage, microbatches to the
    devices in turn) trains exactly like the default strategy."""
    data = TokenData()
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), data, max_steps=3)
    num_layers = len(make_layer_sequence(tiny_hf("llama")))
    strategy = lightning_roundpipe.RoundPipeStrategy(
        num_microbatches=3, microbatches_per_round=per_round,
        forward_stages=[range(0, num_layers)], backward_stages=[range(0, num_layers)])
    got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), data, strategy=strategy, devices=2, max_steps=3)
    assert max_diff(ref, got) <= 1e-5


def test_describe_rounds():
    from lightning_roundpipe.runtime.autopartition import describe_rounds

    assert describe_rounds(None, 3) == "one round"
    assert describe_rounds(4, 3) == "one round"  # a round of at most 4 holds all 3
    assert describe_rounds(3, 3) == "one round"
    assert describe_rounds(1, 3) == "rounds of 1 microbatch(es)"


def test_fit_shorter_than_the_profiled_steps_warns():
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, profile_steps=3)
    with pytest.warns(UserWarning, match=r"`max_steps=2` ends this fit before the `profile_steps=3`.*HINT"):
        fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), strategy=strategy, devices=2, max_steps=2)


@pytest.mark.parametrize("value,hint", [("Auto", "use 'auto'"), (" default", "use 'default'"),
                                        ("balanced", "pass explicit stages with `forward_stages=`")])
def test_partition_typo_gets_the_near_option(value, hint):
    with pytest.raises(ValueError, match=f"`partition` must be one of.*HINT: {hint}"):
        lightning_roundpipe.RoundPipeConfig(partition=value)
