"""Lowering, larger plans (``schedule.lower`` and ``schedule.program``): property tests against the rules of
``lower.py``'s module docstring (the oracle in ``_lower_oracle.py``), required edges removed one at a time,
bad input, and the baselines' plans lowered. The hand-written tables of small cases are in ``test_lower.py``.
"""
from __future__ import annotations

import math
import random
import re

import pytest

from lightning_roundpipe.schedule.baselines import build_baseline_plan
from lightning_roundpipe.schedule.ir import ActionKind
from lightning_roundpipe.schedule.lower import lower, required_predecessors
from lightning_roundpipe.schedule.plan import ExecutionPlan, PlanValidationError
from lightning_roundpipe.schedule.program import STREAMS, Op, OpKind, StreamProgram
from lightning_roundpipe.schedule.roundpipe import build_roundpipe_plan, build_stages, default_stage_ranges

from _lower_oracle import _check_program, _reachability
from test_lower import MAIN_TABLE, _fused_stages, _main_plan, _main_program, _unfused_program


# ============================================================================ 2. property tests
PROPERTY_CASES = [(D, M) for D in range(1, 5) for M in range(1, 2 * D + 2)]


def _bytes(rng: random.Random, plan: ExecutionPlan):
    weights = [rng.choice([0, rng.randint(1, 400), rng.randint(1, 40)]) for _ in plan.stages]
    grads = [rng.randint(0, 300) if s.kind == "backward" else 0 for s in plan.stages]
    return weights, grads, rng.randint(1, 90)


@pytest.mark.parametrize("rounds", [False, True], ids=["one_round", "rounds_of_D"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("D,M", PROPERTY_CASES)
def test_lowering_properties(D, M, fused, rounds):
    for L in (2, 4, 7):
        stages = build_stages(*default_stage_ranges(L), fused_tail=fused)
        for prefetch in ((True, False) if L == 4 else (True,)):
            for recompute in (("early", "late") if L == 7 else ("early",)):
                rng = random.Random(f"{D}-{M}-{L}-{fused}-{rounds}-{prefetch}-{recompute}")
                cursor = rng.randrange(D)
                plan = build_roundpipe_plan(stages, D, M, cursor=cursor, prefetch=prefetch,
                                            microbatches_per_round=D if rounds else None)
                assert plan.max_resident_stages == (2 if prefetch else 1)
                weights, grads, chunk = _bytes(rng, plan)
                program = lower(plan, stage_weight_bytes=weights, stage_grad_bytes=grads, chunk_bytes=chunk,
                                recompute=None if recompute == "early" else recompute)
                _check_program(program, plan, weights, grads, chunk, recompute)
                # round suffixes: per-stage ops of round r >= 1 carry "@r"; per-microbatch ops never
                n_rounds = math.ceil(M / D) if rounds else 1
                flat = [x for per in program.as_strings() for s in STREAMS for x in per[s]]
                suffixed = {x for x in flat if "@" in x}
                assert all(re.fullmatch(r"\d+(LOAD\.c\d+|WD2H|DROP)@[1-9]\d*", x) for x in suffixed)
                want = {f"{s.stage_index}DROP@{r}" for s in stages for r in range(1, n_rounds)}
                assert {x for x in suffixed if "DROP" in x and "WD2H" not in x} == want
                assert {x for x in suffixed if "LOAD.c0@" in x} == {w.replace("DROP", "LOAD.c0") for w in want}
                assert {x for x in flat if x.endswith("DROP")} == {f"{s.stage_index}DROP" for s in stages}


@pytest.mark.parametrize("D,M", [(1, 3), (2, 4), (3, 2)])
def test_transparent_phases_properties(D, M):
    plan = build_roundpipe_plan(build_stages(*default_stage_ranges(7), fused_tail=True), D, M, cursor=D - 1)
    for kind in ("forward", "backward"):
        phase = plan.phase(kind)
        weights = [100 + 7 * s for s in range(len(phase.stages))]
        grads = [13 * s for s in range(len(phase.stages))]
        program = lower(phase, stage_weight_bytes=weights, stage_grad_bytes=grads, chunk_bytes=64)
        _check_program(program, phase, weights, grads, 64, "early")
        if kind == "backward":
            # nothing forward runs in this program: every saved input comes from the host
            for per in program.streams:
                assert all(program.edges_of(op) == [] for op in per["h2d"] if op.kind is OpKind.H2D)


def test_default_bytes_one_empty_chunk_per_load():
    plan = build_roundpipe_plan(build_stages(*default_stage_ranges(4), fused_tail=True), 2, 3)
    program = lower(plan)
    _check_program(program, plan, [0] * len(plan.stages), None, program.chunk_bytes, "early")
    assert program.chunk_bytes == 64 * 2**20
    for per in program.streams:
        assert all(op.chunk_index == 0 and op.nbytes == 0 for op in per["weights"])
        assert all(op.nbytes == 0 for op in per["d2h"] if op.kind is OpKind.WD2H)


@pytest.mark.parametrize("L,D,M", [(2, 3, 4), (3, 4, 5), (1, 2, 3)])
def test_rounds_stage_count_divides_devices(L, D, M):
    """A device that gets the same stage in two consecutive rounds loads it again after the DROP
    (no prefetch of a stage that is still resident)."""
    stages = build_stages(*default_stage_ranges(L), fused_tail=True)
    assert D % len(stages) == 0
    plan = build_roundpipe_plan(stages, D, M, microbatches_per_round=D)
    program = lower(plan, stage_weight_bytes=[10] * len(stages), chunk_bytes=4)
    for acts in plan.actions:
        resident: set[int] = set()
        for a in acts:
            if a.kind is ActionKind.LOAD:
                assert a.stage_index not in resident
                resident.add(a.stage_index)
            elif a.kind is ActionKind.DROP:
                resident.discard(a.stage_index)
    assert program.topological_order()


# ================================================================== 3. removing required edges
def _small_programs():
    return {
        "main": _main_program(),
        "unfused": _unfused_program(),
        "rounds": lower(build_roundpipe_plan(_fused_stages(), 2, 4, microbatches_per_round=2),
                        stage_weight_bytes=[100, 40, 80, 40, 120], chunk_bytes=40),
        "no_prefetch": lower(build_roundpipe_plan(_fused_stages(), 2, 2, prefetch=False),
                             stage_weight_bytes=[100] * 5, chunk_bytes=40),
    }


# Required edges of the main program that other edges and stream order imply as well (so removing
# one alone is accepted): a DROP / WD2H sits on the d2h stream after the D2H of the stage's last
# microbatch, which waits for that compute; and device 1 uploads 1H2Dm (after 0D2Hm) before 3H2Dm.
MAIN_IMPLIED = {
    ("0DROP", "0F2"), ("1DROP", "1F2"), ("2WD2H", "2X2"), ("2DROP", "2X2"), ("3WD2H", "3B2"),
    ("3DROP", "3B2"), ("4WD2H", "4B2"), ("4DROP", "4B2"),
    ("3H2D0", "0D2H0"), ("3H2D1", "0D2H1"), ("3H2D2", "0D2H2"),
}


@pytest.mark.parametrize("name", ["main", "unfused", "rounds", "no_prefetch"])
def test_removing_a_required_edge_is_refused(name):
    program = _small_programs()[name]
    refused, implied, optional = 0, set(), 0
    for consumer, producers in program.deps.items():
        required = required_predecessors(program, consumer)
        for producer in producers:
            reduced = program.without_edge(consumer, producer)
            assert producer not in reduced.deps.get(consumer, ())
            if producer not in required:
                # only activation-priority edges (a chunk waiting for an activation upload) are optional
                assert consumer.kind is OpKind.LOAD and producer.kind in (OpKind.H2D, OpKind.GH2D)
                assert reduced.validate() is reduced
                optional += 1
                continue
            still = _reachability(program, drop=(consumer, producer))(producer, consumer)
            if still:
                assert reduced.validate() is reduced
                implied.add((str(consumer), str(producer)))
                continue
            with pytest.raises(PlanValidationError) as info:
                reduced.validate()
            message = str(info.value)
            assert f"missing edge `{producer}` -> `{consumer}`" in message
            assert f">{consumer}<" in message  # the grid marks the failing op
            assert "dev0/weights" in message and "dev1/d2h" in message
            refused += 1
    assert refused >= 25
    # without prefetch a LOAD comes right before its stage's computes: no priority edges
    assert (optional == 0) if name == "no_prefetch" else (optional >= 1)
    if name == "main":
        assert implied == MAIN_IMPLIED
        assert refused == 54 and optional == 9


def test_priority_edges_are_optional_all_at_once():
    program = _main_program()
    deps = {op: tuple(p for p in ps if not (op.kind is OpKind.LOAD and p.kind in (OpKind.H2D, OpKind.GH2D)))
            for op, ps in program.deps.items()}
    stripped = StreamProgram(program.plan, program.streams, deps, program.chunk_bytes, program.recompute)
    assert stripped.validate() is stripped
    assert stripped.edges_of("4LOAD.c0") == ["0DROP"] and stripped.edges_of("2LOAD.c1") == []


def test_missing_edge_message_names_it():
    program = _main_program()
    with pytest.raises(PlanValidationError, match=r"`3R0` may start before `3H2D0` finishes") as info:
        program.without_edge("3R0", "3H2D0").validate()
    assert ">3R0<" in str(info.value)
    with pytest.raises(PlanValidationError, match=r"missing edge `0DROP` -> `4LOAD\.c0`"):
        program.without_edge("4LOAD.c0", "0DROP").validate()
    with pytest.raises(KeyError, match="no edge"):
        program.without_edge("3R0", "0F0")


# ========================================================================== 4. bad input
@pytest.mark.parametrize("chunk_bytes", [0, -1, 1.5, True, "64"])
def test_bad_chunk_bytes(chunk_bytes):
    with pytest.raises(ValueError, match="chunk_bytes"):
        lower(_main_plan(), chunk_bytes=chunk_bytes)


def test_bad_recompute_and_byte_lists():
    plan = _main_plan()
    with pytest.raises(ValueError, match="recompute"):
        lower(plan, recompute="sometimes")
    with pytest.raises(ValueError, match="stage_weight_bytes"):
        lower(plan, stage_weight_bytes=[1, 2, 3])
    with pytest.raises(ValueError, match="stage_grad_bytes"):
        lower(plan, stage_grad_bytes=[1] * 6)


def test_op_parse_round_trips_every_op():
    for program in _small_programs().values():
        for _, _, _, op in program.ops():
            text = str(op)
            assert Op.parse(text) == op and str(Op.parse(text)) == text
    assert Op.parse("0LOAD.c2@3") == Op(OpKind.LOAD, 0, None, 2, 3)
    assert Op.parse(" 12GH2D10 ") == Op(OpKind.GH2D, 12, 10)
    assert str(Op(OpKind.DROP, 5, round_index=1)) == "5DROP@1"


@pytest.mark.parametrize("text", ["", "F1", "3Q1", "3f1", "3F", "3H2D", "0LOAD", "0LOAD.c", "3DROP5", "3WD2H1",
                                  "3F1.c2", "3 F1", "3F-1", "-3F1", "x3F1", "0LOAD.c1.c2", "3DROP@"])
def test_op_parse_rejects_garbage(text):
    with pytest.raises(ValueError):
        Op.parse(text)


def test_op_parse_rejects_round_on_microbatch_op():
    with pytest.raises(ValueError):
        Op.parse("3F1@1")


def _replace(program: StreamProgram, streams=None, deps=None) -> StreamProgram:
    return StreamProgram(program.plan, program.streams if streams is None else streams,
                         program.deps if deps is None else deps, program.chunk_bytes, program.recompute)


def test_validate_refuses_edge_to_unknown_op():
    program = _main_program()
    deps = dict(program.deps)
    deps[Op.parse("1F1")] = deps[Op.parse("1F1")] + (Op.parse("0F7"),)
    with pytest.raises(PlanValidationError, match=r"`1F1` waits for `0F7`, which no stream runs") as info:
        _replace(program, deps=deps).validate()
    assert ">1F1<" in str(info.value)


def test_validate_refuses_op_on_wrong_stream():
    program = _main_program()
    streams = [dict(per) for per in program.streams]
    moved = Op.parse("0H2D1")
    streams[0]["h2d"] = tuple(op for op in streams[0]["h2d"] if op != moved)
    streams[0]["weights"] = streams[0]["weights"] + (moved,)
    with pytest.raises(PlanValidationError, match=r"`0H2D1` sits on stream `weights`, its kind runs on `h2d`") as info:
        _replace(program, streams=tuple(streams)).validate()
    assert ">0H2D1<" in str(info.value)


def test_validate_refuses_duplicate_op():
    program = _main_program()
    streams = [dict(per) for per in program.streams]
    streams[1]["compute"] = streams[1]["compute"] + (Op.parse("1F0"),)
    with pytest.raises(PlanValidationError, match="`1F0` appears twice"):
        _replace(program, streams=tuple(streams)).validate()


def test_validate_refuses_deadlock():
    program = _main_program()
    deps = dict(program.deps)
    # 0F0 waits for 0D2H2, which waits for 0F2, which comes after 0F0 on the compute stream
    deps[Op.parse("0F0")] = deps[Op.parse("0F0")] + (Op.parse("0D2H2"),)
    bad = _replace(program, deps=deps)
    with pytest.raises(PlanValidationError, match="deadlock") as info:
        bad.validate()
    message = str(info.value)
    assert "dev0/compute: `0F0` waits for ['0D2H2']" in message
    marked = re.search(r">(\d+[A-Za-z0-9.@]+)<", message)  # a blocked stream head marked in the grid
    assert marked and f"`{marked.group(1)}` waits for" in message
    with pytest.raises(PlanValidationError, match="deadlock"):
        _replace(program, deps=deps).topological_order()


def test_validate_returns_program_and_lower_validate_flag():
    unchecked = _main_program(validate=False)
    assert unchecked.validate() is unchecked
    assert unchecked.as_strings() == MAIN_TABLE


# ============================================================================= 5. baselines
BASELINE_CASES = [(name, D, M) for name in ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "looped_bfs")
                  for D in (1, 2, 3) for M in (1, 2, 3, 4, 6)
                  if not (name == "interleaved_1f1b" and M % max(1, M // D))]


def _baseline(name: str, D: int, M: int, recompute: bool) -> ExecutionPlan:
    chunks = 2 if name in ("interleaved_1f1b", "looped_bfs") else 1
    return build_baseline_plan(name, [range(i, i + 1) for i in range(D * chunks)], D, M, recompute=recompute)


@pytest.mark.parametrize("name,D,M", BASELINE_CASES)
def test_baselines_lower_late_recompute(name, D, M):
    plan = _baseline(name, D, M, recompute=True)
    rng = random.Random(f"{name}-{D}-{M}")
    weights, grads, chunk = _bytes(rng, plan)
    program = lower(plan, stage_weight_bytes=weights, stage_grad_bytes=grads, chunk_bytes=chunk)
    assert program.recompute == "late"  # bound baselines with _meta["recompute"] default to "late"
    _check_program(program, plan, weights, grads, chunk, "late")
    for per in program.streams:
        compute = per["compute"]
        for i, op in enumerate(compute):
            if op.kind is OpKind.B:
                assert compute[i - 1] == Op(OpKind.R, op.stage_index, op.microbatch_index)
            if op.kind is OpKind.R:
                assert Op(OpKind.GH2D, op.stage_index, op.microbatch_index) in program.deps[op]
    n_w = sum(op.kind is OpKind.W for per in program.streams for op in per["compute"])
    assert n_w == (len(plan.stages) // 2 * M if name == "zb_h1" else 0)


@pytest.mark.parametrize("name,D,M", [c for c in BASELINE_CASES if c[1] == 2])
def test_baselines_without_recompute_structure(name, D, M):
    plan = _baseline(name, D, M, recompute=False)
    weights = [30 + s for s in range(len(plan.stages))]
    program = lower(plan, stage_weight_bytes=weights, chunk_bytes=16)
    assert program.recompute == "none"  # _meta["recompute"] False -> no R ops
    _check_program(program, plan, weights, None, 16, "none")
    assert not any(op.kind is OpKind.R for per in program.streams for op in per["compute"])
    for per in program.streams:
        for op in per["compute"]:
            if op.kind is OpKind.B:
                deps = set(program.deps[op])
                assert {Op(OpKind.H2D, op.stage_index, op.microbatch_index),
                        Op(OpKind.GH2D, op.stage_index, op.microbatch_index)} <= deps


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "looped_bfs"])
def test_baselines_without_recompute_validate(name):
    # (at HEAD 418033c this raised: required_predecessors listed every B as its own predecessor)
    program = lower(_baseline(name, 2, 4, recompute=False))
    assert program.recompute == "none" and program.validate() is program
