"""The partitioner: paper search and exact optimum (RoundPipe paper section 4.4; DESIGN.md section 6)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from lightning_roundpipe.partition import (
    LayerProfile,
    PartitionPlan,
    auto_partition,
    describe_stages,
    min_stage_memory_bytes,
    plan_objective_s,
    schedule_ranges,
    stage_memory,
)
from lightning_roundpipe.partition.partitioner import METHODS, PAPER_UPPER_THRESHOLD
from lightning_roundpipe.schedule import build_roundpipe_plan, build_stages

LAYER_COUNTS = (1, 2, 7, 28, 30, 61, 94)


def random_profiles(num_layers: int, seed: int) -> list[LayerProfile]:
    """Random layers with a heavy last layer (LM head) like real models; fixed seed."""
    rng = random.Random(seed)
    out = []
    for i in range(num_layers):
        heavy = 3.0 if i == num_layers - 1 else 1.0
        fwd = rng.uniform(0.5, 1.5) * heavy
        out.append(LayerProfile(
            forward_s=fwd, backward_s=fwd * rng.uniform(1.5, 2.5), param_bytes=rng.randint(50, 150) * 2**20,
            activation_bytes=rng.randint(1, 8) * 2**20, name=f"layer{i}",
        ))
    return out


def uniform_profiles(num_layers: int, fwd: float = 1.0, bwd: float = 2.0) -> list[LayerProfile]:
    return [LayerProfile(forward_s=fwd, backward_s=bwd, param_bytes=1, activation_bytes=0, name=f"l{i}") for i in range(num_layers)]


def min_feasible_budget(profiles, saved=None) -> int:
    """The largest single-layer backward-stage memory: no smaller budget admits a partition."""
    floor = max(stage_memory(profiles, range(i, i + 1), "backward", saved) for i in range(len(profiles)))
    assert floor == min_stage_memory_bytes(profiles, saved)
    with pytest.raises(ValueError, match="over the per-stage memory budget"):
        auto_partition(profiles, 2, floor - 1, saved_activation_bytes=saved)
    return floor


def check_plan(plan: PartitionPlan, profiles, num_devices: int, budget: float | None) -> None:
    L = len(profiles)
    plan.validate(L)
    # every layer exactly once, in order, both directions
    assert [i for r in plan.forward_stages for i in r] == list(range(L))
    assert [i for r in reversed(plan.backward_stages) for i in r] == list(range(L))
    # the tail holds the last layer, is the first backward stage and the last forward range
    tail = plan.backward_stages[0]
    assert tail.stop == L and plan.forward_stages[-1] == tail
    stages = describe_stages(plan, profiles)
    assert stages[0].kind in ("forward", "fused")
    assert sum(s.kind == "fused" for s in stages) == 1
    if budget is not None:
        assert all(s.memory_bytes <= budget for s in stages), [(s.layers, s.memory_bytes, budget) for s in stages]
    S, W = len(stages), max(s.cost_s for s in stages)
    assert plan.objective_s == pytest.approx(max(S, num_devices) * W, rel=1e-12)
    assert plan_objective_s(plan, profiles, num_devices) == pytest.approx(plan.objective_s, rel=1e-12)


@pytest.mark.parametrize("num_layers", LAYER_COUNTS)
def test_property_plans_cover_layers_fit_memory_and_optimal_beats_paper(num_layers):
    profiles = random_profiles(num_layers, seed=1234 + num_layers)
    floor = min_feasible_budget(profiles)
    for num_devices in range(1, 9):
        for budget in (None, floor, int(2.5 * floor)):
            opt = auto_partition(profiles, num_devices, budget, "optimal")
            pap = auto_partition(profiles, num_devices, budget, "paper")
            check_plan(opt, profiles, num_devices, budget)
            check_plan(pap, profiles, num_devices, budget)
            assert opt.objective_s <= pap.objective_s * (1 + 1e-9), (num_layers, num_devices, budget)


def _compositions(start: int, stop: int):
    """All ways to cut ``[start, stop)`` into consecutive non-empty ranges."""
    n = stop - start
    if n == 0:
        yield []
        return
    for cuts in itertools.product((False, True), repeat=n - 1):
        out, s = [], start
        for i, cut in enumerate(cuts, start=start + 1):
            if cut:
                out.append(range(s, i))
                s = i
        out.append(range(s, stop))
        yield out


def brute_force_objective(profiles, num_devices, budget) -> float:
    L, best = len(profiles), math.inf
    budget = math.inf if budget is None else budget
    f = [p.forward_s for p in profiles]
    b = [p.recompute_backward_s for p in profiles]
    for t in range(L):
        tail = range(t, L)
        if stage_memory(profiles, tail, "fused") > budget:
            continue
        tail_cost = sum(b[i] for i in tail)
        fwd_opts, bwd_opts = [], []
        for c in _compositions(0, t):
            if all(stage_memory(profiles, r, "forward") <= budget for r in c):
                fwd_opts.append((len(c), max((sum(f[i] for i in r) for r in c), default=0.0)))
            if all(stage_memory(profiles, r, "backward") <= budget for r in c):
                bwd_opts.append((len(c), max((sum(b[i] for i in r) for r in c), default=0.0)))
        for (nf, wf), (nb, wb) in itertools.product(fwd_opts, bwd_opts):
            best = min(best, max(nf + nb + 1, num_devices) * max(wf, wb, tail_cost))
    return best


def test_optimal_equals_brute_force_on_small_models():
    rng = random.Random(7)
    checked = 0
    for trial in range(80):
        L = rng.randint(1, 6)
        profiles = random_profiles(L, seed=trial)
        D = rng.randint(1, 6)
        floor = min_feasible_budget(profiles)
        budget = rng.choice([None, floor, int(1.7 * floor)])
        plan = auto_partition(profiles, D, budget, "optimal")
        assert plan.objective_s == pytest.approx(brute_force_objective(profiles, D, budget), rel=1e-9)
        checked += 1
    assert checked == 80


def test_optimal_strictly_better_than_paper():
    # 8 equal layers, forward 1 s, backward 2 s (3 s with recomputation), 2 devices.
    # Paper: W in [3, 3.3] -> W = 3: tail = 1 layer, 3 forward + 7 backward stages, 11 x 3 = 33 s.
    # Optimal: one forward stage of 6 layers (6 s), a 2-layer tail and 3 backward stages of 2 layers
    # (6 s each): 5 stages x 6 s = 30 s.
    profiles = uniform_profiles(8)
    paper = auto_partition(profiles, 2, method="paper")
    opt = auto_partition(profiles, 2, method="optimal")
    assert paper.objective_s == pytest.approx(33.0)
    assert opt.objective_s == pytest.approx(30.0)
    assert schedule_ranges(opt) == ((range(0, 6),), (range(6, 8), range(4, 6), range(2, 4), range(0, 2)))


def test_paper_method_follows_the_papers_rule():
    # heaviest layer cost (recompute + backward) = 3; candidates in [3, 3.3] -> W = 3.
    profiles = uniform_profiles(7)
    plan = auto_partition(profiles, 4, method="paper")
    fwd, bwd = schedule_ranges(plan)
    # tail grown from the last layer while it fits W = 3: one layer
    assert bwd[0] == range(6, 7)
    # forward packed greedily from the end with forward costs (1 each): 3 layers a stage
    assert fwd == (range(0, 3), range(3, 6))
    assert bwd[1:] == tuple(range(i, i + 1) for i in range(5, -1, -1))
    assert plan.objective_s == pytest.approx(max(2 + 7, 4) * 3.0)
    assert PAPER_UPPER_THRESHOLD == 1.1


def test_asymmetric_stages_forward_hold_more_layers():
    profiles = uniform_profiles(28)
    fwd, bwd = schedule_ranges(auto_partition(profiles, 8))
    assert min(len(r) for r in fwd) > max(len(r) for r in bwd[1:])


def test_memory_budget_forces_more_stages():
    profiles = random_profiles(30, seed=3)
    free = auto_partition(profiles, 4)
    floor = min_feasible_budget(profiles)
    tight = auto_partition(profiles, 4, floor)
    check_plan(tight, profiles, 4, floor)
    assert len(describe_stages(tight, profiles)) >= len(describe_stages(free, profiles))


def test_saved_activation_bytes_count_in_backward_stages_only():
    profiles = uniform_profiles(4)
    saved = [100, 100, 100, 100]
    assert stage_memory(profiles, range(0, 2), "forward", saved) == 2
    assert stage_memory(profiles, range(0, 2), "backward", saved) == 2 + 2 + 200
    plan = auto_partition(profiles, 2, 210, saved_activation_bytes=saved)
    assert all(len(r) <= 2 for r in plan.backward_stages)
    with pytest.raises(ValueError, match="entries"):
        auto_partition(profiles, 2, saved_activation_bytes=[1, 2])


def test_single_layer_over_budget_names_layer_and_numbers():
    profiles = random_profiles(5, seed=0)
    big = LayerProfile(forward_s=1.0, backward_s=2.0, param_bytes=10 * 2**30, activation_bytes=0, name="lm_head")
    with pytest.raises(ValueError) as e:
        auto_partition(profiles + [big], 4, stage_memory_bytes=8 * 2**30)
    msg = str(e.value)
    assert "Layer 5" in msg and "`lm_head`" in msg and "`stage_memory_bytes` = 8 GiB (8,589,934,592 bytes)" in msg and "HINT" in msg
    assert "needs 30 GiB" in msg  # weights + accumulated gradients + the fresh gradient of the next microbatch


def test_bad_arguments():
    profiles = uniform_profiles(3)
    with pytest.raises(ValueError, match=r"valid options: \['optimal', 'paper'\]"):
        auto_partition(profiles, 2, method="greedy")
    with pytest.raises(ValueError, match="`num_devices`"):
        auto_partition(profiles, 0)
    with pytest.raises(ValueError, match="`stage_memory_bytes`"):
        auto_partition(profiles, 2, stage_memory_bytes=0)
    with pytest.raises(ValueError, match="empty"):
        auto_partition([], 2)
    assert METHODS == ("optimal", "paper")


def test_single_layer_model():
    plan = auto_partition(uniform_profiles(1), 3)
    assert plan.forward_stages == (range(0, 1),) and plan.backward_stages == (range(0, 1),)
    assert schedule_ranges(plan) == ((), (range(0, 1),))
    assert plan.objective_s == pytest.approx(3 * 3.0)


@pytest.mark.parametrize("num_layers,devices", [(7, 3), (30, 8), (2, 1)])
def test_plan_feeds_the_round_robin_schedule(num_layers, devices):
    profiles = random_profiles(num_layers, seed=num_layers)
    plan = auto_partition(profiles, devices)
    fwd, bwd = schedule_ranges(plan)
    eplan = build_roundpipe_plan(build_stages(fwd, bwd, fused_tail=True), devices, devices + 1)
    assert len(eplan.stages) == len(fwd) + len(bwd)
    assert eplan.backward_stages[0].fused and eplan.backward_stages[0].layers == plan.backward_stages[0]


@pytest.mark.parametrize("backward,entry", [
    ((range(0, 3), range(3, 5)), 1),  # ascending: the user's list is quoted, not its reverse
    ((range(3, 5), range(1, 3)), 1),  # a gap
])
def test_validate_quotes_backward_stages_as_given(backward, entry):
    with pytest.raises(ValueError) as err:
        PartitionPlan((range(0, 3), range(3, 5)), backward).validate(5)
    msg = str(err.value)
    assert f"got {list(backward)!r}" in msg and f"entry {entry} " in msg
    assert "descending order" in msg and "HINT:" in msg


def test_schedule_ranges_rejects_foreign_plans():
    with pytest.raises(ValueError, match="fused tail"):
        schedule_ranges(PartitionPlan((range(0, 2),), (range(1, 2), range(0, 1))))


# ------------------------------------------------------------------ the paper method on the paper's models
#: Layers per stage of ``auto_partition(layer_profiles(t), 8, method="paper")`` for the models of
#: paper_layer_timings_4090.csv (layer sequence: embedding, decoder layers, LM head): forward stages
#: without the tail, and backward stages tail first. Copied from the simulator's former private
#: partitioner (``simulate/_partition.py: roundpipe_partition``), which the paper method replaced
#: after matching it for every model on 1..8 devices.
PAPER_D8_LAYER_COUNTS = {
    "Qwen3-1.7B": ((8, 7, 7, 7), (1, 3, 3, 3, 3, 3, 3, 3, 3, 2, 3)),
    "Llama3.1-8B": ((6, 5, 5, 5, 6, 6), (1,) + (2,) * 15 + (3,)),
    "GPT-OSS-20B": ((7, 6, 6, 6), (1,) * 24 + (2,)),
    "Qwen3-32B": ((5,) + (4,) * 15, (1,) * 64 + (2,)),
    "Qwen3-235B-A22B-LoRA": ((3,) + (2,) * 46, (1,) * 94 + (2,)),
}


def _paper_models():
    from lightning_roundpipe.simulate import paper_data_path
    from lightning_roundpipe.simulate.table import layer_profiles, read_layer_timings

    return [(t.model, layer_profiles(t)) for t in read_layer_timings(paper_data_path("paper_layer_timings_4090.csv"))]


def test_paper_method_on_paper_layer_timings():
    models = _paper_models()
    assert [name for name, _ in models] == list(PAPER_D8_LAYER_COUNTS)
    for name, profiles in models:
        for num_devices in range(1, 9):
            plan = auto_partition(profiles, num_devices, method="paper")
            check_plan(plan, profiles, num_devices, None)
            fwd, bwd = schedule_ranges(plan)
            _assert_even(profiles, fwd, bwd)
            if num_devices == 8:
                assert (tuple(map(len, fwd)), tuple(map(len, bwd))) == PAPER_D8_LAYER_COUNTS[name], name


def _assert_even(profiles, fwd, bwd) -> None:
    """Re-cut stages: per direction, max stage cost - min stage cost <= the heaviest layer's cost."""
    tail_start = bwd[0].start
    for ranges, cost in ((fwd, lambda p: p.forward_s), (bwd[1:], lambda p: p.recompute_backward_s)):
        if not ranges:
            continue
        stage_costs = [sum(cost(profiles[i]) for i in r) for r in ranges]
        heaviest = max(cost(profiles[i]) for i in range(tail_start))
        assert max(stage_costs) - min(stage_costs) <= heaviest * (1 + 1e-9), (stage_costs, heaviest)


@pytest.mark.parametrize("num_layers", LAYER_COUNTS)
def test_property_paper_method_stages_are_as_even_as_possible(num_layers):
    for profiles in [random_profiles(num_layers, seed=seed) for seed in range(3)] + [uniform_profiles(num_layers)]:
        for num_devices in range(1, 9):
            fwd, bwd = schedule_ranges(auto_partition(profiles, num_devices, method="paper"))
            _assert_even(profiles, fwd, bwd)


def test_paper_method_keeps_the_packed_cut_when_the_even_one_breaks_memory():
    # 8 equal layers (forward 1 s, recompute + backward 3 s), frozen (no gradients), 4 devices:
    # W = 3, a one-layer tail, 7 one-layer backward stages and 3 forward stages over layers 0..6.
    # The even re-cut is 2, 2, 3 layers; packing from the end gives 1, 3, 3.
    profiles = [
        LayerProfile(forward_s=1.0, backward_s=2.0, param_bytes=10 if i == 0 else 1, activation_bytes=0,
                     trainable_param_bytes=0, name=f"l{i}")
        for i in range(8)
    ]
    free_fwd, free_bwd = schedule_ranges(auto_partition(profiles, 4, method="paper"))
    assert free_fwd == (range(0, 2), range(2, 4), range(4, 7))
    # a budget of 10 bytes fits layer 0 alone but not layers 0-1 (11 bytes): the packed cut is kept
    plan = auto_partition(profiles, 4, stage_memory_bytes=10, method="paper")
    check_plan(plan, profiles, 4, 10)
    fwd, bwd = schedule_ranges(plan)
    assert fwd == (range(0, 1), range(1, 4), range(4, 7))
    assert bwd == free_bwd == (range(7, 8),) + tuple(range(i, i + 1) for i in range(6, -1, -1))
    # a budget the even cut fits changes nothing
    roomy = auto_partition(profiles, 4, stage_memory_bytes=11, method="paper")
    assert schedule_ranges(roomy) == (free_fwd, free_bwd)

