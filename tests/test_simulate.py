"""The simulator: analytic cases, transfer priority, steady state, the paper's bubble table."""

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
from lightning_roundpipe.schedule.plan import ExecutionPlan, StageSpec
from lightning_roundpipe.schedule.roundpipe import build_roundpipe_plan, build_stages
from lightning_roundpipe.simulate import (
    PAPER_DATA_FILES,
    SimulationResult,
    format_table,
    paper_data_path,
    read_layer_timings,
    roundpipe_rounds,
    simulate,
)


def _layers(n: int, f: float = 1.0, b: float = 2.0, param_bytes: int = 0, act_bytes: int = 0) -> list[LayerProfile]:
    return [LayerProfile(forward_s=f, backward_s=b, param_bytes=param_bytes, activation_bytes=act_bytes) for _ in range(n)]


def _one_layer_stages(n: int) -> tuple[range, ...]:
    return tuple(range(i, i + 1) for i in range(n))


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
    # device 0: F 1 + B (recompute 1 + backward 2); device 1 holds the last layer (LM head): no recompute
    assert res.compute_s == pytest.approx((4.0, 3.0))
    assert simulate(plan, _layers(2), recompute=False).compute_s == pytest.approx((3.0, 3.0))


def test_activation_hop_costs_comm_per_hop():
    stages = (StageSpec(0, "forward", range(0, 1)), StageSpec(1, "forward", range(1, 2)))
    acts = ((Action(0, ActionKind.LOAD), Action(0, ActionKind.F, 0), Action(0, ActionKind.DROP)),
            (Action(1, ActionKind.LOAD), Action(1, ActionKind.F, 0), Action(1, ActionKind.DROP)))
    plan = ExecutionPlan(stages, acts, 1).validate()
    res = simulate(plan, _layers(2, 1.0, 0.0), comm_s_per_hop=0.25)
    assert res.iteration_s == pytest.approx(2.25)
    kinds = {(i.device_index, i.kind) for i in res.timeline.intervals}
    assert {(0, "D2H"), (1, "H2D"), (0, "F"), (1, "F")} <= kinds


def test_weight_upload_time_is_param_bytes_over_h2d():
    stages = (StageSpec(0, "forward", range(0, 2)),)
    plan = ExecutionPlan(stages, ((Action(0, ActionKind.LOAD), Action(0, ActionKind.F, 0), Action(0, ActionKind.DROP)),), 1)
    hw = HardwareModel(flops_per_s=1e12, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    res = simulate(plan.validate(), _layers(2, 0.5, 0.0, param_bytes=250_000_000), hw)
    assert res.iteration_s == pytest.approx(0.5 + 1.0)
    assert res.timeline.transfer_bytes(0, "H2D") == 500_000_000


def _priority_case():
    """dev1 uploads stage 1 (small), then prefetches stage 2 (1 s of upload); the activation from
    dev0 reaches dev1's link at 12 ms."""
    stages = tuple(StageSpec(i, "forward", range(i, i + 1)) for i in range(3))
    L = lambda s: Action(s, ActionKind.LOAD)  # noqa: E731
    D = lambda s: Action(s, ActionKind.DROP)  # noqa: E731
    F = lambda s: Action(s, ActionKind.F, 0)  # noqa: E731
    plan = ExecutionPlan(stages, ((L(0), F(0), D(0)), (L(1), L(2), F(1), D(1), F(2), D(2))), 1).validate()
    prof = [
        LayerProfile(forward_s=0.010, backward_s=0.0, param_bytes=1_000_000, activation_bytes=0),
        LayerProfile(forward_s=0.010, backward_s=0.0, param_bytes=1_000_000, activation_bytes=1_000_000),
        LayerProfile(forward_s=0.010, backward_s=0.0, param_bytes=1_000_000_000, activation_bytes=1_000_000),
    ]
    hw = HardwareModel(flops_per_s=1e12, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    return plan, prof, hw


def test_activation_copies_preempt_weight_prefetch():
    plan, prof, hw = _priority_case()
    start = lambda res: next(i.start_s for i in res.timeline.intervals if i.kind == "F" and i.stage_index == 1)  # noqa: E731
    prio = simulate(plan, prof, hw)
    fifo = simulate(plan, prof, hw, activation_priority=False)
    # F0 ends at 11 ms, D2H 11-12 ms, H2D 12-13 ms (cutting into the prefetch): F1 starts at 13 ms
    assert start(prio) == pytest.approx(0.013)
    # FIFO: the activation waits for the whole 1 s prefetch of stage 2 (1-1001 ms)
    assert start(fifo) == pytest.approx(1.002)
    assert prio.iteration_s == pytest.approx(1.012) and fifo.iteration_s == pytest.approx(1.022)
    # the preempted prefetch shows as two H2D spans of stage 2 whose bytes add up
    spans = [i for i in prio.timeline.intervals if i.kind == "H2D" and i.stage_index == 2]
    assert len(spans) == 2 and sum(i.nbytes for i in spans) == pytest.approx(1_000_000_000, rel=1e-6)


# ---------------------------------------------------------------------------------------- RoundPipe
def _roundpipe(num_layers: int = 9, devices: int = 4, microbatches: int = 4):
    fwd = tuple(range(i, min(i + 3, num_layers - 1)) for i in range(0, num_layers - 1, 3))
    bwd = (range(num_layers - 1, num_layers),) + tuple(range(i, i + 1) for i in reversed(range(num_layers - 1)))
    stages = build_stages(fwd, bwd, fused_tail=True)
    return stages, build_roundpipe_plan(stages, devices, microbatches)


def test_roundpipe_costs_recompute_but_not_the_fused_tail():
    stages, plan = _roundpipe(num_layers=5, devices=2, microbatches=3)
    res = simulate(plan, _layers(5, 1.0, 2.0))
    # forward stages: 4 layers x F; tail (layer 4): F+B once; backward stages 0..3: recompute + B
    assert sum(res.compute_s) == pytest.approx(3 * (4 * 1.0 + 3.0 + 4 * 3.0))


def test_steady_state_hides_fill_and_drain():
    stages, plan = _roundpipe(num_layers=9, devices=4, microbatches=4)
    prof = _layers(9, 1.0, 2.0)
    one = simulate(plan, prof)
    steady = simulate(plan, prof, steady_state=True)
    assert steady.num_iterations == 2
    assert steady.mean_idle_pct < one.mean_idle_pct
    assert steady.iteration_s < one.iteration_s
    # the steady window holds (about) the work of its iterations
    work = sum(one.compute_s)
    assert sum(steady.compute_s) == pytest.approx(steady.num_iterations * work, rel=0.05)


def test_microbatch_rounds_continue_the_rotation():
    stages, _ = _roundpipe(num_layers=9, devices=4, microbatches=4)
    rounds = roundpipe_rounds(stages, 4, 10)
    assert [p.num_microbatches for p in rounds] == [4, 4, 2]
    s = len(stages)
    assert [p.device_of(0) for p in rounds] == [0, s % 4, (2 * s) % 4]
    for p in rounds:
        p.validate()
    res = simulate(rounds, _layers(9))
    whole = simulate(build_roundpipe_plan(stages, 4, 10), _layers(9))
    assert sum(res.compute_s) == pytest.approx(sum(whole.compute_s))  # same work, dispatched in rounds


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
    with pytest.raises(ValueError, match="profiles"):
        simulate(plan, _layers(1))
    with pytest.raises(ValueError, match="comm_s_per_hop"):
        simulate(plan, _layers(2), comm_s_per_hop=-1.0)
    with pytest.raises(ValueError, match="steady_iterations"):
        simulate(plan, _layers(2), steady_state=True, steady_iterations=2)


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


def test_cli_marks_unbuildable_rows_na(tmp_path, capsys):
    p = tmp_path / "t.csv"
    p.write_text(SMALL_CSV)
    # interleaved 1F1B runs 7 // 3 = 2 rounds, which do not divide 7 microbatches
    rc, out = _run_cli("--layer-timings", str(p), "--devices", "3", "--microbatches", "7", "--format", "csv")
    assert rc == 0
    assert "interleaved_1f1b,n/a" in out and "looped_bfs,n/a" not in out
    assert "warning" in capsys.readouterr().err


def test_cli_bad_input_exits_2(tmp_path, capsys):
    rc, _ = _run_cli("--layer-timings", str(tmp_path / "missing.csv"))
    assert rc == 2 and "error" in capsys.readouterr().err


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
    pyproject = (root.parent / "pyproject.toml").read_text()
    assert '"lightning_roundpipe.simulate" = ["data/*.csv", "data/*.md"]' in pyproject


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
