"""The one-step-stale optimizer's cost in loss, and the time to a target loss on 8 x RTX 4090 (issue 32).

Validation loss against optimizer steps for ``RoundPipeStrategy(optimizer="sync")``, ``optimizer="async"``
(the paper's mode: step k's gradient is taken at ``W_{k-2}``, docs/usage.md *Asynchronous optimizer*) and
``optimizer="async"`` with each staleness correction (``staleness_correction=...``; one the installed
strategy refuses is skipped with a message), on 2 CPU virtual devices, real data (the Shakespeare texts of
the main job, tokenised by SmolLM2's tokenizer), several seeds:

- setup ``a``: the main job's LoRA fine-tuning of SmolLM2-135M-Instruct (``conf/model/smollm2_lora.yaml``:
  rank 16 on the attention projections, its cosine schedule with warm-up; LoRA dropout 0 here, so the
  seeds differ by LoRA initialisation and batch order only);
- setup ``b``: full fine-tuning of a randomly initialised, scaled-down SmolLM2 (``conf/model/tiny_lora.yaml``
  without LoRA: 4 decoder layers, hidden 128, MLP 384, SmolLM2's vocabulary and tied embeddings) at a
  constant learning rate, over a small learning-rate sweep (where one-step staleness starts to matter).

Both are built from the main job's Hydra configs (``conf/``, composed with overrides), not re-written here.
Optimizers: ``adamw`` (``torch.optim.AdamW``, weight decay 0) and ``sgd`` (``torch.optim.SGD``, momentum 0.9).

Validation: a fixed held-out slice (``--val-blocks`` evenly spaced blocks of Hamlet, which no training
batch holds), evaluated at step 0 and every ``--eval-every`` optimizer steps. The weights of step j are
taken in a callback through ``trainer.strategy.lightning_module_state_dict()`` (which, as for a checkpoint,
drains the pipeline and waits for the update in flight: ``W_j``, and the next step still computes on
``W_{j-1}``, so the staleness is not disturbed; Lightning's validation loop would refresh the snapshot and
make the next async step exact) and evaluated in plain torch after ``fit``.

Printed (and written to ``--out``/``table.txt``; the runs to ``runs.jsonl``, a PNG to ``convergence.png``):
per setup, optimizer and learning rate, per mode: the validation loss at 25/50/100 % of the steps (mean
[min,max] over the seeds); for a corrected mode the share of the sync-async gap it closes at equal steps,
``(loss_async - loss_corrected) / (loss_async - loss_sync)``; the steps to the target loss (``--target-rule``:
``all-reach``, the highest final mean loss among the modes, which every mode reaches; or ``sync-final``) on the
seeds' mean curve; those steps times the step time ``roundpipe plan --optimizer sync|async`` predicts for the
model on 8 x RTX 4090 (the planner's defaults: 165 TFLOP/s, 24 GiB, 25 GB/s; bf16; one microbatch per
sequence, ``--batch-size`` microbatches of ``--seq-len`` tokens, so a planned step is a benchmark step);
a corrected mode ``async+X`` with ``roundpipe plan --optimizer async --staleness-correction X`` (the correction's
host cost added to the optimizer step), or, with a planner that lacks it, at plain async's step (a note says so). Runs already in ``runs.jsonl`` with the same settings are reused (``--fresh`` re-runs them), so
corrections can be added later to the same table.

Run (from the repository root)::

    python benchmarks/convergence.py --quick     # smoke run: 1 seed, AdamW, a few steps of each mode
    python benchmarks/convergence.py             # the default run: 120 runs
    python benchmarks/convergence.py --setups b --lrs-adamw 3e-3 --corrections weight_prediction
    python benchmarks/convergence.py --table-only  # the table and PNG of the runs in --out so far

Wall time (one process; measured on 2 cores shared with 3 other sessions' test runs, load 6-23): a run of
setup a (16 steps, 135M parameters, 12-22 s per step) takes 220-390 s, of setup b (48 steps) 26 s at load ~1
(0.5 s per step) to 220 s. The default grid (a: 2 optimizers x 5 modes x 3 seeds = 30 runs; b: 6 learning
rates x 5 modes x 3 seeds = 90 runs; ``error_feedback`` is refused by the current strategy) is then about
5 hours on such a shared machine and about 1.2 hours on an idle 2-core one (estimated from the runs above); the
smoke test's ``--quick`` (6 runs) took 11 minutes under
load (``tests/test_convergence_benchmark.py::test_quick_run``). Runs split over processes with
``--setups``/``--optimizers``/``--first-seed`` share ``--out`` (each appends its runs; ``--table-only`` joins them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see lightning_roundpipe/train.py
os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # convergence_table, beside this file

from convergence_table import TARGET_RULES, format_table, group_runs, mean_curve  # noqa: E402

CORRECTIONS = ("none", "weight_prediction", "delay_compensation", "error_feedback")
"""``--corrections``: ``none`` is plain async; the others are ``staleness_correction`` values (the candidates
of issue 32). The default adds those the installed ``RoundPipeConfig`` lists (:func:`default_corrections`)."""


def default_corrections() -> str:
    """:data:`CORRECTIONS` and the installed strategy's ``STALENESS_CORRECTIONS`` (if it has them), comma-separated."""
    try:
        from lightning_roundpipe.config import STALENESS_CORRECTIONS
    except ImportError:  # a strategy without staleness corrections: each is skipped with a message
        STALENESS_CORRECTIONS = ()
    names = dict.fromkeys([*CORRECTIONS, *("none" if c is None else str(c) for c in STALENESS_CORRECTIONS)])
    return ",".join(names)
OPTIMIZERS = ("adamw", "sgd")
SETUP_NAMES = {"a": "LoRA SmolLM2-135M", "b": "full FT, 4-layer SmolLM2-shaped"}
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- models and data (the main job's configs)
def compose(setup: str, args: argparse.Namespace, seed: int) -> Any:
    """The main job's config (``conf/train.yaml``) composed for a setup, with the benchmark's data sizes."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from lightning_roundpipe.train import CONF_DIR

    overrides = [f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch_size}",
                 f"data.val_batch_size={args.val_blocks}", f"data.val_blocks={args.val_blocks}",
                 f"data.max_train_blocks={args.train_blocks}"]
    if setup == "a":
        overrides += ["model=smollm2_lora", "model.lora.lora_dropout=0.0"]
    else:
        overrides += ["model=tiny_lora", "model.lora=null", "model.model.num_hidden_layers=4",
                      "model.model.hidden_size=128", "model.model.intermediate_size=384", f"+model.model.seed={seed}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def optimizer_factory(name: str, lr: float) -> Any:
    import torch

    if name == "adamw":
        return partial(torch.optim.AdamW, lr=lr, weight_decay=0.0)
    if name == "sgd":
        return partial(torch.optim.SGD, lr=lr, momentum=0.9)
    raise ValueError(f"`--optimizers` entries must be in {list(OPTIMIZERS)}, got {name!r}.")


def build(setup: str, optimizer: str, lr: float, seed: int, args: argparse.Namespace) -> tuple[Any, Any]:
    """The LightningModule and the datamodule of a run (seeded: LoRA or model initialisation, batch order)."""
    import hydra
    import lightning as L

    cfg = compose(setup, args, seed)
    L.seed_everything(seed, workers=True, verbose=False)
    datamodule = hydra.utils.instantiate(cfg.data)
    scheduler = {} if setup == "a" else {"scheduler": None}  # a: the recipe's cosine schedule; b: constant LR
    module = hydra.utils.instantiate(cfg.model, optimizer=optimizer_factory(optimizer, lr), **scheduler)
    return module, datamodule


# ---------------------------------------------------------------------- one run
def make_strategy(mode: str) -> Any:
    """``RoundPipeStrategy`` for a benchmark mode (``sync``, ``async``, ``async+<correction>``).

    Raises:
        TypeError, ValueError: what the installed strategy raises for a correction it does not know.
    """
    import lightning_roundpipe

    kwargs: dict[str, Any] = {"optimizer": "sync" if mode == "sync" else "async"}
    if mode.startswith("async+"):
        kwargs["staleness_correction"] = mode.split("+", 1)[1]
    return lightning_roundpipe.RoundPipeStrategy(partition="default", trace_every_n_steps=0, **kwargs)


def _weight_snapshots(eval_steps: set[int]) -> Any:
    import lightning as L

    class WeightSnapshots(L.Callback):
        """Clones the trainable weights after the optimizer steps in ``eval_steps`` (``W_j``, see the module
        docstring for why through ``lightning_module_state_dict``)."""

        def __init__(self) -> None:
            self.weights: dict[int, dict[str, Any]] = {}

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            step = trainer.global_step
            if step in eval_steps and step not in self.weights:
                trainer.strategy.lightning_module_state_dict()  # drain + wait for the update in flight
                self.weights[step] = {name: p.detach().clone() for name, p in pl_module.named_parameters()
                                      if p.requires_grad}

    return WeightSnapshots()


def evaluate(module: Any, datamodule: Any, weights: dict[str, Any]) -> float:
    """Token-weighted mean validation cross-entropy (nats/token) of ``module`` with ``weights`` loaded."""
    import torch

    params = dict(module.named_parameters())
    total, count = 0.0, 0
    module.model.eval()
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
        for batch in datamodule.val_dataloader():
            tokens = module._num_label_tokens(batch)
            total += float(module.model(**batch).loss) * tokens
            count += tokens
    module.model.train()
    return total / count


def run_one(setup: str, optimizer: str, lr: float, mode: str, seed: int, steps: int, eval_every: int,
            args: argparse.Namespace) -> dict[str, Any]:
    """Train one run and return its record (the curve, wall time and CPU seconds per step)."""
    import lightning as L
    import torch

    start = time.perf_counter()
    strategy = make_strategy(mode)  # first: a refused correction costs nothing
    module, datamodule = build(setup, optimizer, lr, seed, args)
    eval_steps = sorted({*range(eval_every, steps, eval_every), steps})
    snapshots = _weight_snapshots(set(eval_steps))
    initial = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=steps, precision="32-true",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[snapshots],
                        default_root_dir=str(Path(args.out) / "lightning"))
    fit_start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    fit_s = time.perf_counter() - fit_start
    if trainer.global_step != steps:
        raise RuntimeError(f"{setup}/{optimizer}/{mode}: fit stopped at step {trainer.global_step} of {steps}."
                           " HINT: raise `--train-blocks` (an epoch must hold the steps).")
    with torch.no_grad():
        curve = [evaluate(module, datamodule, initial)]
        curve += [evaluate(module, datamodule, snapshots.weights[step]) for step in eval_steps]
    return {"setup": setup, "optimizer": optimizer, "lr": lr, "mode": mode, "seed": seed, "total_steps": steps,
            "steps": [0, *eval_steps], "val_loss": curve, "fit_s_per_step": fit_s / steps,
            "wall_s": time.perf_counter() - start, **_settings(args)}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """What else a cached run must share to be reused."""
    return {"seq_len": args.seq_len, "batch_size": args.batch_size, "val_blocks": args.val_blocks,
            "devices": args.devices}


def _key(record: dict[str, Any]) -> tuple:
    names = ("setup", "optimizer", "lr", "mode", "seed", "total_steps", "seq_len", "batch_size", "val_blocks", "devices")
    return tuple(record[name] for name in names)


# ---------------------------------------------------------------------- the planner on 8 x RTX 4090
def _planner_config(setup: str, args: argparse.Namespace) -> Path:
    """A ``config.json`` for ``roundpipe plan --model``: SmolLM2's cached one (a), or the small model's (b)."""
    from lightning_roundpipe.recipes.smollm2 import ensure_smollm2_cache

    if setup == "a":
        return ensure_smollm2_cache() / "config.json"
    import hydra

    folder = Path(args.out) / "planner_b"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = compose("b", args, 0)
    hydra.utils.instantiate(cfg.model.model).config.to_json_file(folder / "config.json")
    return folder / "config.json"


def planner_step_s(setup: str, args: argparse.Namespace, modes: list[str]) -> tuple[dict[str, float], list[str]]:
    """``{mode: s}``: the step ``roundpipe plan --optimizer sync|async`` predicts for the setup's model on
    ``--plan-devices`` RTX 4090s (bf16; ``--batch-size`` microbatches of one ``--seq-len`` sequence); a corrected
    mode ``async+X`` with ``--staleness-correction X`` (its host cost in the async optimizer step) where the installed
    planner has that option and value. Also returns the corrected modes it could not time that way (the table
    times them at plain async's step)."""
    import contextlib
    import io

    from lightning_roundpipe.cli import plan_cmd

    parser = argparse.ArgumentParser(prog="roundpipe")
    plan_cmd.add_parser(parser.add_subparsers(dest="command"))  # `roundpipe plan`'s own flags and defaults
    common = ["plan", "--model", str(_planner_config(setup, args)), "--devices", str(args.plan_devices),
              "--seq-len", str(args.seq_len), "--microbatch-size", "1", "--microbatches", str(args.batch_size)]
    common += ["--lora", "--lora-rank", "16"] if setup == "a" else []
    out, untimed = {}, []
    for mode in ["sync", "async", *(m for m in modes if m.startswith("async+"))]:
        argv = common + ["--optimizer", "sync" if mode == "sync" else "async"]
        if mode.startswith("async+"):
            argv += ["--staleness-correction", mode.split("+", 1)[1]]
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                parsed = parser.parse_args(argv)
        except SystemExit:  # a planner without the option, or without this correction
            untimed.append(mode)
            continue
        out[mode] = plan_cmd.make_report(parsed).step_s
    return out, untimed


# ---------------------------------------------------------------------- the figure
def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Validation loss against steps, one panel per setup, optimizer and learning rate: each mode's seed
    mean as a line, its min-max over the seeds as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_runs(runs)
    cols = min(4, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    colors = {"sync": "C0", "async": "C1"}
    for ax, ((setup, optimizer, lr), modes) in zip(axes.flat, groups.items()):
        for mode, mode_runs in modes.items():
            steps, mean = mean_curve(mode_runs)
            curves = [[run["val_loss"][list(run["steps"]).index(s)] for s in steps] for run in mode_runs]
            line, = ax.plot(steps, mean, label=f"{mode} ({len(mode_runs)} seeds)", lw=1.4,
                            color=colors.setdefault(mode, f"C{len(colors)}"),  # one colour per mode in every panel
                            ls="--" if mode.startswith("async+") else "-")  # a correction equal to async: both show
            ax.fill_between(steps, [min(c) for c in zip(*curves)], [max(c) for c in zip(*curves)],
                            color=line.get_color(), alpha=0.18, lw=0)
        ax.set_title(f"{setup}: {SETUP_NAMES.get(setup, setup)}\n{optimizer} lr={lr:g}", fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("validation loss (nats/token)")
        # the y range of the steps from 25 % on (before, a random init's loss falls from ~ln(vocab): off the scale)
        later = [loss for mode_runs in modes.values() for run in mode_runs
                 for step, loss in zip(run["steps"], run["val_loss"]) if step >= run["total_steps"] / 4]
        # a diverging seed's losses (and a diverged one's NaN) would squash the other curves: the best 90 %
        finite = sorted(loss for loss in later if math.isfinite(loss))
        later = finite[:max(1, -(-len(finite) * 9 // 10))] if finite else [0.0, 1.0]
        sync_later = [loss for run in modes.get("sync", ()) for step, loss in zip(run["steps"], run["val_loss"])
                      if step >= run["total_steps"] / 4 and math.isfinite(loss)]
        top = min(max(later), max(sync_later) + 1.0) if sync_later else max(later)  # a diverging mode: clipped
        margin = 0.05 * (top - min(later)) + 0.01
        ax.set_ylim(min(later) - margin, top + margin)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--setups", default="a,b", help="comma-separated: a (LoRA SmolLM2-135M), b (full FT, small model)")
    p.add_argument("--optimizers", default="adamw,sgd", help=f"comma-separated, of {list(OPTIMIZERS)}")
    p.add_argument("--corrections", default=default_corrections(),
                   help="comma-separated async variants: `none` (plain async) and `staleness_correction` values;"
                        " one the installed strategy refuses is skipped with a message")
    p.add_argument("--no-sync", dest="sync", action="store_false", help="leave out the sync runs (cached ones still count)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1")
    p.add_argument("--first-seed", type=int, default=0,
                   help="train seeds from this one on (the table still shows all --seeds): split seeds over processes")
    p.add_argument("--table-only", action="store_true", help="train nothing: the table and PNG of the runs in <out>")
    p.add_argument("--steps-a", type=int, default=16, help="optimizer steps of setup a")
    p.add_argument("--steps-b", type=int, default=48, help="optimizer steps of setup b")
    p.add_argument("--eval-every-a", type=int, default=4)
    p.add_argument("--eval-every-b", type=int, default=6)
    p.add_argument("--lr-a-adamw", type=float, default=2e-3, help="setup a's AdamW LR (the main job's)")
    p.add_argument("--lr-a-sgd", type=float, default=0.1, help="setup a's SGD LR")
    p.add_argument("--lrs-adamw", default="3e-4,2e-3,1e-2", help="setup b's AdamW learning-rate sweep")
    p.add_argument("--lrs-sgd", default="0.01,0.03,0.06", help="setup b's SGD learning-rate sweep")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--val-blocks", type=int, default=16, help="held-out validation sequences (Hamlet)")
    p.add_argument("--train-blocks", type=int, default=4096, help="training sequences (evenly spaced over the plays)")
    p.add_argument("--devices", type=int, default=2, help="CPU virtual devices")
    p.add_argument("--plan-devices", type=int, default=8, help="RTX 4090s of the planner's prediction")
    p.add_argument("--target-rule", choices=TARGET_RULES, default="all-reach")
    p.add_argument("--min-gap", type=float, default=0.005,
                   help="the smallest sync-async gap (nats) whose closed share is reported")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 seed, setup a 4 steps, b 8 steps, one LR, AdamW only (unless --optimizers is given)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "convergence"), help="output folder")
    p.add_argument("--fresh", action="store_true", help="re-run runs already in <out>/runs.jsonl")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.steps_a, args.steps_b, args.eval_every_a, args.eval_every_b = 1, 4, 8, 2, 4
        args.lrs_adamw, args.lrs_sgd, args.val_blocks = "2e-3", "0.03", 8
        if args.optimizers == p.get_default("optimizers"):
            args.optimizers = "adamw"
        if args.out == p.get_default("out"):
            args.out = str(ROOT / "benchmarks" / "results" / "convergence_quick")
    return args


def _grid(args: argparse.Namespace) -> list[tuple[str, str, float, int, int]]:
    """(setup, optimizer, lr, steps, eval_every) of every group, in run order."""
    out = []
    for setup in args.setups.split(","):
        for optimizer in args.optimizers.split(","):
            optimizer_factory(optimizer, 1.0)  # a bad name fails before any run
            if setup == "a":
                out.append(("a", optimizer, getattr(args, f"lr_a_{optimizer}"), args.steps_a, args.eval_every_a))
            elif setup == "b":
                for lr in getattr(args, f"lrs_{optimizer}").split(","):
                    out.append(("b", optimizer, float(lr), args.steps_b, args.eval_every_b))
            else:
                raise ValueError(f"`--setups` entries must be `a` or `b`, got {setup!r}.")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    cached = {} if args.fresh or not log.exists() else {
        _key(r): r for r in map(json.loads, log.read_text().splitlines()) if r}
    modes = (["sync"] if args.sync else []) + [
        "async" if c == "none" else f"async+{c}" for c in args.corrections.split(",") if c]
    refused: dict[str, str] = {}
    for mode in modes:
        if mode.startswith("async+"):
            try:
                make_strategy(mode)
            except (TypeError, ValueError) as error:
                refused[mode] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
                print(f"skipped {mode}: the installed RoundPipeStrategy refuses staleness_correction="
                      f"{mode.split('+', 1)[1]!r} ({refused[mode]})", flush=True)
    modes = [m for m in modes if m not in refused]  # (said again under the table)
    grid = _grid(args)
    started = time.perf_counter()
    done = 0
    for seed in range(args.first_seed, 0 if args.table_only else args.seeds):  # seeds outermost: whole seeds first
        for setup, optimizer, lr, steps, eval_every in grid:
            for mode in modes:
                key = _key({"setup": setup, "optimizer": optimizer, "lr": lr, "mode": mode, "seed": seed,
                            "total_steps": steps, **_settings(args)})
                if key in cached:
                    continue
                record = run_one(setup, optimizer, lr, mode, seed, steps, eval_every, args)
                cached[key] = record
                with log.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                done += 1
                print(f"[{time.perf_counter() - started:7.0f} s] {setup} {optimizer} lr={lr:g} {mode} seed {seed}:"
                      f" val loss {record['val_loss'][-1]:.4f} after {steps} steps ({record['wall_s']:.0f} s,"
                      f" {record['fit_s_per_step']:.2f} s/step on CPU)", flush=True)
    if log.exists():  # also what another process running beside this one wrote meanwhile
        cached.update({_key(r): r for r in map(json.loads, log.read_text().splitlines()) if r})
    wanted = {(s, o, lr, st) for s, o, lr, st, _ in grid}
    runs = [r for r in cached.values() if (r["setup"], r["optimizer"], r["lr"], r["total_steps"]) in wanted
            and r["seed"] < args.seeds and _settings(args).items() <= r.items()]
    runs.sort(key=lambda r: ([g[:3] for g in grid].index((r["setup"], r["optimizer"], r["lr"])),
                             0 if r["mode"] == "sync" else 1 if r["mode"] == "async" else 2, r["mode"], r["seed"]))
    step_s, untimed = {}, set()
    for setup in sorted({r["setup"] for r in runs}):
        step_s[setup], missing = planner_step_s(setup, args, sorted({r["mode"] for r in runs if r["setup"] == setup}))
        untimed.update(missing)
    lines = [f"convergence: {done} runs trained now, {len(runs)} in the table; {time.perf_counter() - started:.0f} s;"
             f" {args.devices} CPU virtual devices, batch {args.batch_size} x {args.seq_len} tokens,"
             f" {args.val_blocks} x {args.seq_len} held-out tokens"]
    for setup, times in step_s.items():
        lines.append(f"planner ({args.plan_devices} x RTX 4090, bf16, {args.batch_size} microbatches x 1 x {args.seq_len}"
                     f" tokens), setup {setup}: " + ", ".join(f"{mode} {value * 1e3:.2f}" for mode, value in times.items())
                     + f" ms/step (sync/async {times['sync'] / times['async']:.2f}x)")
    if untimed:
        lines.append(f"note: {', '.join(sorted(untimed))} timed at plain async's predicted step: the installed planner"
                     " has no `--staleness-correction` for it, so the correction's host cost is not counted")
    lines += [f"skipped {mode}: {why}" for mode, why in refused.items()]
    lines.append("loss: mean [min,max] over seeds; gap closed: (async - corrected) / (async - sync) at equal steps, %"
                 f" ('-': async not worse than sync by > {args.min_gap} nats); diverged k/n: k seeds NaN, inf or above"
                 " the loss before the first step; a mode with a seed diverged at the end never reaches the target")
    table = "\n".join(lines) + "\n" + format_table(runs, step_s, args.target_rule, args.min_gap)
    print(table)
    (out / "table.txt").write_text(table + "\n")
    plot(runs, out / "convergence.png")
    print(f"\nwrote {out / 'table.txt'}, {out / 'convergence.png'}, {log}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
