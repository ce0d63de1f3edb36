"""The simulator: analytic cases and oracles over the stream program, steady state, the paper's table."""

from __future__ import annotations

import csv
import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from lightning_roundpipe.cli import main as cli_main
from lightning_roundpipe.metrics.timeline import Timeline
from lightning_roundpipe.partition.profile import HardwareModel, LayerProfile
from lightning_roundpipe.schedule.baselines import build_1f1b_plan, build_gpipe_plan, build_zb_h1_plan
from lightning_roundpipe.schedule.ir import Action, ActionKind
from lightning_roundpipe.schedule.lower import lower
from lightning_roundpipe.schedule.plan import ExecutionPlan, StageSpec
from lightning_roundpipe.schedule.program import Op, OpKind, StreamProgram
from lightning_roundpipe.schedule.roundpipe import build_roundpipe_plan, build_stages
from lightning_roundpipe.simulate.table import build_schedule_plan, layer_profiles
from lightning_roundpipe.simulate import (
    PAPER_DATA_FILES,
    SimulationResult,
    format_table,
    paper_data_path,
    read_layer_timings,
    simulate,
    simulate_program,
)

CHUNK_S = 64 * 2**20 / 1e9  # one default 64 MiB weight chunk at 1 GB/s, seconds
EPS = 1e-12


def _layers(n: int, f: float = 1.0, b: float = 2.0, param_bytes: int = 0, act_bytes: int = 0) -> list[LayerProfile]:
    return [LayerProfile(forward_s=f, backward_s=b, param_bytes=param_bytes, activation_bytes=act_bytes) for _ in range(n)]


def _one_layer_stages(n: int) -> tuple[range, ...]:
    return tuple(range(i, i + 1) for i in range(n))


def _hw(h2d: float = 1e9, d2h: float = 1e9, duplex: float | None = None) -> HardwareModel:
    return HardwareModel(flops_per_s=1e12, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, h2d_duplex_bytes_per_s=duplex)


def _by_label(res: SimulationResult) -> dict[str, object]:
    return {iv.label: iv for iv in res.timeline.intervals}


# ---------------------------------------------------------------------------------------- analytic
@pytest.mark.parametrize("devices,microbatches", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 16), (3, 7)])
@pytest.mark.parametrize("builder", [build_gpipe_plan, build_1f1b_plan])
def test_uniform_pipeline_bubble_is_textbook(builder, devices, microbatches):
    f, b = 1.0, 2.0
    plan = builder(_one_layer_stages(devices), devices, microbatches)
    res = simulate(plan, _layers(devices, f, b))
    assert isinstance(res, SimulationResult) and isinstance(res.timeline, Timeline)
    assert res.iteration_s == pytest.approx((microbatches + devices - 1) * (f + b))
    expected = 100.0 * (devices - 1) / (microbatches + devices - 1)
    assert res.mean_idle_pct == pytest.approx(expected)
    assert all(c == pytest.approx(microbatches * (f + b)) for c in res.compute_s)


def test_baseline_recompute_adds_a_forward_except_for_the_lm_head():
    plan = build_gpipe_plan(_one_layer_stages(2), 2, 1, recompute=True)
    res = simulate(plan, _layers(2, 1.0, 2.0))
    # device 0: F 1 + R 1 + B 2; device 1 holds the last layer (LM head): a bound baseline keeps its
    # activations (Megatron-LM, the paper's artifact), so its R costs nothing
    assert res.compute_s == pytest.approx((4.0, 3.0))
    assert {iv.kind for iv in res.timeline.intervals if iv.device_index == 0} >= {"F", "R", "B"}
    assert simulate(plan, _layers(2), recompute=False).compute_s == pytest.approx((3.0, 3.0))


def test_roundpipe_without_fused_tail_recomputes_every_layer_of_a_stage():
    """The runtime's R re-runs all the stage's layers, the LM head included when no fused tail holds it."""
    stages = build_stages([range(0, 2)], [range(0, 2)], fused_tail=False)
    res = simulate(build_roundpipe_plan(stages, 1, 1), _layers(2, 1.0, 2.0))
    assert sum(res.compute_s) == pytest.approx(2.0 + 2.0 + 4.0)  # F, R (both layers), B


def test_activation_hop_costs_comm_per_hop():
    stages = (StageSpec(0, "forward", range(0, 1)), StageSpec(1, "forward", range(1, 2)))
    acts = ((Action(0, ActionKind.LOAD), Action(0, ActionKind.F, 0), Action(0, ActionKind.DROP)),
            (Action(1, ActionKind.LOAD), Action(1, ActionKind.F, 0), Action(1, ActionKind.DROP)))
    plan = ExecutionPlan(stages, acts, 1).validate()
    res = simulate(plan, _layers(2, 1.0, 0.0), comm_s_per_hop=0.25)
    # one hop (D2H on dev0, H2D on dev1); the batch upload and the last download talk to the host only
    assert res.iteration_s == pytest.approx(2.25)
    spans = _by_label(res)
    assert spans["0D2H0"].device_index == 0 and spans["0D2H0"].duration_s == pytest.approx(0.125)
    assert spans["1H2D0"].device_index == 1 and spans["1H2D0"].duration_s == pytest.approx(0.125)
    assert "0H2D0" not in spans and "1D2H0" not in spans
    assert {(iv.stream, iv.kind) for iv in res.timeline.intervals} == {("compute", "F"), ("d2h", "D2H"), ("h2d", "H2D")}


def test_weight_upload_time_is_param_bytes_over_h2d():
    stages = (StageSpec(0, "forward", range(0, 2)),)
    plan = ExecutionPlan(stages, ((Action(0, ActionKind.LOAD), Action(0, ActionKind.F, 0), Action(0, ActionKind.DROP)),), 1)
    res = simulate(plan.validate(), _layers(2, 0.5, 0.0, param_bytes=250_000_000), _hw())
    assert res.iteration_s == pytest.approx(0.5 + 1.0)
    assert res.timeline.transfer_bytes(0, "H2D") == 500_000_000
    chunks = [iv for iv in res.timeline.intervals if iv.stream == "weights"]
    assert len(chunks) == 8 and chunks[0].label == "0LOAD.c0" and chunks[0].duration_s == pytest.approx(CHUNK_S)


def test_one_device_forward_stages_take_the_sum_of_their_compute():
    """Oracle (a): one device, forward stages only, free transfers: iteration = sum of compute."""
    prof = [LayerProfile(forward_s=0.1 * (i + 1), backward_s=0.0, param_bytes=10**9, activation_bytes=10**6)
            for i in range(6)]
    stages = build_stages([range(0, 1), range(1, 3), range(3, 6)], ())
    for prefetch in (True, False):
        res = simulate(build_roundpipe_plan(stages, 1, 3, prefetch=prefetch), prof)
        assert res.iteration_s == pytest.approx(3 * sum(p.forward_s for p in prof))
        assert res.mean_idle_pct == pytest.approx(0.0, abs=1e-9)


def _two_stage_one_device(prefetch: bool) -> SimulationResult:
    # each stage: F = 0.5 s; its weights 5e8 bytes = 0.5 s at 1 GB/s, as long as the other's compute
    stages = build_stages([range(0, 1), range(1, 2)], ())
    prof = _layers(2, 0.5, 0.0, param_bytes=500_000_000)
    return simulate(build_roundpipe_plan(stages, 1, 1, prefetch=prefetch), prof, _hw())


def test_prefetch_overlaps_the_next_load_with_the_current_compute():
    """Oracle (b): LOAD1 (0.5 s) runs under F0 (0.5 s): LOAD0 + max(F0, LOAD1) + F1 = 1.5 s."""
    load = compute = 0.5
    back_to_back = _two_stage_one_device(prefetch=False)
    assert back_to_back.iteration_s == pytest.approx(2 * (load + compute))
    overlapped = _two_stage_one_device(prefetch=True)
    assert overlapped.iteration_s < 2 * (load + compute)
    assert overlapped.iteration_s == pytest.approx(load + max(compute, load) + compute)
    spans = overlapped.timeline.intervals
    f0 = next(iv for iv in spans if iv.label == "0F0")
    load1 = [iv for iv in spans if iv.label.startswith("1LOAD")]
    assert f0.start_s == pytest.approx(load) and min(iv.start_s for iv in load1) == pytest.approx(load)
    assert max(iv.end_s for iv in load1) == pytest.approx(f0.end_s)


def _priority_case():
    """dev1 uploads stage 1 (1 MB), then prefetches stage 2 (1 GB, 15 chunks); the activation from
    dev0 is on the host at 12 ms."""
    stages = tuple(StageSpec(i, "forward", range(i, i + 1)) for i in range(3))
    load = lambda s: Action(s, ActionKind.LOAD)  # noqa: E731
    drop = lambda s: Action(s, ActionKind.DROP)  # noqa: E731
    fwd = lambda s: Action(s, ActionKind.F, 0)  # noqa: E731
    plan = ExecutionPlan(stages, ((load(0), fwd(0), drop(0)), (load(1), load(2), fwd(1), drop(1), fwd(2), drop(2))),
                         1).validate()
    prof = [
        LayerProfile(forward_s=0.010, backward_s=0.0, param_bytes=1_000_000, activation_bytes=0),
        LayerProfile(forward_s=0.010, backward_s=0.0, param_bytes=1_000_000, activation_bytes=1_000_000),
        LayerProfile(forward_s=0.010, backward_s=0.0, param_bytes=1_000_000_000, activation_bytes=1_000_000),
    ]
    return plan, prof, _hw()


def test_activation_priority_edge_and_chunk_granularity():
    plan, prof, hw = _priority_case()
    program = lower(plan, stage_weight_bytes=[1_000_000, 1_000_000, 1_000_000_000])
    assert "1H2D0" in program.edges_of("2LOAD.c0")
    with_edge = simulate_program(program, prof, hw)
    spans = _by_label(with_edge)
    # F0 ends at 11 ms, its D2H 11-12 ms, the upload 12-13 ms ahead of the prefetch: F1 at 13 ms
    assert spans["1H2D0"].start_s == pytest.approx(0.012) and spans["1F0"].start_s == pytest.approx(0.013)
    # 2H2D0 (ready at 24 ms) waits for the chunk in flight (13 ms + one chunk), never preempts it
    assert spans["2H2D0"].start_s == pytest.approx(0.013 + CHUNK_S)
    assert with_edge.iteration_s == pytest.approx(0.013 + 1.0 + 0.001 + 0.010 + 0.001)
    # without the edge the prefetch takes the idle link at 1 ms; the activation waits for that chunk
    without = simulate_program(program.without_edge("2LOAD.c0", "1H2D0"), prof, hw)
    spans = _by_label(without)
    assert spans["2LOAD.c0"].start_s == pytest.approx(0.001)
    assert spans["1H2D0"].start_s == pytest.approx(0.001 + CHUNK_S)
    assert spans["1F0"].start_s == pytest.approx(0.002 + CHUNK_S)


def _small_roundpipe_with_bytes(devices: int = 2, microbatches: int = 3):
    fwd = (range(0, 2), range(2, 5))
    bwd = (range(5, 6), range(3, 5), range(0, 3))
    stages = build_stages(fwd, bwd, fused_tail=True)
    prof = [LayerProfile(forward_s=0.02 + 0.005 * i, backward_s=0.04 + 0.01 * i, param_bytes=90_000_000,
                         activation_bytes=8_000_000 + 10**6 * i) for i in range(6)]
    plan = build_roundpipe_plan(stages, devices, microbatches)
    return plan, prof, _hw(h2d=20e9, d2h=20e9, duplex=12e9)


def _priority_edges(program: StreamProgram) -> list[tuple[Op, Op]]:
    return [(chunk, up) for chunk, deps in program.deps.items() if chunk.kind is OpKind.LOAD
            for up in deps if up.kind in (OpKind.H2D, OpKind.GH2D)]


def _upload_starts(res: SimulationResult) -> dict[str, float]:
    return {iv.label: iv.start_s for iv in res.timeline.intervals if iv.stream == "h2d"}


def test_removing_priority_edges_never_makes_an_upload_start_earlier():
    """Oracle (c), a monotonicity check on a small case: without the activation-priority edges a
    weight chunk may take the link first, so no activation upload starts earlier, and the protected
    one starts strictly later. (Not a theorem for every program: on a non-preemptive shared link a
    chunk let through right after the upload it waited for can block the next upload for a whole
    chunk, so the check is on a case small enough to follow by hand.)"""
    plan, prof, hw = _priority_case()
    program = lower(plan, stage_weight_bytes=[sum(prof[i].param_bytes for i in s.layers) for s in plan.stages])
    edges = _priority_edges(program)
    assert len(edges) == plan.num_microbatches
    stripped = program
    for chunk, upload in edges:
        stripped = stripped.without_edge(chunk, upload)
    assert not _priority_edges(stripped)
    with_edges = _upload_starts(simulate_program(program, prof, hw))
    without = _upload_starts(simulate_program(stripped, prof, hw))
    assert with_edges.keys() == without.keys()
    assert all(with_edges[label] <= without[label] + EPS for label in with_edges)
    assert all(with_edges[str(upload)] < without[str(upload)] - 1e-6 for _, upload in edges)


def _effective_end(op: Op, program: StreamProgram, spans: dict[str, object], memo: dict[Op, float]) -> float:
    """End of ``op``; for an op without interval (zero duration), the latest end of its predecessors
    (a lower bound of the instant it ran)."""
    if op not in memo:
        span = spans.get(str(op))
        memo[op] = span.end_s if span is not None else max(
            (_effective_end(p, program, spans, memo) for p in program.predecessors(op)), default=0.0)
    return memo[op]


@pytest.mark.parametrize("devices,microbatches", [(1, 2), (2, 3), (3, 5)])
def test_timeline_respects_resources_and_every_predecessor(devices, microbatches):
    """Oracle (d): per device one compute at a time, one transfer per link at a time; every op starts
    after all of ``program.predecessors(op)`` end; H2D-link rates follow the duplex rule."""
    plan, prof, hw = _small_roundpipe_with_bytes(devices, microbatches)
    program = lower(plan, stage_weight_bytes=[90_000_000 * len(s.layers) for s in plan.stages],
                    stage_grad_bytes=[0 if s.kind == "forward" else 90_000_000 * len(s.layers) for s in plan.stages])
    res = simulate_program(program, prof, hw)
    spans = _by_label(res)
    assert len(spans) == len(res.timeline.intervals)
    for device in range(devices):
        for link in ({"compute"}, {"weights", "h2d"}, {"d2h"}):
            mine = sorted((iv for iv in res.timeline.intervals if iv.device_index == device and iv.stream in link),
                          key=lambda iv: iv.start_s)
            assert all(a.end_s <= b.start_s + EPS for a, b in zip(mine, mine[1:])), (device, link)
    memo: dict[Op, float] = {}
    for label, span in spans.items():
        op = Op.parse(label)
        for pred in program.predecessors(op):
            assert span.start_s >= _effective_end(pred, program, spans, memo) - EPS, (label, str(pred))
    duplex_seen = False
    for span in res.timeline.intervals:
        if span.stream in ("weights", "h2d"):
            d2h_busy = any(o.device_index == span.device_index and o.stream == "d2h" and o.start_s <= span.start_s
                           < o.end_s for o in res.timeline.intervals)
            duplex_seen |= d2h_busy
            rate = hw.duplex_h2d_bytes_per_s if d2h_busy else hw.h2d_bytes_per_s
            assert span.duration_s == pytest.approx(span.nbytes / rate), span.label
    assert duplex_seen or devices > 1  # one device: the prefetch runs while gradients go down


def test_simulate_program_rejects_a_deadlocked_program():
    plan, prof, hw = _small_roundpipe_with_bytes(2, 2)
    program = lower(plan)
    first = program.streams[0]["compute"][0]
    last = program.streams[0]["d2h"][-1]
    deps = dict(program.deps)
    deps[first] = deps.get(first, ()) + (last,)
    stuck = StreamProgram(program.plan, program.streams, deps, program.chunk_bytes, program.recompute)
    with pytest.raises(ValueError, match="deadlocked.*HINT"):
        simulate_program(stuck, prof, hw)
    with pytest.raises(TypeError, match="StreamProgram"):
        simulate_program(plan, prof)


# ---------------------------------------------------------------------------------------- RoundPipe
def _roundpipe(num_layers: int = 9, devices: int = 4, microbatches: int = 4, per_round: int | None = None):
    fwd = tuple(range(i, min(i + 3, num_layers - 1)) for i in range(0, num_layers - 1, 3))
    bwd = (range(num_layers - 1, num_layers),) + tuple(range(i, i + 1) for i in reversed(range(num_layers - 1)))
    stages = build_stages(fwd, bwd, fused_tail=True)
    return stages, build_roundpipe_plan(stages, devices, microbatches, microbatches_per_round=per_round)


def test_roundpipe_costs_recompute_but_not_the_fused_tail():
    stages, plan = _roundpipe(num_layers=5, devices=2, microbatches=3)
    res = simulate(plan, _layers(5, 1.0, 2.0))
    # forward stages: 4 layers x F; tail (layer 4): F+B once; backward stages 0..3: recompute + B
    assert sum(res.compute_s) == pytest.approx(3 * (4 * 1.0 + 3.0 + 4 * 3.0))
    assert sum(iv.duration_s for iv in res.timeline.intervals if iv.kind == "R") == pytest.approx(3 * 4 * 1.0)


@pytest.mark.parametrize("per_round", [None, 2])
def test_steady_state_hides_fill_and_drain(per_round):
    stages, plan = _roundpipe(num_layers=9, devices=4, microbatches=4, per_round=per_round)
    prof = _layers(9, 1.0, 2.0)
    one = simulate(plan, prof)
    steady = simulate(plan, prof, steady_state=True)
    assert steady.num_iterations == 2
    assert steady.mean_idle_pct < one.mean_idle_pct
    assert steady.iteration_s < one.iteration_s
    assert steady.timeline.wall_s == pytest.approx(2 * steady.iteration_s)
    # the steady window holds (about) the work of its iterations
    work = sum(one.compute_s)
    assert sum(steady.compute_s) == pytest.approx(steady.num_iterations * work, rel=0.05)
    assert all(0.0 <= iv.start_s <= iv.end_s <= steady.timeline.wall_s + EPS for iv in steady.timeline.intervals)


def test_steady_state_needs_a_roundpipe_plan():
    plan = build_gpipe_plan(_one_layer_stages(2), 2, 2)
    with pytest.raises(ValueError, match=r"`steady_state=True`.*`gpipe`.*HINT"):
        simulate(plan, _layers(2), steady_state=True)
    hand = ExecutionPlan((StageSpec(0, "forward", range(0, 1)),),
                         ((Action(0, ActionKind.LOAD), Action(0, ActionKind.F, 0), Action(0, ActionKind.DROP)),), 1)
    with pytest.raises(ValueError, match="build_roundpipe_plan"):
        simulate(hand.validate(), _layers(1), steady_state=True)


def test_microbatch_rounds_do_the_same_work():
    stages, rounds = _roundpipe(num_layers=9, devices=4, microbatches=10, per_round=4)
    _, whole = _roundpipe(num_layers=9, devices=4, microbatches=10)
    res, ref = simulate(rounds, _layers(9)), simulate(whole, _layers(9))
    assert sum(res.compute_s) == pytest.approx(sum(ref.compute_s))  # same work, dispatched in rounds
    # every stage is loaded once per round: 3 rounds
    loads = [iv for iv in res.timeline.intervals if iv.stream == "weights"]
    assert not loads  # no weight bytes: free, no interval
    program = lower(rounds)
    assert sum(1 for _, _, _, op in program.ops() if op.kind is OpKind.LOAD) == 3 * len(stages)


@pytest.mark.parametrize("devices,microbatches", [(4, 8), (4, 16), (8, 16)])
def test_zb_h1_has_the_work_of_1f1b_and_a_third_of_its_bubble(devices, microbatches):
    prof = _layers(devices, 1.0, 2.0)  # F = B = W = 1 (W is half of the backward)
    zb = simulate(build_zb_h1_plan(_one_layer_stages(devices), devices, microbatches), prof)
    ob = simulate(build_1f1b_plan(_one_layer_stages(devices), devices, microbatches), prof)
    assert sum(zb.compute_s) == pytest.approx(sum(ob.compute_s))
    assert ob.iteration_s == pytest.approx(3 * microbatches + (devices - 1) * 3)
    assert zb.iteration_s == pytest.approx(3 * microbatches + (devices - 1) * 1)  # (D-1)(F+B-W)
    assert {i.kind for i in zb.timeline.intervals} >= {"F", "B", "W"}


def test_simulate_errors():
    plan = build_gpipe_plan(_one_layer_stages(2), 2, 2)
    with pytest.raises(TypeError, match="ExecutionPlan"):
        simulate("not a plan", _layers(2))
    with pytest.raises(TypeError, match="ExecutionPlan.*microbatches_per_round"):
        simulate([plan], _layers(2))
    with pytest.raises(ValueError, match="profiles"):
        simulate(plan, _layers(1))
    with pytest.raises(ValueError, match="comm_s_per_hop"):
        simulate(plan, _layers(2), comm_s_per_hop=-1.0)
    with pytest.raises(ValueError, match="weight_grad_fraction"):
        simulate(plan, _layers(2), weight_grad_fraction=1.5)
    with pytest.raises(ValueError, match="recompute"):
        simulate(plan, _layers(2), recompute="sometimes")
    _, rp = _roundpipe()
    with pytest.raises(ValueError, match="steady_iterations"):
        simulate(rp, _layers(9), steady_state=True, steady_iterations=2)


# ---------------------------------------------------------------------------------------- table / CLI
SMALL_CSV = """# tiny table
model,num_layers,fwd_ms_per_layer,bwd_ms_per_layer,lm_head_fwd_ms,lm_head_bwd_ms,comm_ms_per_hop
tiny,6,1.0,2.0,1.5,3.0,0.1
"""


def test_read_layer_timings_and_errors(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(SMALL_CSV)
    (t,) = read_layer_timings(p)
    assert t.model == "tiny" and t.num_layers == 6 and t.forward_s_per_layer == pytest.approx(1e-3)
    assert t.comm_s_per_hop == pytest.approx(1e-4)
    p.write_text("model,num_layers\nx,3\n")
    with pytest.raises(ValueError, match="lacks columns"):
        read_layer_timings(p)


HEADER = "model,num_layers,fwd_ms_per_layer,bwd_ms_per_layer,lm_head_fwd_ms,lm_head_bwd_ms,comm_ms_per_hop\n"


@pytest.mark.parametrize("row,column,needle", [
    ("bad,6,nan,2.0,1.5,3.0,0.1", "fwd_ms_per_layer", "finite number >= 0, got 'nan'"),
    ("bad,6,1.0,inf,1.5,3.0,0.1", "bwd_ms_per_layer", "finite number >= 0, got 'inf'"),
    ("bad,6,1.0,2.0,-1.5,3.0,0.1", "lm_head_fwd_ms", "finite number >= 0, got '-1.5'"),
    ("bad,6,1.0,2.0,1.5,3.0,-0.1", "comm_ms_per_hop", "finite number >= 0, got '-0.1'"),
    ("bad,0,1.0,2.0,1.5,3.0,0.1", "num_layers", "must be >= 1, got 0"),
    ("bad,-2,1.0,2.0,1.5,3.0,0.1", "num_layers", "must be >= 1, got -2"),
    ("bad,2.5,1.0,2.0,1.5,3.0,0.1", "num_layers", "integer >= 1, got '2.5'"),
    ("bad,6,x,2.0,1.5,3.0,0.1", "fwd_ms_per_layer", "number of milliseconds, got 'x'"),
    ("bad,6,1.0,2.0,1.5", "lm_head_bwd_ms", "is missing"),
])
def test_read_layer_timings_rejects_bad_values(tmp_path, row, column, needle):
    p = tmp_path / "t.csv"
    p.write_text(SMALL_CSV + row + "\n")
    with pytest.raises(ValueError) as e:
        read_layer_timings(p)
    msg = str(e.value)
    assert str(p) in msg and "line 4" in msg and "model 'bad'" in msg and f"`{column}`" in msg and needle in msg, msg
    assert "HINT" in msg


def test_read_layer_timings_rejects_duplicates_and_empty_rows(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(SMALL_CSV + "# another\ntiny,4,1,1,1,1,0\n")
    with pytest.raises(ValueError, match=r"Duplicate model 'tiny' in .*t\.csv, lines 3 and 5"):
        read_layer_timings(p)
    p.write_text(HEADER + ",4,1,1,1,1,0\n")
    with pytest.raises(ValueError, match="Empty `model`.*line 2"):
        read_layer_timings(p)
    p.write_text(HEADER + "zero,4,0,0,0,0,0\n")
    with pytest.raises(ValueError, match="No compute time.*model 'zero'"):
        read_layer_timings(p)
    p.write_text(HEADER)
    with pytest.raises(ValueError, match="has no rows"):
        read_layer_timings(p)
    p.write_text(HEADER + "ok,4,1,2,1,1,\n")  # empty comm: no hop cost
    assert read_layer_timings(p)[0].comm_s_per_hop is None


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_cli_rejects_non_finite_or_negative_times(tmp_path, capsys, value):
    p = tmp_path / "t.csv"
    p.write_text(SMALL_CSV + f"bad,6,{value},2.0,1.5,3.0,0.1\n")
    rc, out = _run_cli("--layer-timings", str(p), "--devices", "2", "--microbatches", "4")
    err = capsys.readouterr().err
    assert rc == 2 and out == ""
    assert err.startswith("roundpipe simulate: error: ") and len(err.strip().splitlines()) == 1
    assert "`fwd_ms_per_layer`" in err and "'bad'" in err and "t.csv" in err


def test_format_table_csv_shape():
    out = format_table({"gpipe": {"a": 12.345, "b": 1.0}, "1f1b": {"a": 2.0, "b": 3.0}}, "csv")
    assert out.splitlines() == ["schedule,a,b", "gpipe,12.3,1.0", "1f1b,2.0,3.0"]
    with pytest.raises(ValueError, match="fmt"):
        format_table({}, "xml")


def _run_cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli_main(["simulate", *argv])
    return rc, buf.getvalue()


def _parse_csv(text: str) -> dict[str, dict[str, float]]:
    rows = list(csv.reader(line for line in text.splitlines() if line and not line.startswith("#")))
    header = rows[0]
    return {r[0]: {m: float(v) for m, v in zip(header[1:], r[1:])} for r in rows[1:]}


def test_cli_small_table_and_plot(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(SMALL_CSV)
    png = tmp_path / "out" / "timeline.png"
    rc, out = _run_cli("--layer-timings", str(p), "--devices", "2", "--microbatches", "4", "--format", "csv",
                       "--plot", str(png))
    assert rc == 0
    table = _parse_csv(out)
    assert list(table) == ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "roundpipe_one_iteration",
                           "roundpipe_steady"]
    assert all(0.0 <= v < 100.0 for row in table.values() for v in row.values())
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, out = _run_cli("--layer-timings", str(p), "--devices", "2", "--microbatches", "4")
    assert rc == 0 and "roundpipe_steady" in out and "tiny" in out.splitlines()[0]


def test_cli_plot_draws_one_steady_iteration_beside_one_iteration_rows(tmp_path, monkeypatch):
    """The picture compares like with like: the steady-state panel is one iteration long (the window
    the simulator measures spans several), with the bubble table's per-iteration time."""
    import lightning_roundpipe.metrics.plot as plot_module

    drawn = {}
    monkeypatch.setattr(plot_module, "plot_timelines", lambda panels, path, **kw: drawn.update(panels) or Path(path))
    p = tmp_path / "t.csv"
    p.write_text(SMALL_CSV)
    rc, _ = _run_cli("--layer-timings", str(p), "--devices", "2", "--microbatches", "4", "--plot", str(tmp_path / "x.png"),
                     "--schedules", "roundpipe_one_iteration", "roundpipe_steady")
    assert rc == 0
    (steady_name,) = [name for name in drawn if "roundpipe_steady" in name]
    assert "one steady-state iteration" in steady_name
    one, steady = drawn["tiny roundpipe_one_iteration"], drawn[steady_name]
    timings = read_layer_timings(p)[0]
    plan = build_schedule_plan("roundpipe_steady", layer_profiles(timings), 2, 4)
    res = simulate(plan, layer_profiles(timings), comm_s_per_hop=timings.comm_s_per_hop, steady_state=True)
    assert res.num_iterations >= 2
    assert steady.wall_s == pytest.approx(res.iteration_s) and max(iv.end_s for iv in steady.intervals) <= res.iteration_s
    # steady state hides fill and drain: one steady iteration is no longer than the isolated iteration
    assert steady.wall_s <= one.span_s() * (1 + 1e-9)


def test_cli_marks_unbuildable_rows_na(tmp_path, capsys):
    p = tmp_path / "t.csv"
    p.write_text(SMALL_CSV)
    # interleaved 1F1B runs 7 // 3 = 2 rounds, which do not divide 7 microbatches
    rc, out = _run_cli("--layer-timings", str(p), "--devices", "3", "--microbatches", "7", "--format", "csv")
    assert rc == 0
    assert "interleaved_1f1b,n/a" in out and "looped_bfs,n/a" not in out
    assert "warning" in capsys.readouterr().err


@pytest.mark.parametrize("name,hint", [("nope", "leave it out to use the first row ('tiny')"),
                                       ("TINY", "did you mean 'tiny'?")])
def test_cli_checks_plot_model_before_simulating(tmp_path, capsys, monkeypatch, name, hint):
    """A `--plot-model` not in the timings is refused up front: nothing simulated, no table printed,
    nothing written; the error lists the models."""
    import lightning_roundpipe.cli.simulate_cmd as simulate_cmd

    def no_simulation(*args, **kwargs):
        raise AssertionError("the bubble table was simulated before --plot-model was checked")

    monkeypatch.setattr(simulate_cmd, "bubble_table", no_simulation)
    p = tmp_path / "t.csv"
    p.write_text(SMALL_CSV + "other,4,1.0,2.0,1.5,3.0,0.1\n")
    png, trace = tmp_path / "x.png", tmp_path / "x.json"
    rc, out = _run_cli("--layer-timings", str(p), "--devices", "2", "--microbatches", "4", "--plot", str(png),
                       "--trace", str(trace), "--plot-model", name)
    err = capsys.readouterr().err
    assert rc == 2 and out == "" and not png.exists() and not trace.exists()
    assert err.startswith("roundpipe simulate: error: `--plot-model` must be one of the models of t.csv:")
    assert "['tiny', 'other']" in err and repr(name) in err and f"HINT: {hint}" in err


def test_cli_bad_input_exits_2(tmp_path, capsys):
    rc, _ = _run_cli("--layer-timings", str(tmp_path / "missing.csv"))
    err = capsys.readouterr().err
    assert rc == 2 and "error" in err and "no file" in err and "HINT: `paper`" in err  # was a bare [Errno 2]
    rc, out = _run_cli("--layer-timings", "Paper", "--devices", "2", "--microbatches", "3")  # any case
    assert rc == 0 and "roundpipe_steady" in out
    rc, _ = _run_cli("--layer-timings", "paper", "--devices", "0")
    assert rc == 2 and "HINT:" in capsys.readouterr().err


def test_reproduces_the_papers_bubble_table():
    """ACCEPTANCE: every cell of paper_simulated_bubbles.csv within 5 percentage points (packaged data)."""
    rc, out = _run_cli("--layer-timings", "paper", "--devices", "8", "--microbatches", "16", "--format", "csv")
    assert rc == 0
    assert "per-layer times of paper_layer_timings_4090.csv" in out
    ours = _parse_csv(out)
    paper = _parse_csv(paper_data_path("simulated_bubbles").read_text())
    assert list(next(iter(ours.values()))) == list(next(iter(paper.values())))  # same model columns, same order
    for schedule, row in paper.items():
        for model, value in row.items():
            assert ours[schedule][model] == pytest.approx(value, abs=5.0), (schedule, model)


def test_paper_data_is_packaged():
    """The reference tables ship inside the package (no file outside the repository is needed)."""
    root = Path(__file__).resolve().parents[1] / "lightning_roundpipe"
    for name in PAPER_DATA_FILES:
        path = paper_data_path(name)
        assert path.is_file() and path.parent == root / "simulate" / "data", path
    assert paper_data_path("layer_timings_4090") == paper_data_path("paper_layer_timings_4090.csv")
    assert "2604.27085" in paper_data_path("README.md").read_text()
    assert len(read_layer_timings(paper_data_path())) == 5
    with pytest.raises(ValueError, match=r"valid names: \['paper_layer_timings_4090.csv'"):
        paper_data_path("nope")
    setup_py = (root.parent / "setup.py").read_text()  # the wheel's contents: tests/test_packaging.py
    assert '"lightning_roundpipe.simulate": ["data/*.csv", "data/*.md"]' in setup_py


def test_docs_simulator_snippet_runs():
    """The Python example of docs/simulator.md runs as written."""
    import re

    doc = (Path(__file__).resolve().parents[1] / "docs" / "simulator.md").read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    namespace: dict = {}
    with redirect_stdout(io.StringIO()):
        exec(compile(snippet, "docs/simulator.md", "exec"), namespace)
    res = namespace["res"]
    assert isinstance(res, SimulationResult) and res.iteration_s > 0 and len(res.idle_pct) == 8


def test_simulate_and_schedule_modules_are_pure():
    """`simulate/` and `schedule/baselines.py` never import lightning or torch (DESIGN.md section 3)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "lightning_roundpipe"
    files = sorted((root / "simulate").glob("*.py")) + [root / "schedule" / "baselines.py"]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for n in names:
                assert n.split(".")[0] not in ("lightning", "torch", "pytorch_lightning"), (f.name, n)


@pytest.mark.parametrize("weight_staleness", [0, 1])
def test_steady_state_with_more_devices_than_work_is_bounded_by_the_optimizer(weight_staleness):
    # 16 devices, 2 microbatches: without the optimizer's dependency the iterations would run side by
    # side (period ~0). One microbatch's chain through every stage is a lower bound on an iteration,
    # and at most 1 + weight_staleness iterations are in flight: period >= chain / (1 + staleness).
    stages, plan = _roundpipe(num_layers=5, devices=16, microbatches=2)
    # F of layers 0..3, the fused tail, B of layers 3..0 (early recompute runs off this chain)
    chain = 4 * 1.0 + (1.0 + 2.0) + 4 * 2.0
    steady = simulate(plan, _layers(5, 1.0, 2.0), steady_state=True, weight_staleness=weight_staleness)
    assert steady.iteration_s >= chain / (1 + weight_staleness) - EPS
    work = 2 * (4 * 1.0 + 3.0 + 4 * 3.0)  # 2 microbatches, recompute included
    assert steady.iteration_s >= work / 16 - EPS  # work conservation on 16 devices
    if weight_staleness == 0:  # nothing overlaps: exactly one iteration (loads are free)
        assert steady.iteration_s == pytest.approx(simulate(plan, _layers(5, 1.0, 2.0)).iteration_s)


def test_weight_staleness_must_be_a_non_negative_int():
    _, plan = _roundpipe(num_layers=5, devices=2, microbatches=3)
    with pytest.raises(ValueError, match="weight_staleness"):
        simulate(plan, _layers(5), steady_state=True, weight_staleness=-1)
