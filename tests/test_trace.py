"""Step traces (Chrome/Perfetto JSON and the timeline PNG), throughput metrics, and evaluation
phases that keep no timelines (issue 8, items 1 and 2).

Oracles: the Trace Event Format's rules as Perfetto applies them (every event has ``ph``, ``ts``,
``pid``, ``tid``; complete spans of one thread row nest or do not overlap; spans lie inside the
step that was measured), hand-made timelines with known counters, the program's own op names
(``Op.parse``), PaLM's FLOPs formula evaluated from the Hugging Face config, and the simulator's
bubble table (``roundpipe simulate``) for the simulated trace.
"""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

import lightning_roundpipe
from _helpers import CausalLMModule, MLPModule, TokenData, VectorData, loader, tiny_hf, trainer
from lightning_roundpipe.metrics.timeline import Interval, Timeline
from lightning_roundpipe.metrics.trace import HostSpan, join_timelines, trace_events, write_trace
from lightning_roundpipe.schedule.program import Op
from _trace_check import check_trace

GIB = float(2**30)


# ---------------------------------------------------------------------------------------- writer
def _hand_timeline() -> Timeline:
    """Device 0: stage 0's 100 bytes load 0..1 s, its F0 1..2, a concurrent second compute span; device 1 idle."""
    ivs = [
        Interval(0, "H2D", 0, None, 0.0, 1.0, nbytes=100, stream="weights", label="0LOAD.c0"),
        Interval(0, "F", 0, 0, 1.0, 2.0, stream="compute", label="0F0"),
        Interval(0, "F", 0, 1, 1.5, 2.5, stream="compute", label="0F1"),  # overlaps 0F0: goes to a second row
        Interval(0, "D2H", 0, 0, 2.0, 2.5, nbytes=50, stream="d2h", label="0D2H0"),
    ]
    return Timeline(2, ivs, wall_s=3.0)


def test_trace_of_a_hand_made_timeline_has_rows_spans_and_counters():
    doc = trace_events(_hand_timeline(), host_spans=[HostSpan("optimizer", "optimizer step", 2.5, 3.0)])
    rows = check_trace(doc, num_devices=2)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert [threads[(0, tid)] for tid in range(4)] == ["weights", "h2d", "compute", "d2h"]
    compute_rows = {threads[k]: [e["name"] for e in v] for k, v in rows.items() if k[0] == 0 and "compute" in threads[k]}
    assert compute_rows == {"compute": ["0F0"], "compute #2": ["0F1"]}
    (load,) = rows[(0, 0)]
    assert (load["ts"], load["dur"], load["cat"], load["args"]["bytes"]) == (0.0, 1e6, "H2D", 100)  # microseconds
    host = [pid for pid, name in ((e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "process_name")
            if name == "host"]
    assert host == [2] and [e["name"] for e in rows[(2, 1)]] == ["optimizer step"]
    counters = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "C" and e["pid"] == 0:
            counters[e["name"]].append((e["ts"], e["args"]))
    # stage 0 is resident from its upload's start until its last op on the device ends (2.5 s)
    assert counters["resident weights"] == [(0.0, {"bytes": 100}), (2.5e6, {"bytes": 0})]
    link = dict(counters["link"])
    assert link[0.0]["h2d(GiB/s)"] == pytest.approx(100 / GIB) and link[1e6]["h2d(GiB/s)"] == 0.0
    assert link[2e6]["d2h(GiB/s)"] == pytest.approx(50 / 0.5 / GIB) and link[2.5e6]["d2h(GiB/s)"] == 0.0


def test_trace_rejects_bad_input(tmp_path):
    with pytest.raises(TypeError, match="Timeline"):
        trace_events([])
    with pytest.raises(ValueError, match="thread"):
        trace_events(_hand_timeline(), host_spans=[HostSpan("gpu", "x", 0, 1)])
    with pytest.raises(ValueError, match="device_names"):
        trace_events(_hand_timeline(), device_names=["a"])
    path = write_trace(_hand_timeline(), tmp_path / "sub" / "t.json", title="demo")
    assert json.loads(path.read_text())["traceEvents"][0]["args"]["name"].startswith("demo: ")


def test_join_timelines_offsets_and_back_to_back():
    a = Timeline(1, [Interval(0, "F", 0, 0, 0.0, 1.0)], wall_s=1.0)
    b = Timeline(1, [Interval(0, "B", 1, 0, 0.0, 2.0)], wall_s=2.0)
    joined = join_timelines([a, b])
    assert [(i.start_s, i.end_s) for i in joined.intervals] == [(0.0, 1.0), (1.0, 3.0)] and joined.span_s() == 3.0
    gapped = join_timelines([a, b], [0.5, 2.0], wall_s=5.0)
    assert [(i.start_s, i.end_s) for i in gapped.intervals] == [(0.5, 1.5), (2.0, 4.0)] and gapped.span_s() == 5.0


# ---------------------------------------------------------------------------------------- fit
class _Steps(lightning_roundpipe.RoundPipeMetricsCallback):
    """The strategy's metrics callback (it adds none of its own then), keeping every batch's logged metrics."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        row = {k: float(v) for k, v in self.last_metrics.items() if k.startswith("roundpipe/")}
        row["global_step"] = trainer.global_step
        self.rows.append(row)


def _fit_lm(tmp_path, devices=3, max_steps=5, **strategy):
    steps = _Steps()
    strategy.setdefault("num_microbatches", 4)
    strategy.setdefault("profile_steps", 2)
    t = trainer(lightning_roundpipe.RoundPipeStrategy(**strategy), devices=devices, max_steps=max_steps,
                logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[steps])
    module = CausalLMModule(tiny_hf(layers=4))
    t.fit(module, loader(TokenData(), batch_size=8))
    return t, module, steps.rows


def test_fit_writes_trace_and_png_at_the_planned_steps(tmp_path):
    """profile_steps=2, trace_every_n_steps=2: batches 3 and 5 (global steps 3 and 5) are traced."""
    import matplotlib.image

    # the fixed partition runs every op kind (the automatic one may pick the whole model as one fused stage)
    t, _, rows = _fit_lm(tmp_path, trace_every_n_steps=2, partition="default")
    folder = Path(t.log_dir) / "roundpipe"
    assert sorted(p.name for p in folder.iterdir()) == [
        "timeline_step000003.png", "timeline_step000005.png", "trace_step000003.json", "trace_step000005.json"]
    step_s = {r["global_step"]: r["roundpipe/step(s)"] for r in rows}
    for step in (3, 5):
        doc = json.loads((folder / f"trace_step{step:06d}.json").read_text())
        rows_ = check_trace(doc, num_devices=3)
        names = [e["name"] for spans in rows_.values() for e in spans if e["pid"] < 3]
        kinds = {Op.parse(n).kind.value for n in names}  # every device span is named by its op
        assert {"F", "X", "R", "B", "LOAD", "H2D", "D2H", "WD2H"} <= kinds
        # the spans lie inside the measured step (microseconds)
        end = max(e["ts"] + e["dur"] for spans in rows_.values() for e in spans)
        assert 0 < end <= step_s[step] * 1e6 * 1.0001
        counters = {e["name"] for e in doc["traceEvents"] if e["ph"] == "C"}
        assert counters == {"resident weights", "link"}
        host_threads = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 3}
        assert host_threads == {"main", "optimizer"}
        assert doc["otherData"]["step"] == step and doc["otherData"]["roundpipe/num_microbatches"] == 4

        png = folder / f"timeline_step{step:06d}.png"
        assert png.stat().st_size > 20_000
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 300 and image.shape[1] > 1000
        colours = np.unique(image[..., :3].reshape(-1, 3).round(2), axis=0)
        assert len(colours) > 20  # not a blank or single-coloured picture
    # the plan went to the logger's hyperparameters
    hparams = (Path(t.log_dir) / "hparams.yaml").read_text()
    assert "roundpipe/stages" in hparams and "roundpipe/num_microbatches: 4" in hparams


def test_tokens_per_s_mfu_and_the_progress_bar(tmp_path):
    """tokens/s x step(s) = input_ids.numel(); MFU = PaLM's 6N + 12LdT per token over devices x peak."""
    peak = 1e11
    # the fixed partition recomputes (the automatic one may run the whole model as one fused stage: HFU = MFU)
    t, module, rows = _fit_lm(tmp_path, devices=2, max_steps=3, peak_flops=peak, trace_every_n_steps=0,
                              partition="default")
    assert not (Path(t.log_dir) / "roundpipe").exists()  # tracing off
    cfg = module.model.config
    n = module.model.num_parameters(exclude_embeddings=True) + cfg.vocab_size * cfg.hidden_size  # the tied head is a matmul
    d = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    tokens, seq = 8 * 8, 8
    per_token = 6 * n + 12 * cfg.num_hidden_layers * d * seq
    for row in rows:
        step_s = row["roundpipe/step(s)"]
        assert row["roundpipe/tokens_per_s"] * step_s == pytest.approx(tokens)
        assert row["roundpipe/samples_per_s"] * step_s == pytest.approx(8)
        assert row["roundpipe/mfu(%)"] == pytest.approx(100 * tokens * per_token / (step_s * 2 * peak), rel=1e-6)
        # recomputation adds at most one more forward (2N + 4LdT per token) of every layer
        assert row["roundpipe/mfu(%)"] < row["roundpipe/hfu(%)"] <= row["roundpipe/mfu(%)"] * 4 / 3
    assert {"roundpipe/tokens_per_s", "roundpipe/bubble(%)"} <= set(t.strategy.step_metrics)


def test_samples_per_s_without_input_ids_and_no_mfu_on_cpu(tmp_path):
    steps = _Steps()
    t = trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, trace_every_n_steps=None), devices=2,
                max_steps=2, callbacks=[steps])
    t.fit(MLPModule(), loader(VectorData(), batch_size=7))
    for row in steps.rows:
        assert row["roundpipe/samples_per_s"] * row["roundpipe/step(s)"] == pytest.approx(7)
        assert "roundpipe/tokens_per_s" not in row and "roundpipe/mfu(%)" not in row
    assert "roundpipe/samples_per_s" in t.strategy.step_metrics


@pytest.mark.parametrize("value", [-1, 1.5, True, "50"])
def test_trace_every_n_steps_is_validated(value):
    with pytest.raises(ValueError, match="trace_every_n_steps"):
        lightning_roundpipe.RoundPipeStrategy(trace_every_n_steps=value)


@pytest.mark.parametrize("value", [0, -1e12, float("inf"), "1e12"])
def test_peak_flops_is_validated(value):
    with pytest.raises(ValueError, match="peak_flops"):
        lightning_roundpipe.RoundPipeStrategy(peak_flops=value)


def test_peak_flops_table_by_device_name(monkeypatch):
    from lightning_roundpipe.runtime.tuning import flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    cuda = torch.device("cuda", 0)
    assert flops.peak_flops_per_s(cuda, torch.bfloat16) == 165.2e12  # Ada whitepaper, dense, fp32 accumulate
    assert flops.peak_flops_per_s(cuda, torch.float32) == 82.6e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert flops.peak_flops_per_s(cuda, torch.bfloat16) == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert flops.peak_flops_per_s(cuda, torch.bfloat16) is None
    assert flops.peak_flops_per_s(torch.device("cpu"), torch.float32) is None


def test_layer_flops_counts_frozen_weights_without_weight_gradients():
    from lightning_roundpipe.runtime.tuning.flops import layer_flops, step_model_flops

    emb, lin = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 6)
    lin.weight.requires_grad_(False)
    layers = layer_flops([emb, lin])
    assert [(lf.matmul_weights, lf.trainable_weights) for lf in layers] == [(0, 0), (30, 6)]
    assert step_model_flops(layers, tokens=5, seq_len=1) == 5 * (4 * 30 + 2 * 6)


# ---------------------------------------------------------------------------------------- evaluation
class _TimelinesAtBatchEnd(Callback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def _count(self, trainer, *args, **kwargs):
        engine = trainer.strategy.engine
        self.counts.append(len(engine._timelines) + len(engine._step_programs))

    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _count


def test_evaluation_phases_keep_no_timelines():
    """validate/test/predict used to keep one timeline and program per batch until teardown."""
    module, data = MLPModule(), loader(VectorData(n=28))  # 4 batches
    for run in ("validate", "test", "predict"):
        probe = _TimelinesAtBatchEnd()
        t = trainer("roundpipe", devices=2, callbacks=[probe])
        if run == "test":
            module.test_step = module.validation_step
        getattr(t, run)(module, data)
        assert probe.counts == [0, 0, 0, 0], run


# ---------------------------------------------------------------------------------------- W&B
def test_wandb_offline_run_holds_image_trace_artifact_plan_and_device_keys(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from _wandb_offline import read_run, records
    from lightning.pytorch.loggers import WandbLogger

    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": tmp_path, "WANDB_SILENT": "true",
                       "WANDB_DATA_DIR": tmp_path / "data", "WANDB_CACHE_DIR": tmp_path / "cache"}.items():
        monkeypatch.setenv(key, str(value))
    logger = WandbLogger(project="roundpipe-test", save_dir=str(tmp_path), offline=True)
    # balance_microbatches=False: this MLP's automatic choice is timing noise, and a cut would make the
    # plan's microbatch count 4 (test_auto_rounds.py checks the cut)
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, profile_steps=2, trace_every_n_steps=50,
                                                     balance_microbatches=False)
    t = trainer(strategy, devices=2, max_steps=3, logger=logger, log_every_n_steps=1)
    t.fit(MLPModule(), loader(VectorData()))
    logger.experiment.finish()
    # `finish` returns before wandb-core has written the log's last records; `teardown` waits for the
    # service process (the log's writer) to exit, so the file is read complete and closed, never mid-write
    wandb.teardown()
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    run = read_run(folder)
    assert run.exit_code == 0
    assert run.config["roundpipe/num_microbatches"] == 3 and run.config["roundpipe/devices"] == 2
    assert run.config["roundpipe/stages"][0].startswith("0 forward layers 0..")
    image_rows = [r for r in run.history if "roundpipe/timeline/_type" in r]
    assert len(image_rows) == 1 and image_rows[0]["trainer/global_step"] == 3  # the first batch after profiling
    assert image_rows[0]["roundpipe/timeline/format"] == "png"
    (media,) = image_rows[0]["roundpipe/timeline/filenames"]
    assert (folder / "files" / media).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for d in range(2):
        for name in ("bubble(%)", "h2d(GiB/s)", "d2h(GiB/s)"):
            assert f"roundpipe/device{d}/{name}" in run.summary
    assert "roundpipe/predicted_step(s)" in run.summary and "roundpipe/samples_per_s" in run.summary
    (file,) = folder.glob("run-*.wandb")
    artifacts = [r.artifact for r in records(file) if r.WhichOneof("record_type") == "artifact"]
    assert [(a.type, sorted(a.aliases)) for a in artifacts] == [("roundpipe-trace", ["latest", "step3"])]
    assert [c.path for c in artifacts[0].manifest.contents] == ["trace_step000003.json"]
    check_trace(json.loads((tmp_path / "roundpipe" / "trace_step000003.json").read_text()), num_devices=2)


# ---------------------------------------------------------------------------------------- simulate --trace
SMALL_CSV = "model,num_layers,fwd_ms_per_layer,bwd_ms_per_layer,lm_head_fwd_ms,lm_head_bwd_ms\ntiny,6,1.0,2.0,3.0,6.0\n"


def test_simulate_cli_writes_the_same_trace_format(tmp_path):
    from lightning_roundpipe.cli import main

    timings = tmp_path / "t.csv"
    timings.write_text(SMALL_CSV)
    out_path = tmp_path / "sim" / "trace.json"
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(["simulate", "--layer-timings", str(timings), "--devices", "3", "--microbatches", "4",
                     "--format", "csv", "--schedules", "roundpipe_one_iteration", "--trace", str(out_path)])
    assert code == 0
    lines = [line for line in buf.getvalue().splitlines() if line and not line.startswith("#")]
    table = {row[0]: float(row[1]) for row in csv.reader(lines[1:])}  # schedule -> idle % of the model
    doc = json.loads(out_path.read_text())
    rows = check_trace(doc, num_devices=3)
    assert doc["otherData"]["schedule"] == "roundpipe_one_iteration" and doc["otherData"]["devices"] == 3
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    window = max(e["ts"] + e["dur"] for spans in rows.values() for e in spans)
    busy = [sum(e["dur"] for k, spans in rows.items() if k[0] == d and threads[k] == "compute" for e in spans)
            for d in range(3)]
    idle = sum(100 * (1 - b / window) for b in busy) / 3
    assert idle == pytest.approx(table["roundpipe_one_iteration"], abs=0.1)  # the table's idle %
    assert {Op.parse(e["name"]).kind.value for spans in rows.values() for e in spans} >= {"F", "X", "R", "B"}
    with redirect_stdout(io.StringIO()):
        assert main(["simulate", "--layer-timings", str(timings), "--trace", str(out_path), "--plot-model", "nope"]) == 2


def test_trace_writer_imports_neither_torch_nor_lightning():
    """`roundpipe simulate --trace` and other pure callers write traces without torch or Lightning."""
    import subprocess
    import sys

    code = ("import sys, lightning_roundpipe.metrics.trace, lightning_roundpipe.metrics.plot;"
            "print([m for m in ('torch', 'lightning') if m in sys.modules])")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_tracer_schedule_first_batch_after_profiling_then_every_n():
    from types import SimpleNamespace

    from lightning_roundpipe.integration.trace import StepTracer

    engine = SimpleNamespace(measured_profiles=None, profile_steps=3)
    tracer = StepTracer(every_n_steps=4)
    due = []
    for batch in range(12):
        if batch == 3:
            engine.measured_profiles = ["profiles"]  # end_step() of batch 2 (the third profiled) set them
        due.append(tracer.due(engine))
    assert [b for b, d in enumerate(due) if d] == [3, 7, 11]
    # a profile that never completes: traced from batch 2 x profile_steps on, without a prediction
    never, engine = StepTracer(every_n_steps=4), SimpleNamespace(measured_profiles=None, profile_steps=3)
    assert [b for b in range(12) if never.due(engine)] == [6, 10]
    assert not any(StepTracer(every_n_steps=0).due(engine) for _ in range(5))


def test_png_prediction_is_the_logged_predicted_step(tmp_path, monkeypatch):
    """Issue 31: the PNG's simulated panel and the trace's `otherData["roundpipe/predicted_step(s)"]` are one
    figure (they were 25.4 s and 21.0 s for one main-job step: the picture timed every microbatch as the
    profiled mean and added the step's measured optimizer time). 8 rows in 3 microbatches (3, 3, 2)."""
    from lightning_roundpipe.integration.trace import StepTracer

    spans = {}
    picture = StepTracer._picture

    def capture(measured, host, predicted, path, step, optimizer_s):
        spans[step] = predicted[0].span_s()
        return picture(measured, host, predicted, path, step, optimizer_s)

    monkeypatch.setattr(StepTracer, "_picture", staticmethod(capture))
    t, _, _ = _fit_lm(tmp_path, devices=2, max_steps=3, num_microbatches=3, trace_every_n_steps=1, partition="default")
    folder = Path(t.log_dir) / "roundpipe"
    assert sorted(spans) == [3]
    meta = json.loads((folder / "trace_step000003.json").read_text())["otherData"]
    assert meta["roundpipe/predicted_step(s)"] == pytest.approx(spans[3], rel=1e-9)
