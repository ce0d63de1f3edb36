"""The plan: IR, round-robin builder, validation and the grid."""

import itertools

import pytest

from lightning_roundpipe.schedule import (
    Action, ActionKind, ExecutionPlan, PlanValidationError, StageSpec, build_roundpipe_plan, build_stages,
    default_stage_ranges, plan_next_cursor, walk_in_order,
)


def test_action_string_form_roundtrip():
    for text in ["3F1", "0LOAD", "12DROP", "4B0", "7X3", "2W5"]:
        assert str(Action.parse(text)) == text
    assert Action.parse("3F1") == Action(3, ActionKind.F, 1)
    with pytest.raises(ValueError, match="Cannot parse"):
        Action.parse("F3")
    with pytest.raises(ValueError, match="microbatch_index"):
        Action(1, ActionKind.F)
    with pytest.raises(ValueError, match="takes no"):
        Action(1, ActionKind.LOAD, 0)


@pytest.mark.parametrize("num_layers,num_devices,num_microbatches", list(itertools.product([1, 2, 5, 7, 30], [1, 2, 3, 8], [1, 2, 4, 9])))
def test_roundpipe_plan_table(num_layers, num_devices, num_microbatches):
    fwd, bwd = default_stage_ranges(num_layers)
    stages = build_stages(fwd, bwd)
    for cursor in range(num_devices):
        plan = build_roundpipe_plan(stages, num_devices, num_microbatches, cursor=cursor)
        n = len(stages)
        # round robin: stage k on device (cursor + k) mod D, all microbatches in order before the next stage
        for k in range(n):
            assert plan.device_of(k) == (cursor + k) % num_devices
        for d, acts in enumerate(plan.actions):
            compute = [a for a in acts if a.kind.is_compute]
            expected = [Action(s.stage_index, s.compute_kind, m) for s in stages
                        if (cursor + s.stage_index) % num_devices == d for m in range(num_microbatches)]
            assert compute == expected
        assert plan_next_cursor(plan) == (cursor + n) % num_devices
        # every (stage, microbatch) exactly once over all devices
        done = [a for acts in plan.actions for a in acts if a.kind.is_compute]
        assert len(done) == len(set(done)) == n * num_microbatches
        # forward stages tile in order; backward stages from the end
        assert [r.start for r in fwd] == sorted(r.start for r in fwd) and fwd[0].start == 0
        assert bwd[0].stop == num_layers and bwd[-1].start == 0
        # the dependency walk finishes (validate() ran it) and respects data dependencies
        finished = {a: end for _, a, _, end in walk_in_order(plan, lambda a: 1.0)}
        for a in done:
            for dep in plan.dependencies(a):
                assert finished[dep] <= finished[a] - 1.0


def test_cursor_carries_over():
    stages = build_stages(*default_stage_ranges(4))  # 2 forward + 4 backward stages
    first = build_roundpipe_plan(stages, 4, 2, cursor=0)
    second = build_roundpipe_plan(stages, 4, 2, cursor=plan_next_cursor(first))
    assert second.device_of(0) == 6 % 4


def test_phase_split():
    plan = build_roundpipe_plan(build_stages(*default_stage_ranges(5)), 3, 4)
    fwd, bwd = plan.phase("forward"), plan.phase("backward")
    assert all(plan.stages[a.stage_index].kind == "forward" for acts in fwd.actions for a in acts)
    assert all(plan.stages[a.stage_index].kind == "backward" for acts in bwd.actions for a in acts)
    assert sum(map(len, fwd.actions)) + sum(map(len, bwd.actions)) == sum(map(len, plan.actions))


def test_grid_shows_bubbles():
    plan = build_roundpipe_plan(build_stages(*default_stage_ranges(3)), 2, 2)
    grid = plan.format_grid()
    lines = grid.splitlines()
    assert lines[0].split() == ["step", "|", "dev0", "dev1"]
    assert "0F0" in lines[2] and "0F1" in grid and "3B1" in grid


def _plan(actions, stages=None, m=2):
    stages = stages or build_stages([range(0, 2)], [range(1, 2), range(0, 1)])
    return ExecutionPlan(stages, tuple(tuple(Action.parse(a) for a in dev) for dev in actions), m)


@pytest.mark.parametrize("actions,match", [
    # device 1 waits on backward stage 1 before device 0 ran forward: fine; but here device 0 runs
    # stage 2 (needs stage 1) before stage 0 (which stage 1 needs): deadlock
    ([["2LOAD", "2B0", "2B1", "2DROP", "0LOAD", "0F0", "0F1", "0DROP"], ["1LOAD", "1B0", "1B1", "1DROP"]], "deadlock"),
    ([["0LOAD", "0F0", "0F1", "0DROP"], ["1LOAD", "1B0", "1B1", "1DROP", "2LOAD", "2B0", "2DROP"]], "microbatch 1 runs 0 times"),
    ([["0LOAD", "0F0", "0F1", "0F1", "0DROP"], ["1LOAD", "1B0", "1B1", "1DROP", "2LOAD", "2B0", "2B1", "2DROP"]], "runs 2 times"),
    ([["0LOAD", "0F0", "0F1"], ["1LOAD", "1B0", "1B1", "1DROP", "2LOAD", "2B0", "2B1", "2DROP"]], "never released"),
    ([["0F0", "0F1"], ["1LOAD", "1B0", "1B1", "1DROP", "2LOAD", "2B0", "2B1", "2DROP"]], "without its weights"),
    ([["0LOAD", "0B0", "0B1", "0DROP"], ["1LOAD", "1B0", "1B1", "1DROP", "2LOAD", "2B0", "2B1", "2DROP"]], "has kind B"),
    ([["0LOAD", "1LOAD", "2LOAD", "0F0", "0F1", "0DROP", "1B0", "1B1", "1DROP", "2B0", "2B1", "2DROP"]], "holds 3 stages"),
])
def test_bad_plan_fails_with_grid(actions, match):
    with pytest.raises(PlanValidationError, match=match) as info:
        _plan(actions).validate()
    assert "step | dev0" in str(info.value)  # the grid is in the message


def test_bad_stage_tiling():
    stages = (StageSpec(0, "forward", range(0, 2)), StageSpec(1, "forward", range(3, 4)))
    with pytest.raises(PlanValidationError, match="tile"):
        ExecutionPlan(stages, ((Action(0, ActionKind.LOAD), Action(0, ActionKind.F, 0), Action(0, ActionKind.DROP),
                                Action(1, ActionKind.LOAD), Action(1, ActionKind.F, 0), Action(1, ActionKind.DROP)),), 1).validate()


@pytest.mark.parametrize("kw,match", [(dict(num_devices=0), "num_devices"), (dict(num_microbatches=0), "num_microbatches")])
def test_builder_rejects_bad_sizes(kw, match):
    args = dict(stages=build_stages(*default_stage_ranges(3)), num_devices=2, num_microbatches=2)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        build_roundpipe_plan(**args)
