"""Baseline plans with weight binding (GPipe, 1F1B, interleaved 1F1B, looped BFS, ZB-H1)."""

from __future__ import annotations

import pytest

from lightning_roundpipe.schedule.baselines import (
    BASELINE_BUILDERS,
    MULTI_CHUNK_BASELINES,
    balanced_stage_layers,
    bound_stages,
    build_baseline_plan,
    build_gpipe_plan,
    build_interleaved_1f1b_plan,
    build_zb_h1_plan,
    megatron_stage_layers,
    virtual_stage_of,
)
from lightning_roundpipe.schedule.ir import Action, ActionKind
from lightning_roundpipe.schedule.plan import PlanValidationError
from lightning_roundpipe.schedule.roundpipe import build_roundpipe_plan, build_stages


def _one_layer_stages(n: int) -> tuple[range, ...]:
    return tuple(range(i, i + 1) for i in range(n))


CASES = [
    (name, devices, microbatches, chunks)
    for name in BASELINE_BUILDERS
    for devices in (1, 2, 3, 4, 8)
    for microbatches in (1, 2, 3, 4, 5, 8, 9, 16)
    for chunks in ((1, 2, 3) if name in MULTI_CHUNK_BASELINES else (1,))
    # ScheduleInterleaved1F1B runs max(1, M // D) equal rounds of microbatches
    if not (name == "interleaved_1f1b" and microbatches % max(1, microbatches // devices))
]


@pytest.mark.parametrize("name,devices,microbatches,chunks", CASES)
def test_baseline_plans_validate_and_bind_weights(name, devices, microbatches, chunks):
    n = devices * chunks
    plan = build_baseline_plan(name, _one_layer_stages(n), devices, microbatches, recompute=True)
    assert plan.validate() is plan
    assert plan.num_devices == devices and plan.num_microbatches == microbatches
    assert plan._meta["weight_binding"] and plan._meta["recompute"] and plan._meta["schedule"] == name
    assert len(plan.stages) == 2 * n
    for d, acts in enumerate(plan.actions):
        compute = [a for a in acts if a.kind.is_compute]
        # weight binding: virtual stage v lives on device v mod D, forward and backward alike
        assert {virtual_stage_of(plan, a.stage_index) % devices for a in compute} == {d}
        # weights resident for the whole step: all LOADs first, all DROPs last
        loads = [i for i, a in enumerate(acts) if a.kind is ActionKind.LOAD]
        drops = [i for i, a in enumerate(acts) if a.kind is ActionKind.DROP]
        assert loads == list(range(2 * chunks))
        assert drops == list(range(len(acts) - 2 * chunks, len(acts)))
        per_kind = {k: sum(a.kind is k for a in compute) for k in (ActionKind.F, ActionKind.B, ActionKind.W)}
        assert per_kind[ActionKind.F] == per_kind[ActionKind.B] == chunks * microbatches
        assert per_kind[ActionKind.W] == (chunks * microbatches if name == "zb_h1" else 0)


def test_bound_stages_pair_forward_and_backward():
    stages = bound_stages([range(0, 2), range(2, 3), range(3, 6)])
    assert [s.kind for s in stages] == ["forward"] * 3 + ["backward"] * 3
    assert [s.layers for s in stages[3:]] == [range(3, 6), range(2, 3), range(0, 2)]
    assert not any(s.fused for s in stages)


@pytest.mark.parametrize("bad", [[], [range(1, 2)], [range(0, 2), range(3, 4)], [range(0, 0)]])
def test_bound_stages_rejects_bad_ranges(bad):
    with pytest.raises(ValueError, match="stage_layers"):
        bound_stages(bad)


def test_gpipe_order_and_grid():
    plan = build_gpipe_plan(_one_layer_stages(2), 2, 3)
    dev0 = [str(a) for a in plan.actions[0] if a.kind.is_compute]
    assert dev0 == ["0F0", "0F1", "0F2", "3B0", "3B1", "3B2"]
    assert "1F2" in plan.format_grid()


def test_1f1b_warmup_depth():
    plan = build_baseline_plan("1f1b", _one_layer_stages(4), 4, 8)
    for d, acts in enumerate(plan.actions):
        kinds = [a.kind for a in acts if a.kind.is_compute]
        first_b = kinds.index(ActionKind.B)
        assert first_b == 4 - d  # D - 1 - rank warmup forwards, then one more forward before the first B


def test_zb_h1_weight_gradients_follow_their_input_gradients():
    plan = build_zb_h1_plan(_one_layer_stages(4), 4, 6)
    for acts in plan.actions:
        seen_b = set()
        for a in acts:
            if a.kind is ActionKind.B:
                seen_b.add((a.stage_index, a.microbatch_index))
            if a.kind is ActionKind.W:
                assert (a.stage_index, a.microbatch_index) in seen_b
    w = Action(5, ActionKind.W, 2)
    assert plan.dependencies(w) == (Action(5, ActionKind.B, 2),)


def test_baseline_errors_name_the_problem():
    with pytest.raises(ValueError, match="exactly 4 stages"):
        build_gpipe_plan(_one_layer_stages(3), 4, 2)
    with pytest.raises(ValueError, match="multiple of `num_devices`"):
        build_baseline_plan("looped_bfs", _one_layer_stages(5), 2, 2)
    with pytest.raises(ValueError, match="rounds"):
        build_interleaved_1f1b_plan(_one_layer_stages(8), 4, 9)
    with pytest.raises(ValueError, match="Unknown baseline `pipedream`"):
        build_baseline_plan("pipedream", _one_layer_stages(2), 2, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        build_gpipe_plan(_one_layer_stages(2), 2, 0)


def test_balanced_stage_layers():
    assert balanced_stage_layers([1.0] * 8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    # the heavy last layer (an LM head) gets a stage of its own
    assert balanced_stage_layers([1.0, 1.0, 1.0, 3.0], 2) == (range(0, 3), range(3, 4))
    # ties put the larger stages last (next to the LM head)
    assert [len(r) for r in balanced_stage_layers([1.0] * 5, 3)] == [1, 2, 2]
    with pytest.raises(ValueError, match="num_stages"):
        balanced_stage_layers([1.0, 1.0], 3)
    with pytest.raises(ValueError, match="costs_s"):
        balanced_stage_layers([1.0, -1.0], 1)


def test_megatron_layout_even_when_it_divides():
    costs = [0.0] + [1.0] * 8 + [2.5]  # embedding, 8 decoder layers, LM head
    assert megatron_stage_layers(costs, 4) == (range(0, 3), range(3, 5), range(5, 7), range(7, 10))
    # 8 layers over 3 stages do not divide: balanced layout instead
    assert megatron_stage_layers(costs, 3) == balanced_stage_layers(costs, 3)


def test_fused_tail_plans_validate_with_forward_stages_stopping_before_the_tail():
    stages = build_stages([range(0, 3), range(3, 5)], [range(5, 6), range(3, 5), range(0, 3)], fused_tail=True)
    plan = build_roundpipe_plan(stages, 2, 3)
    assert plan.stages[2].fused and plan.dependencies(Action(2, ActionKind.X, 1)) == (Action(1, ActionKind.F, 1),)
    # a forward stage ending inside the tail is still rejected
    bad = build_stages([range(0, 3), range(3, 4)], [range(5, 6), range(3, 5), range(0, 3)], fused_tail=True)
    with pytest.raises(PlanValidationError):
        build_roundpipe_plan(bad, 2, 3)
