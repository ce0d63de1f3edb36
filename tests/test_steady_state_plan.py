"""The steady-state program as data (issue 19): K iterations in one round-robin plan, the host's
optimizer steps and the mode's edges, and the partitions the simulator chooses among.

Oracles: the one-iteration builder (each iteration of the K-iteration plan is the one-iteration plan
at the continued cursor), the ops' meaning (which gradients an optimizer step applies, which uploads
read which weights), brute force over every partition of a small model, and the simulator run on
each candidate directly.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from lightning_roundpipe.partition import (
    HardwareModel,
    LayerProfile,
    candidate_partitions,
    filling_stage_counts,
    model_profiles,
    optimizer_step_bytes,
    partition_with_stage_count,
    preset_config,
    stage_count,
)
from lightning_roundpipe.partition.partitioner import schedule_ranges, stage_memory
from lightning_roundpipe.schedule import (
    PlanValidationError,
    SteadyState,
    build_roundpipe_plan,
    build_stages,
    build_steady_state_plan,
    lower_steady_state,
    plan_next_cursor,
)
from lightning_roundpipe.schedule.lower import lower, plan_dispatches
from lightning_roundpipe.schedule.program import OpKind
from lightning_roundpipe.simulate.steady import choose_for_mode, partition_stages, simulate_training

# 7 stages: 3 forward, the fused tail, 3 backward (not a multiple of 2, 3 or 4 devices)
FORWARD = (range(0, 3), range(3, 6), range(6, 9))
BACKWARD = (range(9, 10), range(6, 9), range(3, 6), range(0, 3))
STAGES = build_stages(FORWARD, BACKWARD, fused_tail=True)


def _computes(plan, device: int, microbatches: range) -> list[tuple[int, str, int]]:
    return [(a.stage_index, a.kind.value, a.microbatch_index) for a in plan.actions[device]
            if a.kind.is_compute and a.microbatch_index in microbatches]


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 3, 5])
@pytest.mark.parametrize("per_round", [None, 2])
def test_each_iteration_is_the_one_iteration_plan_at_the_continued_cursor(devices, microbatches, per_round):
    iterations = 3
    plan = build_steady_state_plan(STAGES, devices, microbatches, iterations, optimizer="async",
                                   microbatches_per_round=per_round)
    assert plan.num_microbatches == iterations * microbatches and plan.stages == STAGES  # specs shared
    spec = plan._meta["steady_state"]
    assert spec == SteadyState(iterations, microbatches, "async", 1)
    cursor = 0
    for k in range(iterations):
        single = build_roundpipe_plan(STAGES, devices, microbatches, cursor, microbatches_per_round=per_round)
        local = range(k * microbatches, (k + 1) * microbatches)
        for d in range(devices):
            expected = [(s, kind, k * microbatches + m) for s, kind, m in _computes(single, d, range(microbatches))]
            assert _computes(plan, d, local) == expected
        cursor = plan_next_cursor(single)
        assert [spec.iteration_of(m) for m in local] == [k] * microbatches
        assert [spec.local_microbatch(m) for m in local] == list(range(microbatches))
    assert plan_next_cursor(plan) == cursor
    # on every device the iterations follow each other in list order: iteration k + 1 after k's last stage
    for acts in plan.actions:
        order = [spec.iteration_of(a.microbatch_index) for a in acts if a.kind.is_compute]
        assert order == sorted(order)
    # a microbatch round never holds two iterations
    for dispatch in plan_dispatches(plan):
        assert len({spec.iteration_of(a.microbatch_index) for a in dispatch.computes}) == 1


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 5, 9])
@pytest.mark.parametrize("optimizer,accumulate", [("sync", 1), ("async", 1), ("sync", 2), ("async", 2)])
def test_steady_plan_validates_and_lowers(devices, microbatches, optimizer, accumulate):
    plan = build_steady_state_plan(STAGES, devices, microbatches, 2 * accumulate + 1, optimizer=optimizer,
                                   accumulate_grad_batches=accumulate)
    weights = [1000 * len(s.layers) for s in plan.stages]
    grads = [0 if s.kind == "forward" else 1000 * len(s.layers) for s in plan.stages]
    program = lower_steady_state(plan, stage_weight_bytes=weights, stage_grad_bytes=grads, chunk_bytes=600)
    # the device streams are exactly what the lowering of any plan gives (unchanged lowering), plus the
    # host's issue order: each stream's first op of iteration i + 1 also waits for iteration i's fused tail
    plain = lower(plan, stage_weight_bytes=weights, stage_grad_bytes=grads, chunk_bytes=600)
    assert program.program.as_strings() == plain.as_strings()
    spec = program.steady_state
    tails: dict[int, set] = {}
    for _, _, _, op in plain.ops():
        if op.kind is OpKind.X:
            tails.setdefault(program.iteration_of(op), set()).add(op)
    firsts = set()
    for per_stream in plain.streams:
        for ops in per_stream.values():
            seen: set[int] = set()
            for op in ops:
                if program.iteration_of(op) not in seen:
                    seen.add(program.iteration_of(op))
                    if program.iteration_of(op) > 0:
                        firsts.add(op)
    assert len(tails) == spec.num_iterations and firsts
    for _, _, _, op in plain.ops():
        extra = set(program.program.deps.get(op, ())) - set(plain.deps.get(op, ()))
        assert set(plain.deps.get(op, ())) <= set(program.program.deps.get(op, ()))
        assert extra == (tails[program.iteration_of(op) - 1] if op in firsts else set()), op
    # one step per complete window: 3 windows of 1 iteration, or 2 of 2 (the fifth iteration's window is incomplete)
    assert [op.step_index for op in program.optimizer_ops] == list(range((2 * accumulate + 1) // accumulate))
    backward = [s for s in plan.stages if s.kind == "backward"]
    for step in program.optimizer_ops:
        waited = program.optimizer_deps[step]
        window = spec.iterations_of_step(step.step_index)
        # every backward stage's gradients, once per iteration of the window (one round each)
        assert len(waited) == len(backward) * len(window)
        assert all(op.kind is OpKind.WD2H and program.iteration_of(op) in window for op in waited)
    # which device ops wait for which step: the mode's rule, spelled out
    for _, _, _, op in program.program.ops():
        step = program.optimizer_waits.get(op)
        window = program.iteration_of(op) // accumulate
        if optimizer == "async":
            expect = window - 2 if op.kind is OpKind.LOAD and window >= 2 else None
        else:
            expect = window - 1 if op.kind in (OpKind.LOAD, OpKind.H2D, OpKind.GH2D) and window >= 1 else None
        assert (None if step is None else step.step_index) == expect, op


def test_validation_catches_a_missing_optimizer_edge():
    plan = build_steady_state_plan(STAGES, 3, 4, 3, optimizer="async")
    program = lower_steady_state(plan)
    # device 0's first weight upload of iteration 2 reads the weights of optimizer step 0; without its
    # edge nothing before it on its stream, nor anything it waits for, waits for that step
    target = next(op for op in program.program.streams[0]["weights"] if program.iteration_of(op) == 2)
    assert program.optimizer_waits[target].step_index == 0
    waits = dict(program.optimizer_waits)
    del waits[target]
    broken = dataclasses.replace(program, optimizer_waits=waits)
    with pytest.raises(PlanValidationError, match=rf"`{target}` \(iteration 2\) may start before `OPT0` ends"):
        broken.validate()
    deps = dict(program.optimizer_deps)
    first = program.optimizer_ops[0]
    deps[first] = deps[first][1:]
    with pytest.raises(PlanValidationError, match="must wait for exactly its window's gradient downloads"):
        dataclasses.replace(program, optimizer_deps=deps).validate()
    # an upload that waits for a step its own gradients feed can never run
    waits = dict(program.optimizer_waits)
    waits[program.program.streams[0]["weights"][0]] = program.optimizer_ops[0]
    with pytest.raises(PlanValidationError, match="deadlock"):
        dataclasses.replace(program, optimizer_waits=waits).validate()


def test_steady_state_errors():
    with pytest.raises(ValueError, match=r"`optimizer` must be one of \['sync', 'async'\]"):
        build_steady_state_plan(STAGES, 2, 3, 3, optimizer="adam")
    with pytest.raises(ValueError, match="`num_iterations` must be a positive int"):
        build_steady_state_plan(STAGES, 2, 3, 0)
    with pytest.raises(ValueError, match="`accumulate_grad_batches` must be a positive int"):
        build_steady_state_plan(STAGES, 2, 3, 3, accumulate_grad_batches=0)
    with pytest.raises(ValueError, match="not a steady-state plan.*HINT"):
        lower_steady_state(build_roundpipe_plan(STAGES, 2, 3))


# ---------------------------------------------------------------------------------------- candidates
def _best_cut(costs: list[float], stop: int, count: int) -> float | None:
    """Smallest largest part over every cut of ``costs[:stop]`` into ``count`` non-empty runs."""
    if count == 0:
        return 0.0 if stop == 0 else None
    if count > stop:
        return None
    best = None
    for inner in itertools.combinations(range(1, stop), count - 1):
        bounds = (0, *inner, stop)
        largest = max(sum(costs[bounds[i]:bounds[i + 1]]) for i in range(count))
        best = largest if best is None else min(best, largest)
    return best


def _brute_force_largest(profiles: list[LayerProfile], num_stages: int) -> float | None:
    """Smallest largest stage cost over every partition with exactly ``num_stages`` stages: a tail
    ``[t, L)``, ``F`` forward stages and ``B`` backward stages over ``[0, t)``, ``F + 1 + B`` stages
    (``t = 0``: the whole model as the tail, one stage)."""
    fwd = [p.forward_s for p in profiles]
    bwd = [p.forward_s + p.backward_s for p in profiles]
    best = None
    for t in range(len(profiles)):
        for forward in range(num_stages):
            backward = num_stages - 1 - forward
            if t > 0 and (forward < 1 or backward < 1):
                continue
            f_best, b_best = _best_cut(fwd, t, forward), _best_cut(bwd, t, backward)
            if f_best is None or b_best is None:
                continue
            largest = max(sum(bwd[t:]), f_best, b_best)
            best = largest if best is None else min(best, largest)
    return best


@pytest.mark.parametrize("num_stages", [1, 3, 4, 6, 8, 11])
def test_partition_with_stage_count_is_the_smallest_largest_stage(num_stages):
    costs = [(0.5, 1.0), (1.0, 2.0), (0.3, 0.6), (1.2, 2.0), (0.7, 1.4), (2.0, 4.0)]
    profiles = [LayerProfile(forward_s=f, backward_s=b, param_bytes=10, activation_bytes=1) for f, b in costs]
    plan = partition_with_stage_count(profiles, num_stages)
    expect = _brute_force_largest(profiles, num_stages)
    if expect is None:
        assert plan is None
        return
    assert stage_count(plan) == num_stages
    plan.validate(len(profiles))
    fwd, bwd = schedule_ranges(plan)
    largest = max([sum(profiles[i].forward_s for i in r) for r in fwd]
                  + [sum(profiles[i].forward_s + profiles[i].backward_s for i in r) for r in bwd])
    assert largest == pytest.approx(expect)
    assert build_roundpipe_plan(build_stages(fwd, bwd, fused_tail=True), 3, 4)  # a runnable plan


def test_partition_with_stage_count_respects_the_memory_budget():
    """8 layers of 100 weight bytes, a 410-byte budget: a backward stage holds one layer (weights and
    gradients: 300 bytes; two layers: 500), so the tail is the last layer and the 7 layers before it
    are 7 backward stages; a forward stage holds at most 4 layers (402 bytes), so 7 layers need 2
    forward stages: 10 stages at least, where without the budget 8 exist."""
    profiles = [LayerProfile(forward_s=1.0, backward_s=2.0, param_bytes=100, activation_bytes=1) for _ in range(8)]
    budget = 410
    assert partition_with_stage_count(profiles, 8) is not None
    assert partition_with_stage_count(profiles, 8, stage_memory_bytes=budget) is None
    plan = partition_with_stage_count(profiles, 10, stage_memory_bytes=budget)
    assert stage_count(plan) == 10
    assert all(stage_memory(profiles, r, "forward") <= budget for r in plan.forward_stages[:-1])
    assert all(stage_memory(profiles, r, "backward") <= budget for r in plan.backward_stages)
    assert partition_with_stage_count(profiles, 16) is None  # 8 layers: at most 15 stages
    with pytest.raises(ValueError, match="`num_stages` must be a positive int"):
        partition_with_stage_count(profiles, 0)


def test_filling_stage_counts():
    assert filling_stage_counts(11, 8) == [8, 16]
    assert filling_stage_counts(5, 8) == [8]
    assert filling_stage_counts(16, 8) == []  # already fills the devices
    assert filling_stage_counts(5, 2) == [4, 6]
    assert filling_stage_counts(7, 1) == []


def test_the_choice_fills_the_devices_when_the_simulator_says_it_is_faster():
    """Qwen3-1.7B on 8 RTX 4090-like devices, 16 microbatches, sync optimizer: the partitioner's own
    cut (11 stages) leaves 3 devices with two stages per step; 16 stages fill them. The choice is the
    candidate the simulator, run on each candidate directly, times fastest."""
    hw = HardwareModel(flops_per_s=330e12, h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9, h2d_duplex_bytes_per_s=13e9)
    mp = model_profiles(preset_config("qwen3-1.7b"), hw, seq_len=2048, microbatch_size=4)
    candidates = candidate_partitions(mp.profiles, 8, 12 * 2**30, saved_activation_bytes=mp.saved_activation_bytes)
    labels = [label for label, _ in candidates]
    assert labels[:2] == ["optimal", "paper"] and any(stage_count(p) % 8 == 0 for _, p in candidates)
    opt_bytes = optimizer_step_bytes(1_720_000_000)
    direct = {label: simulate_training(partition_stages(p), 8, 16, mp.profiles, hw, optimizer="sync",
                                       optimizer_bytes=opt_bytes).step_s for label, p in candidates}
    choice = choose_for_mode(candidates, mp.profiles, hw, 8, 16, optimizer="sync", optimizer_bytes=opt_bytes)
    assert choice.prediction.step_s == pytest.approx(min(direct.values()))
    assert choice.label == min(direct, key=direct.get)
    assert stage_count(choice.partition) % 8 == 0  # the simulator says filling the devices is faster here
    assert direct[choice.label] < 0.95 * direct["optimal"]


def test_runtime_choice_offers_stage_counts_that_fill_the_devices(monkeypatch):
    """The automatic choice at run time lists the filling partitions among its candidates: with a
    simulator that times a multiple of the devices fastest (the oracle), it picks one."""
    import torch

    from lightning_roundpipe.adapters import make_layer_sequence
    from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
    from lightning_roundpipe.runtime.tuning import autopartition
    from _helpers import tiny_hf

    from lightning_roundpipe.partition import auto_partition

    engine = RoundPipeEngine(make_layer_sequence(tiny_hf(layers=9)), [torch.device("cpu")] * 3, 6,
                             auto_partition_after_steps=2)
    try:
        engine.info = lambda message: None
        engine._last_call, engine._last_sizes = (6, True), [1] * 6
        profiles = [LayerProfile(forward_s=1.0, backward_s=2.0, param_bytes=1000, activation_bytes=100)
                    for _ in range(len(engine.seq))]
        base = auto_partition(profiles, 3, autopartition.stage_budget(engine))
        offered = autopartition.filling_candidates(profiles, 3, autopartition.stage_budget(engine), base)
        assert offered and all(stage_count(p) % 3 == 0 for p in offered)
        keys = {(p.forward_stages, p.backward_stages) for p in offered}
        monkeypatch.setattr(autopartition, "simulated_step_s", lambda e, p, prof, per_round=None, count=None:
                            1.0 if (p.forward_stages, p.backward_stages) in keys else 2.0)
        choice = autopartition.choose_partition(engine, profiles)
        assert (choice.partition.forward_stages, choice.partition.backward_stages) in keys
        assert choice.simulated_s == 1.0
    finally:
        engine.close()
