"""`roundpipe plan`: stage table, grid, predictions, from a config alone (no weights)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

import pytest

from lightning_roundpipe.cli import main, plan_cmd

ACCEPTANCE = ["plan", "--preset", "qwen3-32b", "--devices", "8", "--device-memory-gib", "24", "--h2d-gbps", "25",
              "--tflops", "165", "--seq-len", "2048", "--microbatch-size", "4"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_cmd.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def qwen32b_report() -> plan_cmd.PlanReport:
    return plan_cmd.make_report(parse(ACCEPTANCE))


def test_acceptance_runs_under_2gib_rss():
    """The acceptance command in a fresh interpreter: no weights allocated (peak RSS < 2 GiB)."""
    script = textwrap.dedent(f"""
        import resource, sys
        from lightning_roundpipe.cli import main
        rc = main({ACCEPTANCE!r})
        sys.stdout.flush()
        print("MAXRSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
        sys.exit(rc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rss_kib = int(proc.stderr.split("MAXRSS_KIB")[1].split()[0])
    assert rss_kib * 1024 < 2 * 2**30, f"peak RSS {rss_kib / 2**20:.2f} GiB"
    out = proc.stdout
    for needle in ("Qwen3-32B", "forward", "fused", "backward", "step | dev0", "tokens/s", "idle per device (%)",
                   "peak device memory", "longest sequence a stage can hold"):
        assert needle in out, needle


def test_stage_table_is_asymmetric(qwen32b_report):
    r = qwen32b_report
    fwd = [s for s in r.stages if s.kind == "forward"]
    bwd = [s for s in r.stages if s.kind in ("fused", "backward")]
    assert fwd and bwd
    mean = lambda xs: sum(len(s.layers) for s in xs) / len(xs)  # noqa: E731
    assert mean(fwd) > mean(bwd)
    assert max(len(s.layers) for s in fwd) > max(len(s.layers) for s in bwd)
    # every stage fits the per-stage budget (half of 24 GiB), the device holds a stage plus a prefetch
    assert all(s.memory_bytes <= 12 * 2**30 for s in r.stages)
    assert r.peak_device_memory_bytes <= 24 * 2**30


def test_report_numbers(qwen32b_report):
    r = qwen32b_report
    assert r.num_microbatches == 9  # default: devices + 1
    assert len(r.idle_pct) == 8 and all(0 <= x <= 100 for x in r.idle_pct)
    assert 500 < r.tokens_per_s < 50_000
    assert r.max_seq_len >= 2048 and r.max_seq_len_mb1 >= r.max_seq_len
    assert len(r.execution_plan.stages) == len(r.stages)
    text = plan_cmd.format_report(r, grid_rows=12)
    assert "steps omitted" in text  # many stages: truncated grid
    assert f"{r.tokens_per_s:,.0f} tokens/s" in text


def test_longest_sequence_is_the_fit_boundary(qwen32b_report):
    r = qwen32b_report
    # (one partitioner's plan: the memory check does not depend on which candidate the simulator picks)
    args = parse(ACCEPTANCE[:-4] + ["--seq-len", str(r.max_seq_len), "--microbatch-size", "4", "--method", "optimal"])
    plan_cmd.make_report(args)  # fits
    args = parse(ACCEPTANCE[:-4] + ["--seq-len", str(r.max_seq_len + 1), "--microbatch-size", "4", "--method", "optimal"])
    with pytest.raises(ValueError, match="over the per-stage memory budget"):
        plan_cmd.make_report(args)


def test_lora_and_microbatches(capsys):
    r = plan_cmd.make_report(parse(["plan", "--preset", "qwen3-235b-a22b", "--lora", "--microbatches", "16",
                                    "--method", "optimal"]))
    assert r.num_microbatches == 16 and r.num_candidates == 1
    assert sum(s.grad_bytes for s in r.stages) < 0.01 * sum(s.param_bytes for s in r.stages)
    assert r.modelled.shape.num_experts == 128


def test_model_path_config_json(tmp_path, capsys):
    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 6,
           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000, "_name_or_path": "tiny-llama"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = main(["plan", "--model", str(tmp_path), "--devices", "3", "--seq-len", "512", "--microbatch-size", "2",
               "--method", "paper", "--grid-rows", "0"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tiny-llama" in out and "layer sequence L = 8" in out and "steps omitted" not in out


def test_bad_inputs_exit_2_with_message(capsys):
    assert main(["plan", "--preset", "nope"]) == 2
    err = capsys.readouterr().err
    assert "valid presets" in err and "qwen3-32b" in err
    assert main(["plan", "--preset", "qwen3-1.7b", "--devices", "0"]) == 2
    assert "`--devices`" in capsys.readouterr().err
    assert main(["plan", "--preset", "qwen3-32b", "--device-memory-gib", "2"]) == 1  # does not fit: not a bad argument
    assert "over the per-stage memory budget" in capsys.readouterr().err
    assert main(["plan", "--preset", "qwen3-1.7b", "--devices", "1000"]) == 2  # refused at once (was minutes)
    assert "`--devices` must be in 1..64" in capsys.readouterr().err
    for flag, value in (("--tflops", "inf"), ("--h2d-gbps", "0"), ("--device-memory-gib", "0")):
        assert main(["plan", "--preset", "qwen3-1.7b", flag, value]) == 2
        assert f"`{flag}` must be a finite number > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--preset", "qwen3-1.7b", "--method", "magic"])


def test_falls_back_to_compute_only_walk_without_simulator(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning_roundpipe.simulate.engine", None)  # import fails
    r = plan_cmd.make_report(parse(["plan", "--preset", "qwen3-1.7b", "--devices", "4"]))
    assert r.predictor.startswith("compute-only walk")
    assert r.step_s > 0 and len(r.idle_pct) == 4 and all(0 <= x < 100 for x in r.idle_pct)
    # one step with fill and drain: at least the busiest device's compute
    per_mb = sum(s.cost_s for s in r.stages) * r.num_microbatches / 4
    assert r.step_s >= per_mb * (1 - 1e-9)


TINY_LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 6,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000, "_name_or_path": "tiny-llama"}


def test_bad_dtype_bytes_and_grid_rows_exit_2(capsys):
    with pytest.raises(SystemExit) as e:  # argparse: the valid choices are listed
        main(["plan", "--preset", "qwen3-1.7b", "--dtype-bytes", "3"])
    assert e.value.code == 2 and "choose from 1, 2, 4" in capsys.readouterr().err
    args = parse(["plan", "--preset", "qwen3-1.7b"])
    args.dtype_bytes = 8  # programmatic use: make_report checks it too
    with pytest.raises(ValueError, match=r"`--dtype-bytes` must be one of \[1, 2, 4\], got 8.*HINT"):
        plan_cmd.make_report(args)
    assert main(["plan", "--preset", "qwen3-1.7b", "--grid-rows", "-1"]) == 2
    err = capsys.readouterr().err
    assert "`--grid-rows` must be >= 0, got -1" in err and len(err.strip().splitlines()) == 1
    assert main(["plan", "--preset", "qwen3-1.7b", "--dtype-bytes", "4", "--grid-rows", "0"]) == 0


def test_small_tflops_print_with_their_digits(capsys):
    assert main(["plan", "--preset", "qwen3-1.7b", "--tflops", "0.1", "--h2d-gbps", "0.05", "--grid-rows", "4"]) == 0
    out = capsys.readouterr().out
    assert " 0.1 TFLOP/s peak" in out and "H2D 0.05 GB/s" in out
    assert main(["plan", "--preset", "qwen3-1.7b", "--grid-rows", "4"]) == 0
    assert " 165 TFLOP/s peak" in capsys.readouterr().out


def test_tied_embedding_counts_once_in_the_weight_total(tmp_path, capsys):
    # SmolLM2-135M's shape: 30 layers, width 576, vocabulary 49152, tied embedding / LM head
    cfg = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
           "_name_or_path": "smollm2-135m"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path), "--devices", "2", "--grid-rows", "4"]) == 0
    out = capsys.readouterr().out
    assert "0.135B weights, 0.135B trainable" in out, out.splitlines()[0]
    r = plan_cmd.make_report(parse(["plan", "--model", str(tmp_path), "--devices", "2"]))
    total, trainable = plan_cmd.model_param_counts(r.modelled)
    assert total == trainable == pytest.approx(134.5e6, rel=0.01)
    assert sum(c.param_count for c in r.modelled.costs) - total == 49152 * 576  # the layer sequence has it twice
    # LoRA: the frozen tied weight is not trainable, still counted once
    r = plan_cmd.make_report(parse(["plan", "--model", str(tmp_path), "--devices", "2", "--lora"]))
    total, trainable = plan_cmd.model_param_counts(r.modelled)
    assert total == sum(c.param_count for c in r.modelled.costs) - 49152 * 576 and trainable < 0.05 * total


def test_longest_sequence_at_the_search_bound_says_at_least(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    monkeypatch.setattr(plan_cmd, "MAX_SEQ_LEN_SEARCHED", 4096)
    rc = main(["plan", "--model", str(tmp_path), "--devices", "2", "--seq-len", "64", "--device-memory-gib", "64",
               "--grid-rows", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("longest sequence a stage can hold"))
    assert "at least 4,096 tokens at microbatch size 4" in line and "the search stops at 4,096 tokens" in line
    # below the bound: an exact figure
    r = plan_cmd.make_report(parse(["plan", "--model", str(tmp_path), "--devices", "2", "--seq-len", "64",
                                    "--device-memory-gib", "0.25"]))
    assert 0 < r.max_seq_len < r.max_seq_len_bound
    text = plan_cmd.format_report(r)
    assert f"hold: {r.max_seq_len:,} tokens" in text and "at least" not in text


def test_optimizer_modes_side_by_side(capsys):
    """`--optimizer` picks the plan the simulator times fastest in that mode (oracle: each candidate
    simulated directly); both modes' predictions are printed, with the paper's figures."""
    from lightning_roundpipe.partition import candidate_partitions
    from lightning_roundpipe.simulate.steady import partition_stages, simulate_training

    argv = ["plan", "--preset", "qwen3-1.7b", "--devices", "4", "--microbatches", "5", "--grid-rows", "4"]
    reports = {mode: plan_cmd.make_report(parse(argv + ["--optimizer", mode])) for mode in ("sync", "async")}
    r = reports["sync"]
    candidates = candidate_partitions(r.modelled.profiles, 4, r.stage_memory_bytes,
                                      saved_activation_bytes=r.modelled.saved_activation_bytes)
    assert r.num_candidates == len(candidates) >= 3
    for mode, report in reports.items():
        assert report.optimizer == mode and set(report.mode_choices) == {"sync", "async"}
        direct = [simulate_training(partition_stages(p), 4, 5, r.modelled.profiles, r.hardware, optimizer=mode,
                                    optimizer_bytes=r.optimizer_bytes).step_s for _, p in candidates]
        chosen = report.mode_choices[mode]
        assert chosen.prediction.step_s == pytest.approx(min(direct))
        assert report.partition == chosen.partition and report.step_s == chosen.prediction.step_s
        assert report.mode_choices == reports["sync"].mode_choices or mode == "sync"
    # the optimizer step: trainable fp32 masters and two Adam moments over the default host rate
    total, trainable = plan_cmd.model_param_counts(r.modelled)
    assert r.optimizer_bytes == 12 * trainable
    assert r.optimizer_step_s == pytest.approx(r.optimizer_bytes / r.hardware.optimizer_bytes_per_s)
    assert main(argv + ["--optimizer", "async"]) == 0
    out = capsys.readouterr().out
    assert "[simulator, async optimizer, steady state]" in out
    rows = [line for line in out.splitlines() if line.startswith(("sync", "async"))]
    assert [row.split()[0] for row in rows] == ["sync", "async*"]
    tokens = r.num_microbatches * r.modelled.tokens_per_microbatch
    for row, mode in zip(rows, ("sync", "async")):
        choice = reports["async"].mode_choices[mode]
        assert f"{choice.prediction.tokens_per_s(tokens):,.0f}" in row and f"{choice.prediction.mean_idle_pct:.1f}" in row
    assert "paper (Qwen3-1.7B, simulated, 8 GPUs x 16 microbatches): idle 19.1 % one iteration, 4.0 % steady state" in out
    assert "65,417 tokens/s async, 56,489 sync" in out


def test_optimizer_rate_flag_moves_the_sync_step_by_the_optimizer_time(capsys):
    argv = ["plan", "--preset", "qwen3-1.7b", "--devices", "2", "--microbatches", "3"]
    slow = plan_cmd.make_report(parse(argv + ["--optimizer-gbps", "10"]))
    fast = plan_cmd.make_report(parse(argv + ["--optimizer-gbps", "1000"]))
    assert slow.optimizer_step_s == pytest.approx(slow.optimizer_bytes / 10e9)
    # sync: the step is the pipeline plus the optimizer step (the same plan wins: the step adds to every candidate)
    assert slow.partition == fast.partition
    assert slow.step_s - fast.step_s == pytest.approx(slow.optimizer_bytes / 10e9 - fast.optimizer_bytes / 1000e9)
    assert main(argv + ["--optimizer-gbps", "0"]) == 2
    assert "`--optimizer-gbps` must be a finite number > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv + ["--optimizer", "adam"])
    assert main(argv + ["--accumulate-grad-batches", "0"]) == 2
    assert "`--accumulate-grad-batches` must be an int >= 1" in capsys.readouterr().err


SMOL = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}


@pytest.mark.parametrize("config,message", [
    ([1, 2], "holds a JSON list, not an object of config fields"),
    ({**SMOL, "vocab_size": "x"}, "`vocab_size` must be a whole number"),
    ({**SMOL, "num_hidden_layers": 2.5}, "`num_hidden_layers` must be a whole number"),
    ({**SMOL, "num_key_value_heads": 4}, "`num_key_value_heads` = 4 must divide `num_attention_heads` = 9"),
    ({**SMOL, "head_dim": True}, "`head_dim` must be a whole number"),
    ({**SMOL, "hidden_size": float("inf")}, "`hidden_size` must be a whole number"),
    ({**SMOL, "num_hidden_layers": float("nan")}, "`num_hidden_layers` must be a whole number"),
])
def test_bad_config_files_are_named_errors(tmp_path, capsys, config, message):
    """A config file that is not an object, or a field that is not a whole number, or key/value heads
    that do not divide the query heads: exit 2 with the field named and a HINT, no traceback."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(tmp_path), "--devices", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and "HINT" in err and "Traceback" not in err


def test_plan_flags_out_of_range_say_what_to_do(tmp_path, capsys):
    """Counts below 1 (also a negative device count, once read as a GPU's name), more microbatches than
    a plan simulates: exit 2 with the range and a HINT. One device is "1 device"; a model type the
    cost model does not know is said to be costed as a llama-style decoder."""
    for argv, message in ((["--devices", "-2"], "`--devices` must be >= 1, got -2"),
                          (["--devices", "0"], "`--devices` must be >= 1, got 0"),
                          (["--seq-len", "0"], "`--seq-len` must be >= 1"),
                          (["--microbatches", "1000"], f"`--microbatches` must be in 1..{plan_cmd.MAX_MICROBATCHES}"),
                          (["--efficiency", "1.5"], "`--efficiency` must be in (0, 1]"),
                          (["--stage-memory-gib", "30"], "`--stage-memory-gib` must be in (0, --device-memory-gib]"),
                          (["--accumulate-grad-batches", "0"], "`--accumulate-grad-batches` must be an int >= 1"),
                          (["--tflops", "1e6"], "`--tflops` 1e+06 is more than any device (3000")):
        assert main(["plan", "--preset", "qwen3-1.7b", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "HINT" in err, err
    (tmp_path / "config.json").write_text(json.dumps({**SMOL, "model_type": "bert"}))
    assert main(["plan", "--model", str(tmp_path), "--devices", "1", "--grid-rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "hardware: 1 device x 24 GiB" in out and "model_type `bert` is not one the cost model knows" in out


TINY = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024, "_name_or_path": "tiny-llama"}


def _tiny_plan(tmp_path, *flags: str) -> list[str]:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return ["plan", "--model", str(tmp_path), "--devices", "2", "--seq-len", "128", "--microbatch-size", "1",
            "--grid-rows", "1", *flags]


def _with(argv: list[str], remedy) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in remedy.dropped:
            skip = True
        else:
            out.append(arg)
    return out + list(remedy.flags)


@pytest.mark.parametrize("flags", [("--device-memory-gib", "0.05"),
                                   ("--device-memory-gib", "0.1", "--optimizer", "async"),
                                   ("--device-memory-gib", "0.105", "--optimizer", "async", "--stage-memory-gib", "0.05")])
def test_a_plan_that_does_not_fit_exits_1_and_names_only_changes_that_fit(tmp_path, capsys, flags):
    """Full fine-tuning whose modelled peak exceeds the device (the per-stage budget lowered as far as a single
    layer admits): exit 1, the reason on stderr, and a HINT naming only changes that fit. Oracle: `roundpipe plan`
    itself with each named change exits 0 (its plan fits), and a halved microbatch or sequence that does not fit is
    not named."""
    argv = _tiny_plan(tmp_path, *flags)
    report = plan_cmd.make_report(parse(argv))
    assert not report.fits and report.remedies
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "ERROR: the plan does not fit" in captured.out and "the plan does not fit" in captured.err
    assert "HINT: each of these fits" in captured.err and "`--lora`" in captured.err
    named = {remedy.flags[:1] or remedy.dropped for remedy in report.remedies}
    if "--stage-memory-gib" in flags:  # without it the budget is lowered until a partition fits
        assert ("--stage-memory-gib",) in named and "leaving out `--stage-memory-gib`" in captured.err
    else:  # lowering it cannot help: it is lowered already
        assert "--stage-memory-gib" not in captured.err.split("HINT")[1]
    if "async" in flags:
        assert ("--no-overlap-batches",) in named  # one pool bank instead of two
    for remedy in report.remedies:
        assert main(_with(argv, remedy)) == 0, remedy
        changed = plan_cmd.make_report(parse(_with(argv, remedy)))
        assert changed.fits and changed.peak_device_memory_bytes <= changed.hardware.memory_bytes
    capsys.readouterr()
    for flag, value in (("--seq-len", "64"),):  # the halved sequence: not named, and indeed does not fit
        if (flag,) not in named:
            assert main(argv + [flag, value]) == 1


def test_one_per_stage_budget_each_labelled(tmp_path, capsys):
    """With two pool banks (`--optimizer async`) the stages are cut with a budget lowered from half the device
    memory; the longest sequence is searched against the budget before the lowering. Both figures are printed
    with where they come from, so the user sees why they differ."""
    from lightning_roundpipe.partition.units import format_bytes

    argv = _tiny_plan(tmp_path, "--device-memory-gib", "0.105", "--optimizer", "async")
    r = plan_cmd.make_report(parse(argv))
    assert r.fits and r.banks == 2 and r.stage_memory_bytes < r.layer_budget_bytes
    assert main(argv) == 0
    out = capsys.readouterr().out
    hardware = next(line for line in out.splitlines() if line.startswith("hardware:"))
    longest = next(line for line in out.splitlines() if line.startswith("longest sequence"))
    given, cut = format_bytes(r.layer_budget_bytes), format_bytes(r.stage_memory_bytes)
    assert (f"per-stage memory budget {cut} (lowered from {given}, half the device memory, until the modelled peak"
            " with two pool banks fits") in hardware
    assert f"within the {given} per-stage budget, half the device memory, before the lowering above" in longest
    assert "an upper bound" in longest and "two pool banks of stage weight slots" in out


def test_a_layer_over_the_stage_budget_names_changes_that_fit(tmp_path, capsys):
    """A single layer over the per-stage budget (no partition exists): exit 1 (does not fit; 2 is a bad argument) with the layer's bytes, and a HINT
    naming only changes whose plan fits. Oracle: `roundpipe plan` with each named change exits 0."""
    import re

    argv = _tiny_plan(tmp_path, "--device-memory-gib", "0.03")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "alone needs 16.6 MiB" in err and "HINT: each of these fits by the same memory model:" in err
    changes = re.findall(r"`(--lora|--device-memory-gib [0-9.]+)`", err.split("HINT")[1])
    assert "--lora" in changes and any(c.startswith("--device-memory-gib") for c in changes)
    for change in changes:
        assert main(argv + change.split()) == 0, change
