"""``benchmarks/convergence.py`` (issue 32): its pure table functions against hand-computed figures, the way it
reads ``W_j`` during an async fit (the weights of a shorter fit, and no change to the run), and a ``--quick``
smoke run (slow)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"roundpipe_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


table = _load("convergence_table")


def _run(mode: str, seed: int, losses: list[float]) -> dict:
    return {"setup": "b", "optimizer": "adamw", "lr": 1e-3, "mode": mode, "seed": seed, "total_steps": 4,
            "steps": [0, 1, 2, 3, 4], "val_loss": losses}


# sync, async and one correction, two seeds each; the figures below are worked out by hand from these
RUNS = [
    _run("sync", 0, [5, 4, 3, 2, 1.0]), _run("sync", 1, [5, 4, 3, 2, 1.2]),
    _run("async", 0, [5, 4.5, 3.5, 2.5, 2.0]), _run("async", 1, [5, 4.5, 3.5, 2.5, 2.2]),
    _run("async+x", 0, [5, 4.2, 3.2, 2.2, 1.4]), _run("async+x", 1, [5, 4.2, 3.2, 2.2, 1.4]),
]


def test_spread_and_interpolation():
    s = table.spread([1.0, 2.0, 6.0])
    assert (s.mean, s.low, s.high, s.count) == (3.0, 1.0, 6.0, 3)
    assert str(s) == "3.000 [1.000,6.000]"
    with pytest.raises(ValueError, match="empty"):
        table.spread([])
    steps, losses = [0, 10, 20], [5.0, 3.0, 2.0]
    assert table.interpolate(steps, losses, 5) == pytest.approx(4.0)
    assert table.interpolate(steps, losses, 15) == pytest.approx(2.5)
    assert table.interpolate(steps, losses, 10) == 3.0
    with pytest.raises(ValueError, match="outside"):
        table.interpolate(steps, losses, 21)
    run = {"steps": steps, "val_loss": losses, "total_steps": 20}
    assert table.loss_at_fraction(run, 0.25) == pytest.approx(4.0)  # step 5
    assert table.loss_at_fraction(run, 1.0) == 2.0


def test_gap_closed():
    assert table.gap_closed(2.0, 3.0, 2.25) == pytest.approx(0.75)
    assert table.gap_closed(2.0, 3.0, 2.0) == pytest.approx(1.0)
    assert table.gap_closed(2.0, 3.0, 3.5) == pytest.approx(-0.5)  # worse than plain async
    assert table.gap_closed(2.0, 1.9, 1.8) is None  # async better than sync: no gap
    assert table.gap_closed(2.0, 2.004, 2.0, min_gap=0.005) is None  # a gap below the noise floor


def test_steps_to_target_and_target_rule():
    steps, losses = [0, 10, 20], [5.0, 3.0, 2.0]
    assert table.steps_to_target(steps, losses, 4.0) == pytest.approx(5.0)
    assert table.steps_to_target(steps, losses, 2.0) == pytest.approx(20.0)
    assert table.steps_to_target(steps, losses, 6.0) == 0.0
    assert table.steps_to_target(steps, losses, 1.5) is None
    finals = {"sync": 2.0, "async": 3.0}
    assert table.target_loss(finals, "all-reach") == 3.0
    assert table.target_loss(finals, "sync-final") == 2.0
    with pytest.raises(ValueError, match="target_rule"):
        table.target_loss(finals, "best")
    with pytest.raises(ValueError, match="sync"):
        table.target_loss({"async": 3.0}, "sync-final")


def test_mode_rows_by_hand():
    target, rows = table.mode_rows(table.group_runs(RUNS)[("b", "adamw", 1e-3)], {"sync": 0.010, "async": 0.006})
    assert target == pytest.approx(2.1)  # the highest final mean: async's (2.0 + 2.2) / 2
    by_mode = {row.mode: row for row in rows}
    sync, plain, corrected = by_mode["sync"], by_mode["async"], by_mode["async+x"]
    assert [s.mean for s in sync.losses] == pytest.approx([4.0, 3.0, 1.1])  # steps 1, 2, 4
    assert (sync.losses[2].low, sync.losses[2].high) == (1.0, 1.2)
    assert corrected.gaps == pytest.approx((0.6, 0.6, 0.7))  # (4.5-4.2)/(4.5-4), (3.5-3.2)/0.5, (2.1-1.4)/(2.1-1.1)
    assert sync.gaps == (None, None, None) and plain.gaps == (None, None, None)
    assert sync.steps_to_target == pytest.approx(2.9)  # 3 at step 2, 2 at step 3
    assert plain.steps_to_target == pytest.approx(4.0)
    assert corrected.steps_to_target == pytest.approx(3.125)  # 2.2 at step 3, 1.4 at step 4
    assert sync.time_to_target_s == pytest.approx(0.029)
    assert plain.time_to_target_s == pytest.approx(0.024)
    assert corrected.time_to_target_s == pytest.approx(0.01875)  # timed at async's step
    text = table.format_table(RUNS, {"b": {"sync": 0.010, "async": 0.006}})
    assert "first to the target on the planner's hardware: async+x (0.019 s)" in text
    assert "60/60/70" in text
    _, rows = table.mode_rows(table.group_runs(RUNS)[("b", "adamw", 1e-3)], {"sync": 0.010, "async": 0.006,
                                                                          "async+x": 0.008})
    assert {row.mode: row.time_to_target_s for row in rows}["async+x"] == pytest.approx(0.025)  # its own step
    _, rows = table.mode_rows(table.group_runs(RUNS)[("b", "adamw", 1e-3)], rule="sync-final")
    assert {row.mode: row.steps_to_target for row in rows}["async"] is None  # 2.1 never reaches 1.1
    partial = [run for run in RUNS if not (run["mode"] == "async+x" and run["seed"] == 1)]
    _, rows = table.mode_rows(table.group_runs(partial)[("b", "adamw", 1e-3)])
    # the gap on seed 0 alone, which all three modes ran: (4.5-4.2)/(4.5-4), (3.5-3.2)/(3.5-3), (2.0-1.4)/(2.0-1.0)
    assert {row.mode: row.gaps for row in rows}["async+x"] == pytest.approx((0.6, 0.6, 0.6))


def test_a_diverged_seed():
    """A seed whose loss went NaN or inf counts as diverged: the mode's mean is inf, the table says
    "diverged k/n", the target ignores it and the mode never reaches it; no gap share against it."""
    s = table.spread([7.0, math.nan, 8.0])
    assert (s.mean, s.low, s.high, s.diverged) == (math.inf, 7.0, math.inf, 1)
    assert str(s) == "diverged 1/3"
    assert table.target_loss({"sync": 7.5, "async": math.inf}) == 7.5
    assert table.gap_closed(7.5, math.inf, 7.6) is None
    runs = [_run("sync", 0, [5, 4, 3, 2, 1.0]), _run("async", 0, [5, 4.5, 9.0, 50.0, math.nan]),
            _run("async+x", 0, [5, 4.2, 3.2, 2.2, 1.4])]
    target, rows = table.mode_rows(table.group_runs(runs)[("b", "adamw", 1e-3)])
    assert target == 1.4  # the highest finite final mean (async+x's)
    by_mode = {row.mode: row for row in rows}
    assert by_mode["async"].steps_to_target is None and str(by_mode["async"].losses[2]) == "diverged 1/1"
    assert by_mode["async+x"].gaps[2] is None  # no share of an infinite gap
    assert "diverged 1/1" in table.format_table(runs)


def test_a_finite_loss_above_the_initial_one_is_diverged():
    """A seed that ends above its loss before the first step (finite, e.g. 8626 nats from 10.8) diverged: it
    does not set the all-reach target (which would be met at step 0 by every mode), and its mode does not reach
    the target even where its mean curve passed it before blowing up (0.75 at step 2 here)."""
    runs = [_run("sync", 0, [5, 4, 3, 2, 1.0]), _run("async", 0, [5, 4.5, 0.5, 2.0, 1.5]),
            _run("async", 1, [5, 4.5, 1.0, 6.0, 8626.0])]
    assert table.loss_at_fraction(runs[2], 1.0) == math.inf
    assert table.loss_at_fraction(runs[2], 0.5) == 1.0  # below the initial 5: not diverged there
    target, rows = table.mode_rows(table.group_runs(runs)[("b", "adamw", 1e-3)])
    assert target == 1.0  # sync's final: async (diverged 1/2) no longer sets it
    by_mode = {row.mode: row for row in rows}
    assert str(by_mode["async"].losses[2]) == "diverged 1/2" and by_mode["async"].steps_to_target is None
    assert by_mode["sync"].steps_to_target == 4


@pytest.mark.parametrize("correction", [None, *(pytest.param(name, marks=pytest.mark.slow) for name in
                                              ("weight_prediction", "delay_compensation", "gradient_extrapolation"))])
def test_weight_snapshots_read_w_j_without_changing_the_async_run(correction):
    """The benchmark's callback reads ``W_j`` mid-fit: in an async steady-state fit (plain, or with a staleness
    correction) the weights it takes after step 2 equal the final weights of the same fit stopped at step 2,
    and taking them leaves the run's final weights as without the callback (bitwise). (Read with
    ``wait_for_optimizer()`` alone, the weights were ``W_1``: the first assertion failed.)"""
    import torch

    import lightning_roundpipe
    from _helpers import TokenData, CausalLMModule, loader, params, tiny_hf, trainer

    bench = _load("convergence")

    def fit(steps: int, callback=None):
        module = CausalLMModule(tiny_hf(layers=3), lr=0.01, optimizer="adamw")
        kwargs = {} if correction is None else {"staleness_correction": correction}
        strategy = lightning_roundpipe.RoundPipeStrategy(optimizer="async", partition="default", trace_every_n_steps=0,
                                                         **kwargs)
        t = trainer(strategy, devices=2, max_steps=steps, callbacks=[callback] if callback else [])
        t.fit(module, loader(TokenData(n=28), batch_size=7))
        return params(module)

    snapshots = bench._weight_snapshots({2})
    straight = fit(4, snapshots)
    short = fit(2)
    plain = fit(4)
    taken = snapshots.weights[2]
    assert taken.keys() == short.keys()
    assert all(torch.equal(taken[k], short[k]) for k in short)
    assert all(torch.equal(straight[k], plain[k]) for k in plain)
    assert any(not torch.equal(straight[k], short[k]) for k in plain)  # steps 3 and 4 changed the weights


@pytest.mark.slow  # minutes: 6 short runs, 3 of them of SmolLM2-135M
def test_quick_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LIGHTNING_ROUNDPIPE_CHECK_STREAMS", None)  # the benchmark's own setting (tests/test_stream_check.py checks the mode)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "convergence.py"), "--quick", "--out", str(tmp_path),
                          "--corrections", "none,weight_prediction,error_feedback"],
                         capture_output=True, text=True, env=env, timeout=3000)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    modes = {run["mode"] for run in runs}
    assert {"sync", "async"} <= modes
    for correction in ("weight_prediction", "error_feedback"):  # run, or said to be skipped
        assert f"async+{correction}" in modes or f"skipped async+{correction}:" in out.stdout
    assert len(runs) == len(modes) * 2  # 2 setups x AdamW x 1 learning rate x 1 seed
    for run in runs:
        assert run["steps"][0] == 0 and run["steps"][-1] == run["total_steps"]
        assert len(run["val_loss"]) == len(run["steps"]) and all(math.isfinite(v) for v in run["val_loss"])
        assert run["val_loss"][0] == pytest.approx(next(r["val_loss"][0] for r in runs if r["setup"] == run["setup"]
                                                        and r["optimizer"] == run["optimizer"]))  # same initial weights
    text = (tmp_path / "table.txt").read_text()
    assert text.count("first to the target on the planner's hardware") == 2
    assert (tmp_path / "convergence.png").stat().st_size > 10_000
