"""Lowering compute plans to stream programs (``schedule.lower`` and ``schedule.program``).

In the style of ``torch.distributed.pipelining``'s schedule tests: the expected per-device,
per-stream op lists of small cases are written out by hand as string tables, from the rules of
``lower.py``'s module docstring (never computed by the code under test). ``test_lower_properties.py``
then checks larger plans against the same rules: the stream contents, per-stream counts, the exact dependency
edges, and, with a reachability computed here (a plain walk over stream order and edges,
independent of ``StreamProgram``'s own walk and vector clocks), that every read follows its write
and that no device ever holds more than ``plan.max_resident_stages`` stages.
"""

from __future__ import annotations

from lightning_roundpipe.schedule.lower import lower
from lightning_roundpipe.schedule.plan import ExecutionPlan
from lightning_roundpipe.schedule.program import Op, OpKind, StreamProgram
from lightning_roundpipe.schedule.roundpipe import build_roundpipe_plan, build_stages

from _lower_oracle import _all_edges, _check_program, _dev, _plan_strings, _sorted_values


# ===================================================================== 1. hand-written tables
def _fused_stages():
    return build_stages([range(0, 2), range(2, 4)], [range(3, 4), range(1, 3), range(0, 1)], fused_tail=True)


def _main_plan() -> ExecutionPlan:
    return build_roundpipe_plan(_fused_stages(), 2, 3)


def _main_program(recompute: str | None = None, validate: bool = True) -> StreamProgram:
    return lower(_main_plan(), stage_weight_bytes=[100] * 5, stage_grad_bytes=[0, 0, 11, 12, 13], chunk_bytes=40,
                 recompute=recompute, validate=validate)


# 2 devices, 3 microbatches; stages 0F(0..1) 1F(2..3) 2X(3) 3B(1..2) 4B(0); 3 chunks per LOAD
MAIN_PLAN = [
    "0LOAD 2LOAD 0F0 0F1 0F2 0DROP 4LOAD 2X0 2X1 2X2 2DROP 4B0 4B1 4B2 4DROP".split(),
    "1LOAD 3LOAD 1F0 1F1 1F2 1DROP 3B0 3B1 3B2 3DROP".split(),
]
MAIN_TABLE = [
    _dev(weights="0LOAD.c0 0LOAD.c1 0LOAD.c2 2LOAD.c0 2LOAD.c1 2LOAD.c2 4LOAD.c0 4LOAD.c1 4LOAD.c2",
         h2d="0H2D0 0H2D1 0H2D2 2H2D0 2H2D1 2H2D2 4H2D0 4GH2D0 4H2D1 4GH2D1 4H2D2 4GH2D2",
         compute="0F0 0F1 0F2 2X0 2X1 2X2 4R0 4B0 4R1 4B1 4R2 4B2",
         d2h="0D2H0 0D2H1 0D2H2 0DROP 2D2H0 2D2H1 2D2H2 2WD2H 2DROP 4D2H0 4D2H1 4D2H2 4WD2H 4DROP"),
    _dev(weights="1LOAD.c0 1LOAD.c1 1LOAD.c2 3LOAD.c0 3LOAD.c1 3LOAD.c2",
         h2d="1H2D0 1H2D1 1H2D2 3H2D0 3GH2D0 3H2D1 3GH2D1 3H2D2 3GH2D2",
         compute="1F0 1F1 1F2 3R0 3B0 3R1 3B1 3R2 3B2",
         d2h="1D2H0 1D2H1 1D2H2 1DROP 3D2H0 3D2H1 3D2H2 3WD2H 3DROP"),
]
MAIN_EDGES = {
    # the first F waits for its input upload and the last chunk of its weights; later Fs only for
    # their upload (the chunks are before the first F on the stream)
    "0F0": ["0H2D0", "0LOAD.c2"],
    "0F2": ["0H2D2"],
    "0H2D0": [],  # the batch comes from the host
    # an F's H2D waits for the previous forward stage's D2H (host round trip, other device)
    "1H2D0": ["0D2H0"],
    "1H2D2": ["0D2H2"],
    "1F0": ["1H2D0", "1LOAD.c2"],
    "1F1": ["1H2D1"],
    # the fused tail (layer 3): input saved by forward stage 1 (layers 2..3)
    "2H2D0": ["1D2H0"],
    "2X0": ["2H2D0", "2LOAD.c2"],
    "2X1": ["2H2D1"],
    "2D2H1": ["2X1"],
    # early recompute: R waits only for its saved input (layer 1, saved by stage 0) and weights
    "3H2D0": ["0D2H0"],
    "3R0": ["3H2D0", "3LOAD.c2"],
    "3R1": ["3H2D1"],
    # B waits for its incoming gradient, uploaded after the previous backward stage's D2H
    "3B0": ["3GH2D0"],
    "3GH2D0": ["2D2H0"],
    "3GH2D2": ["2D2H2"],
    "3D2H2": ["3B2"],
    "4H2D1": [],  # layer 0's input: the batch, from the host
    "4R0": ["4H2D0", "4LOAD.c2"],
    "4GH2D2": ["3D2H2"],
    "4B2": ["4GH2D2"],
    # WD2H and DROP after the stage's last microbatch
    "0DROP": ["0F2"],
    "1DROP": ["1F2"],
    "2WD2H": ["2X2"],
    "2DROP": ["2X2"],
    "3WD2H": ["3B2"],
    "3DROP": ["3B2"],
    "4WD2H": ["4B2"],
    "4DROP": ["4B2"],
    # the first LOAD waits for nothing; prefetch chunk i waits for the current stage's i-th upload
    "0LOAD.c0": [],
    "0LOAD.c2": [],
    "2LOAD.c0": ["0H2D0"],
    "2LOAD.c1": ["0H2D1"],
    "2LOAD.c2": ["0H2D2"],
    "3LOAD.c1": ["1H2D1"],
    # a LOAD's first chunk also waits for the DROP two stages back on the device (its room)
    "4LOAD.c0": ["0DROP", "2H2D0"],
    "4LOAD.c1": ["2H2D1"],
    "4LOAD.c2": ["2H2D2"],
}


def test_main_case_table_and_edges():
    program = _main_program()
    assert _plan_strings(program.plan) == MAIN_PLAN
    assert program.recompute == "early"  # the default for RoundPipe plans
    assert program.as_strings() == MAIN_TABLE
    for op, edges in MAIN_EDGES.items():
        assert program.edges_of(op) == sorted(edges), op
        assert program.edges_of(Op.parse(op)) == sorted(edges)
    # bytes: 100 in chunks of at most 40; gradients as given
    assert [op.nbytes for op in program.streams[0]["weights"][:3]] == [40, 40, 20]
    wd2h = {str(op): op.nbytes for per in program.streams for op in per["d2h"] if op.kind is OpKind.WD2H}
    assert wd2h == {"2WD2H": 11, "3WD2H": 12, "4WD2H": 13}
    assert program.chunk_bytes == 40


def test_main_case_late_recompute_waits_for_gradient():
    program = _main_program(recompute="late")
    assert program.recompute == "late"
    assert program.as_strings() == MAIN_TABLE  # same streams, one more edge per R
    late = dict(MAIN_EDGES)
    late.update({"3R0": ["3GH2D0", "3H2D0", "3LOAD.c2"], "3R1": ["3GH2D1", "3H2D1"],
                 "4R0": ["4GH2D0", "4H2D0", "4LOAD.c2"], "4R2": ["4GH2D2", "4H2D2"]})
    for op, edges in late.items():
        assert program.edges_of(op) == sorted(edges), op
    assert program.edges_of("2X0") == ["2H2D0", "2LOAD.c2"]  # X is never recomputed


def test_main_case_no_recompute_structure():
    # recompute="none": no R; the B itself waits for input, gradient and weights
    program = _main_program(recompute="none", validate=False)
    table = [dict(MAIN_TABLE[0]), dict(MAIN_TABLE[1])]
    table[0]["compute"] = "0F0 0F1 0F2 2X0 2X1 2X2 4B0 4B1 4B2".split()
    table[1]["compute"] = "1F0 1F1 1F2 3B0 3B1 3B2".split()
    assert program.as_strings() == table
    assert program.edges_of("3B0") == ["3GH2D0", "3H2D0", "3LOAD.c2"]
    assert program.edges_of("3B1") == ["3GH2D1", "3H2D1"]
    assert program.edges_of("4B0") == ["4GH2D0", "4H2D0", "4LOAD.c2"]


def test_main_case_no_recompute_validates():
    # (at HEAD 418033c this raised: required_predecessors listed every B as its own predecessor)
    program = _main_program(recompute="none")
    assert program.validate() is program
    _check_program(program, program.plan, [100] * 5, [0, 0, 11, 12, 13], 40, "none")


def test_single_device_full_table():
    # one device, 2 microbatches; stages 0F(0..1) 1X(1) 2B(0); 100/50/30 bytes in 40-byte chunks
    stages = build_stages([range(0, 2)], [range(1, 2), range(0, 1)], fused_tail=True)
    plan = build_roundpipe_plan(stages, 1, 2)
    assert _plan_strings(plan) == ["0LOAD 1LOAD 0F0 0F1 0DROP 2LOAD 1X0 1X1 1DROP 2B0 2B1 2DROP".split()]
    program = lower(plan, stage_weight_bytes=[100, 50, 30], stage_grad_bytes=[0, 8, 9], chunk_bytes=40)
    assert program.as_strings() == [
        _dev(weights="0LOAD.c0 0LOAD.c1 0LOAD.c2 1LOAD.c0 1LOAD.c1 2LOAD.c0",
             h2d="0H2D0 0H2D1 1H2D0 1H2D1 2H2D0 2GH2D0 2H2D1 2GH2D1",
             compute="0F0 0F1 1X0 1X1 2R0 2B0 2R1 2B1",
             d2h="0D2H0 0D2H1 0DROP 1D2H0 1D2H1 1WD2H 1DROP 2D2H0 2D2H1 2WD2H 2DROP"),
    ]
    assert _all_edges(program) == _sorted_values({
        "0F0": ["0H2D0", "0LOAD.c2"], "0F1": ["0H2D1"],
        "0D2H0": ["0F0"], "0D2H1": ["0F1"], "0DROP": ["0F1"],
        "1LOAD.c0": ["0H2D0"], "1LOAD.c1": ["0H2D1"],
        "1H2D0": ["0D2H0"], "1H2D1": ["0D2H1"],
        "1X0": ["1H2D0", "1LOAD.c1"], "1X1": ["1H2D1"],
        "1D2H0": ["1X0"], "1D2H1": ["1X1"], "1WD2H": ["1X1"], "1DROP": ["1X1"],
        # one chunk: it waits for its room (0DROP) and the first upload of stage 1
        "2LOAD.c0": ["0DROP", "1H2D0"],
        "2R0": ["2H2D0", "2LOAD.c0"], "2R1": ["2H2D1"],
        "2GH2D0": ["1D2H0"], "2GH2D1": ["1D2H1"],
        "2B0": ["2GH2D0"], "2B1": ["2GH2D1"],
        "2D2H0": ["2B0"], "2D2H1": ["2B1"], "2WD2H": ["2B1"], "2DROP": ["2B1"],
    })
    assert [op.nbytes for op in program.streams[0]["weights"]] == [40, 40, 20, 40, 10, 30]


def _unfused_program() -> StreamProgram:
    stages = build_stages([range(0, 2), range(2, 4)], [range(2, 4), range(0, 2)], fused_tail=False)
    plan = build_roundpipe_plan(stages, 2, 2)
    return lower(plan, stage_weight_bytes=[80, 40, 41, 0], stage_grad_bytes=[0, 0, 41, 7], chunk_bytes=40)


def test_unfused_full_table_gradient_after_the_last_forward():
    # stages 0F(0..1) 1F(2..3) 2B(2..3) 3B(0..1); 80/40/41/0 bytes in 40-byte chunks: 2, 1, 2, 1
    program = _unfused_program()
    assert _plan_strings(program.plan) == ["0LOAD 2LOAD 0F0 0F1 0DROP 2B0 2B1 2DROP".split(),
                                           "1LOAD 3LOAD 1F0 1F1 1DROP 3B0 3B1 3DROP".split()]
    assert program.as_strings() == [
        _dev(weights="0LOAD.c0 0LOAD.c1 2LOAD.c0 2LOAD.c1",
             h2d="0H2D0 0H2D1 2H2D0 2GH2D0 2H2D1 2GH2D1",
             compute="0F0 0F1 2R0 2B0 2R1 2B1",
             d2h="0D2H0 0D2H1 0DROP 2D2H0 2D2H1 2WD2H 2DROP"),
        _dev(weights="1LOAD.c0 3LOAD.c0",
             h2d="1H2D0 1H2D1 3H2D0 3GH2D0 3H2D1 3GH2D1",
             compute="1F0 1F1 3R0 3B0 3R1 3B1",
             d2h="1D2H0 1D2H1 1DROP 3D2H0 3D2H1 3WD2H 3DROP"),
    ]
    assert _all_edges(program) == _sorted_values({
        "0F0": ["0H2D0", "0LOAD.c1"], "0F1": ["0H2D1"], "0D2H0": ["0F0"], "0D2H1": ["0F1"], "0DROP": ["0F1"],
        "2LOAD.c0": ["0H2D0"], "2LOAD.c1": ["0H2D1"],
        # stage 2 (layers 2..3) recomputes from layer 2's input: stage 0's output
        "2H2D0": ["0D2H0"], "2H2D1": ["0D2H1"],
        "2R0": ["2H2D0", "2LOAD.c1"], "2R1": ["2H2D1"],
        # the first backward stage (not fused): the host makes its gradient from the last forward
        # stage's output, so 2GH2D* waits for that download
        "2GH2D0": ["1D2H0"], "2GH2D1": ["1D2H1"],
        "2B0": ["2GH2D0"], "2B1": ["2GH2D1"],
        "2D2H0": ["2B0"], "2D2H1": ["2B1"], "2WD2H": ["2B1"], "2DROP": ["2B1"],
        "1H2D0": ["0D2H0"], "1H2D1": ["0D2H1"],
        "1F0": ["1H2D0", "1LOAD.c0"], "1F1": ["1H2D1"], "1D2H0": ["1F0"], "1D2H1": ["1F1"], "1DROP": ["1F1"],
        "3LOAD.c0": ["1H2D0"],
        "3R0": ["3H2D0", "3LOAD.c0"], "3R1": ["3H2D1"],
        "3GH2D0": ["2D2H0"], "3GH2D1": ["2D2H1"],
        "3B0": ["3GH2D0"], "3B1": ["3GH2D1"],
        "3D2H0": ["3B0"], "3D2H1": ["3B1"], "3WD2H": ["3B1"], "3DROP": ["3B1"],
    })
    assert program.edges_of("2GH2D0") == ["1D2H0"] and program.edges_of("2GH2D1") == ["1D2H1"]
    chunks = {str(op): op.nbytes for per in program.streams for op in per["weights"]}
    assert chunks == {"0LOAD.c0": 40, "0LOAD.c1": 40, "2LOAD.c0": 40, "2LOAD.c1": 1, "1LOAD.c0": 40, "3LOAD.c0": 0}
    wd2h = {str(op): op.nbytes for per in program.streams for op in per["d2h"] if op.kind is OpKind.WD2H}
    assert wd2h == {"2WD2H": 41, "3WD2H": 7}


def test_transparent_backward_phase_inputs_from_host():
    # plan.phase("backward") on its own: the saved inputs come from the host (no H2D edge); the
    # backward stage 4 is prefetched at once (stage 2 holds the other slot)
    phase = _main_plan().phase("backward")
    assert _plan_strings(phase) == ["2LOAD 4LOAD 2X0 2X1 2X2 2DROP 4B0 4B1 4B2 4DROP".split(),
                                    "3LOAD 3B0 3B1 3B2 3DROP".split()]
    program = lower(phase, stage_weight_bytes=[100] * 5, chunk_bytes=40)
    assert program.as_strings() == [
        _dev(weights="2LOAD.c0 2LOAD.c1 2LOAD.c2 4LOAD.c0 4LOAD.c1 4LOAD.c2",
             h2d="2H2D0 2H2D1 2H2D2 4H2D0 4GH2D0 4H2D1 4GH2D1 4H2D2 4GH2D2",
             compute="2X0 2X1 2X2 4R0 4B0 4R1 4B1 4R2 4B2",
             d2h="2D2H0 2D2H1 2D2H2 2WD2H 2DROP 4D2H0 4D2H1 4D2H2 4WD2H 4DROP"),
        _dev(weights="3LOAD.c0 3LOAD.c1 3LOAD.c2",
             h2d="3H2D0 3GH2D0 3H2D1 3GH2D1 3H2D2 3GH2D2",
             compute="3R0 3B0 3R1 3B1 3R2 3B2",
             d2h="3D2H0 3D2H1 3D2H2 3WD2H 3DROP"),
    ]
    for op in ("2H2D0", "2H2D2", "3H2D0", "3H2D1", "4H2D0"):
        assert program.edges_of(op) == [], op
    assert program.edges_of("2X0") == ["2H2D0", "2LOAD.c2"]
    assert program.edges_of("3R0") == ["3H2D0", "3LOAD.c2"]
    assert program.edges_of("3GH2D1") == ["2D2H1"]
    assert program.edges_of("4GH2D0") == ["3D2H0"]
    # no DROP before stage 4's LOAD on device 0: only the activation-priority edges
    assert [program.edges_of(f"4LOAD.c{c}") for c in range(3)] == [["2H2D0"], ["2H2D1"], ["2H2D2"]]
    assert [op.nbytes for op in program.streams[0]["d2h"] if op.kind is OpKind.WD2H] == [0, 0]


def test_rounds_table_round_suffixes():
    # rounds of 2 microbatches on 2 devices: round 1 continues the rotation (stage 0 on device 1)
    plan = build_roundpipe_plan(_fused_stages(), 2, 4, microbatches_per_round=2)
    assert _plan_strings(plan) == [
        "0LOAD 2LOAD 0F0 0F1 0DROP 4LOAD 2X0 2X1 2DROP 1LOAD 4B0 4B1 4DROP 3LOAD 1F2 1F3 1DROP 3B2 3B3 3DROP".split(),
        "1LOAD 3LOAD 1F0 1F1 1DROP 0LOAD 3B0 3B1 3DROP 2LOAD 0F2 0F3 0DROP 4LOAD 2X2 2X3 2DROP 4B2 4B3 4DROP".split(),
    ]
    program = lower(plan, stage_weight_bytes=[40, 40, 40, 40, 80], chunk_bytes=40)
    assert program.as_strings() == [
        _dev(weights="0LOAD.c0 2LOAD.c0 4LOAD.c0 4LOAD.c1 1LOAD.c0@1 3LOAD.c0@1",
             h2d="0H2D0 0H2D1 2H2D0 2H2D1 4H2D0 4GH2D0 4H2D1 4GH2D1 1H2D2 1H2D3 3H2D2 3GH2D2 3H2D3 3GH2D3",
             compute="0F0 0F1 2X0 2X1 4R0 4B0 4R1 4B1 1F2 1F3 3R2 3B2 3R3 3B3",
             d2h="0D2H0 0D2H1 0DROP 2D2H0 2D2H1 2WD2H 2DROP 4D2H0 4D2H1 4WD2H 4DROP"
                 " 1D2H2 1D2H3 1DROP@1 3D2H2 3D2H3 3WD2H@1 3DROP@1"),
        _dev(weights="1LOAD.c0 3LOAD.c0 0LOAD.c0@1 2LOAD.c0@1 4LOAD.c0@1 4LOAD.c1@1",
             h2d="1H2D0 1H2D1 3H2D0 3GH2D0 3H2D1 3GH2D1 0H2D2 0H2D3 2H2D2 2H2D3 4H2D2 4GH2D2 4H2D3 4GH2D3",
             compute="1F0 1F1 3R0 3B0 3R1 3B1 0F2 0F3 2X2 2X3 4R2 4B2 4R3 4B3",
             d2h="1D2H0 1D2H1 1DROP 3D2H0 3D2H1 3WD2H 3DROP 0D2H2 0D2H3 0DROP@1"
                 " 2D2H2 2D2H3 2WD2H@1 2DROP@1 4D2H2 4D2H3 4WD2H@1 4DROP@1"),
    ]
    edges = {
        # round 1 of stage 1 on device 0: room is 2DROP (released just before it in the plan); its
        # single chunk waits for the first upload of stage 4, which runs before it
        "1LOAD.c0@1": ["2DROP", "4H2D0"],
        "1F2": ["1H2D2", "1LOAD.c0@1"],
        "1H2D2": ["0D2H2"],
        "1DROP@1": ["1F3"],
        "3LOAD.c0@1": ["1H2D2", "4DROP"],
        "3R2": ["3H2D2", "3LOAD.c0@1"],
        "3WD2H@1": ["3B3"],
        "0LOAD.c0@1": ["1DROP", "3H2D0"],
        "0F2": ["0H2D2", "0LOAD.c0@1"],
        "4LOAD.c0@1": ["0DROP@1", "2H2D2"],
        "4LOAD.c1@1": ["2H2D3"],
        "4R2": ["4H2D2", "4LOAD.c1@1"],
        "4GH2D2": ["3D2H2"],
        "2H2D2": ["1D2H2"],
    }
    for op, want in edges.items():
        assert program.edges_of(op) == sorted(want), op
    rounds = {(op.stage_index, op.round_index) for per in program.streams for op in per["weights"]}
    assert rounds == {(s, r) for s in range(5) for r in range(2)}
