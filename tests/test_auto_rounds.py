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

import lightning

import lightning_roundpipe
from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.partition.profile import LayerProfile
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.runtime.tuning import autopartition
from lightning_roundpipe.runtime.tuning.autopartition import (choose_partition, fused_stages, round_options, simulated_step_s,
                                                      split_options)
from lightning_roundpipe.runtime.execution.microbatch import split_microbatches, split_sizes
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
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
    assert engine.microbatch_weights(4) == pytest.approx([6 / 8] * 4)  # the same 8 rows cut into 4 of 2
    engine._last_sizes = [2, 2, 2]
    assert engine.microbatch_weights(3) is None
    engine._profiled_rows = 3.0  # after profiling 3-row microbatches, 2-row ones weigh 2/3
    assert engine.microbatch_weights(3) == pytest.approx([2 / 3] * 3)


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
    from lightning_roundpipe.runtime.tuning.autopartition import describe_rounds

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


# ---------------------------------------------------------------------- the batch cut into a multiple of the devices

def test_split_sizes_match_torch_tensor_split():
    """The documented rule's oracle is torch's own `tensor_split`; the runtime cuts the tensors so."""
    for rows in range(1, 12):
        for count in range(1, 9):
            expected = [len(part) for part in torch.tensor_split(torch.arange(rows), min(count, rows))]
            assert split_sizes(rows, count) == expected
            parts, sizes = split_microbatches({"x": torch.arange(rows), "n": 3}, count)
            assert sizes == expected and [len(p["x"]) for p in parts] == expected
            assert torch.equal(torch.cat([p["x"] for p in parts]), torch.arange(rows)) and all(p["n"] == 3 for p in parts)


def test_split_options():
    engine, _ = _engine(2, 3, [3, 3, 2], balance_microbatches=True)
    assert split_options(engine, 3, 8) == [3, 4]  # the configured count first, then the next multiple of 2
    assert split_options(engine, 8, 8) == [8]  # already a multiple
    assert split_options(engine, 3, 3) == [3]  # a microbatch needs a row
    engine4, _ = _engine(4, 3, [3, 3, 2], balance_microbatches=True)
    assert split_options(engine4, 5, 8) == [5, 8]
    assert split_options(engine4, 5, 6) == [5, 6]
    for kw, devices in (({"balance_microbatches": False}, 2), ({"balance_microbatches": True}, 1),
                        ({"balance_microbatches": True, "microbatches_per_round": 1}, 2)):
        other, _ = _engine(devices, 3, [3, 3, 2], **kw)
        assert split_options(other, 3, 8) == [3]
    random_layers = RoundPipeEngine(make_layer_sequence(tiny_hf(dropout=0.1)), [torch.device("cpu")] * 2, 3,
                                    auto_partition_after_steps=2, balance_microbatches=True)
    _OPEN.append(random_layers)
    assert split_options(random_layers, 3, 8) == [3]  # dropout masks are per microbatch


def test_the_choice_line_says_why_no_cut_is_offered():
    """With `microbatches_per_round` set, 3 microbatches on 2 devices are not re-cut, and the line says why;
    a count already a multiple of the devices needs no reason."""
    lines = []
    pinned, profiles = _engine(2, 3, [3, 3, 2], balance_microbatches=True, microbatches_per_round=1)
    pinned.info = lines.append
    assert choose_partition(pinned, profiles).num_microbatches is None
    assert "no cut into a multiple of the 2 devices: `microbatches_per_round` is set" in lines[-1]
    even, profiles = _engine(2, 4, [2, 2, 2, 2], balance_microbatches=True, microbatches_per_round=1)
    even.info = lines.append
    choose_partition(even, profiles)
    assert "no cut" not in lines[-1]


def test_eight_rows_in_three_microbatches_run_as_four_on_two_devices():
    """8 rows, 3 microbatches (3, 3, 2), 2 devices, profiled at 8/3 rows per microbatch: the best the
    configured cut allows is 5 rows on one device (rounds of 1, whole model: 5/(8/3) microbatch-times);
    cut into 4 microbatches of 2 rows, rounds of 2 give each device 4 rows: 4/(8/3) = 1.5."""
    engine, profiles = _engine(2, 3, [3, 3, 2], balance_microbatches=True)
    engine._profiled_rows = 8 / 3
    per_microbatch = 3 * len(profiles)  # s at the profiled size, whole model, nothing recomputed
    choice = choose_partition(engine, profiles)
    assert choice.num_microbatches == 4
    assert choice.partition.forward_stages == (range(0, len(profiles)),)
    assert choice.simulated_s == pytest.approx(4 / (8 / 3) * per_microbatch)
    kept, profiles = _engine(2, 3, [3, 3, 2], balance_microbatches=False)
    kept._profiled_rows = 8 / 3
    assert choose_partition(kept, profiles).num_microbatches is None


@pytest.mark.parametrize("finer_s,chosen", [(0.99, None), (0.97, 4)])
def test_finer_cut_needs_the_margin(monkeypatch, finer_s, chosen):
    """The finer cut is taken only when the simulator times it at least 2 % faster (BALANCE_MARGIN)."""
    engine, profiles = _engine(2, 3, [3, 3, 2], balance_microbatches=True)
    monkeypatch.setattr(autopartition, "simulated_step_s",
                        lambda engine, candidate, profiles, per_round, count: 1.0 if count == 3 else finer_s)
    assert autopartition.BALANCE_MARGIN == 0.02
    assert choose_partition(engine, profiles).num_microbatches == chosen


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("whole_s", [0.95, 0.91, 0.89, 0.5])
def test_one_stage_needs_the_margin_on_several_devices(monkeypatch, devices, whole_s):
    """Issue 20: with more than one device the whole model as one stage (no pipeline) is taken only when
    the simulator times it at least 10 % (SINGLE_STAGE_MARGIN) faster than the best plan of several
    stages, and the line says so with both times; otherwise that plan runs. One device: the fastest."""
    engine, profiles = _engine(devices, 4, [2, 2, 2, 2])
    lines: list[str] = []
    engine.info = lines.append
    num_layers = len(profiles)
    seen: list[PartitionPlan] = []

    def timed(engine, candidate, profiles, per_round, count):  # several stages: 1 s + 0.1 s a forward stage over 2
        seen.append(candidate)
        stages = len(candidate.forward_stages)
        return whole_s if stages == 1 else 1.0 + 0.1 * (stages - 2)

    monkeypatch.setattr(autopartition, "simulated_step_s", timed)
    assert autopartition.SINGLE_STAGE_MARGIN == 0.10
    choice = choose_partition(engine, profiles)
    best_several_s = 1.0 + 0.1 * (min(len(c.forward_stages) for c in seen if len(c.forward_stages) > 1) - 2)
    takes_whole = devices == 1 or whole_s <= (1 - 0.10) * best_several_s
    assert (choice.partition.forward_stages == (range(0, num_layers),)) == takes_whole
    assert choice.simulated_s == pytest.approx(whole_s if takes_whole else best_several_s)
    if devices > 1:
        numbers = (f"the whole model as one stage {whole_s * 1e3:.1f} ms vs {best_several_s * 1e3:.1f} ms for the best"
                   f" plan of several stages")
        assert numbers in lines[-1] and f"{100 * (1 - whole_s / best_several_s):.1f}% faster" in lines[-1], lines[-1]
        assert ("at least the 10% margin required" if takes_whole else "kept a pipeline") in lines[-1], lines[-1]
        assert ("no recomputation and no stage fill or drain" in lines[-1]) == takes_whole, lines[-1]  # why (issue 31)
    else:
        assert "one stage" not in lines[-1] and "margin" not in lines[-1], lines[-1]


class _Counts(lightning.Callback):
    """Records the microbatches of every training batch; with ``cut_into``, makes the engine cut every
    batch into that many from the first step on."""

    def __init__(self, cut_into: int | None = None) -> None:
        self.cut_into, self.seen = cut_into, []

    def on_train_start(self, trainer, pl_module) -> None:
        if self.cut_into is not None:
            trainer.strategy.engine.split_num_microbatches = self.cut_into

    def on_train_batch_end(self, trainer, *args) -> None:
        self.seen.append(trainer.strategy.engine._last_call[0])


@pytest.mark.parametrize("fused", [True, False])
def test_finer_cut_keeps_parity(fused):
    """7 rows cut into 4 microbatches (2, 2, 2, 1) instead of 3 train exactly like the default strategy
    on the fused and on the transparent path (the loss is normalised by the whole batch)."""
    data = TokenData()
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), data, max_steps=3)
    counts = _Counts(cut_into=4)
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, fused_loss=fused, partition="default")
    got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), data, strategy=strategy, devices=2, max_steps=3,
                     callbacks=[counts])
    assert counts.seen == [4, 4, 4]
    assert max_diff(ref, got) <= 1e-5


def test_fit_cuts_three_microbatches_into_four_on_two_devices():
    """What a user gets: `num_microbatches=3` on 2 CPU virtual devices, batches of 8. After the profiled
    steps the automatic choice cuts the batch into 4 (transfers are free here, so the whole model in
    rounds of 2 halves the 1-device step, which the 3-microbatch cut cannot: 5 rows vs 3), and the run
    keeps parity; with `balance_microbatches=False` it keeps 3."""
    data = TokenData()
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), data, max_steps=4, batch_size=8)
    for balance, expected in ((True, [3, 3, 4, 4]), (False, [3, 3, 3, 3])):
        counts = _Counts()
        strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, profile_steps=2,
                                                         balance_microbatches=balance)
        got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), data, strategy=strategy, devices=2, max_steps=4,
                         batch_size=8, callbacks=[counts])
        assert counts.seen == expected
        assert max_diff(ref, got) <= 1e-5


# ---------------------------------------------------------------------- the choice in checkpoints

def _fit_resumable(tmp, max_steps: int, devices: int = 2, ckpt_path=None, save: bool = False, **strategy_kw):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from _helpers import loader, params, trainer

    module = CausalLMModule(tiny_hf("llama"))
    counts = _Counts()
    callbacks = [counts] + ([ModelCheckpoint(dirpath=tmp, save_top_k=-1)] if save else [])  # one file an epoch
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, profile_steps=2, **strategy_kw)
    fit = trainer(strategy, devices, max_steps=max_steps, enable_checkpointing=save, callbacks=callbacks)
    # one batch of 8 rows per epoch: a resumed epoch restarts its dataloader, so every step sees the same batch
    fit.fit(module, loader(TokenData(n=8), 8), ckpt_path=ckpt_path)
    return params(module), counts.seen


def test_resume_goes_on_with_the_chosen_cut(tmp_path):
    """A checkpoint keeps the profiling progress and the automatic choice (plain values): resumed
    before the choice (step 1: the resumed run makes it at the straight run's step) or after it
    (step 3: it keeps it), the run cuts the batch as the straight run does and ends bitwise equal; on
    another device count, or with settings that rule the cut out, the choice is not kept (it profiles again). The choice here is structural,
    not timing noise: 4 rows a device instead of 5, 20 % off the step, nothing else comes near."""
    import torch

    straight, seen = _fit_resumable(tmp_path / "a", 5, save=True)
    assert seen == [3, 3, 4, 4, 4]
    ckpt = {step: next((tmp_path / "a").glob(f"*step={step}.ckpt")) for step in (1, 3)}
    for saved_at in (1, 3):
        state = torch.load(ckpt[saved_at], weights_only=True)["roundpipe_plan"]
        assert (state.get("choice") or {}).get("num_microbatches") == (4 if saved_at == 3 else None)
        resumed, seen = _fit_resumable(tmp_path / f"resumed{saved_at}", 5, ckpt_path=ckpt[saved_at])
        assert seen == [3, 3, 4, 4, 4][saved_at:]
        assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    _, seen = _fit_resumable(tmp_path / "three", 5, devices=3, ckpt_path=ckpt[3])
    assert seen == [3, 3]  # 3 devices: profiled again from the resumed step 4 (steps 4 and 5 on 3 microbatches)
    for kw in ({"balance_microbatches": False}, {"microbatches_per_round": 1}):  # other settings: chosen again
        _, seen = _fit_resumable(tmp_path / "other", 5, ckpt_path=ckpt[3], **kw)
        assert seen == [3, 3]


def test_a_checkpoint_saved_after_fit_keeps_the_plan(tmp_path):
    """`trainer.save_checkpoint` once `fit` has returned (the engine is closed) writes the plan the
    run ended with: the same as a checkpoint written during the last step."""
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from _helpers import loader, trainer

    during = ModelCheckpoint(dirpath=tmp_path / "during", save_top_k=-1)
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, profile_steps=2)
    fit = trainer(strategy, 2, max_steps=3, enable_checkpointing=True, callbacks=[during])
    fit.fit(CausalLMModule(tiny_hf("llama")), loader(TokenData(n=8), 8))
    fit.save_checkpoint(tmp_path / "after.ckpt")
    after = torch.load(tmp_path / "after.ckpt", weights_only=True)["roundpipe_plan"]
    last = torch.load(next((tmp_path / "during").glob("*step=3.ckpt")), weights_only=True)["roundpipe_plan"]
    assert after["choice"] is not None and after["choice"] == last["choice"]
    assert after["settings"] == last["settings"]
