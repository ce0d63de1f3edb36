"""The steady state on CPU virtual devices, in one process (DESIGN.md section 11; issue 19).

A Llama-shaped Hugging Face model (random weights, ``--hidden``, ``--layers``) is fine-tuned with
``Trainer(strategy=RoundPipeStrategy(...))`` on CPU virtual devices, in each mode:

- ``sync``: ``optimizer="sync"``, every batch drains, then the optimizer step;
- ``async-drained``: ``optimizer="async", overlap_batches=False`` (before the steady state: the
  optimizer step overlaps the next pipeline, the pipeline drains every step);
- ``async``: ``optimizer="async"`` (the steady state: step k+1's pipeline is issued while step k's
  backward stages drain);
- ``sync-accum4-drained`` / ``sync-accum4``: ``accumulate_grad_batches=4`` without / with the
  overlap of the accumulated batches (seconds per batch).

The optimizer is ``torch.optim.AdamW(..., fused=True)`` (``--optimizer``: ``adamw-unfused``, torch's
default per-tensor loop, or fused ``sgd``). Three cuts of the model: ``one`` (one forward stage, the fused tail, one backward stage: 3 stages
on 2 devices, so the round robin leaves one device idle through each drain, the largest steady-state
gain), ``odd`` (2 forward stages: 5 stages, the devices unevenly filled) and ``even`` (3 forward
stages: 6). Each mode runs ``--repeats`` times, modes interleaved, so a shared machine slows all alike. Printed per mode: measured seconds per
batch (median of the batch-to-batch times after the profiled steps and ``--warmup`` batches), the
mean measured bubble (per device, the share of the measured window its compute stream ran no op,
from the executor's timelines on the host clock, between the first measured batch's start and the
last batch's start: the fit's final drain, which no next step fills, is left out), and the
strategy's own prediction (``roundpipe/predicted_step(s)``, median over the same batches, for the drained modes; the
simulator's steady-state program, the host's optimizer step at its measured rate included, for
``async`` and ``sync-accum4``) with the simulator's mean idle for that mode. ``--verbose`` also
prints the compute streams' busy seconds per batch and mean op times per kind (CPU contention: the
overlapped modes leave no bubble for the host's own work). Also per mode: the process's CPU seconds
per batch (all threads: devices, copies, optimizer, Lightning), the cores they kept busy, and the
bound they set on this machine (CPU seconds / cores: no schedule runs a batch faster; on CPU
virtual devices the host's work and the devices' share the cores, on GPUs they do not). Then the
ratios async / sync and sync-accum4 / sync-accum4-drained, measured and predicted.

Run: ``python benchmarks/steady_state.py [--devices 2] [--layers 8] [--hidden 256] [--seq 128]
[--batch 12] [--microbatches 4]`` (about 20 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_roundpipe
from lightning_roundpipe.runtime.execution.executor import Executor
from lightning_roundpipe.runtime.tuning.optimizer_mode import predicted_optimizer_s, steady_state_prediction
from lightning_roundpipe.simulate import simulate_program

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
MODES = {
    "sync": (dict(optimizer="sync"), 1),
    "async-drained": (dict(optimizer="async", overlap_batches=False), 1),
    "async": (dict(optimizer="async"), 1),
    "sync-accum4-drained": (dict(optimizer="sync", overlap_batches=False), 4),
    "sync-accum4": (dict(optimizer="sync"), 4),
}


class Tokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class Module(L.LightningModule):
    def __init__(self, model: torch.nn.Module, optimizer: str) -> None:
        super().__init__()
        self.model, self.optimizer_name = model, optimizer

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.model.parameters(), lr=1e-3, fused=True)
        # on the CPU the fused kernel is the fastest AdamW (docs/usage.md); "adamw-unfused": torch's default
        return torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=self.optimizer_name == "adamw")


def make_model(args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq, tie_word_embeddings=True)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def cuts(layers: int) -> dict[str, tuple[list, list]]:
    """Forward / backward stages over the adapter's ``layers + 2`` layers (prefix, decoders, tail):
    ``odd`` 2 forward stages, the fused tail and 2 backward stages (5 stages), ``even`` 3 forward
    stages, the tail and 2 backward stages (6)."""
    body = layers + 1  # prefix and decoders; the tail is layer `body`

    def split(count: int) -> list[list[int]]:
        bounds = [round(i * body / count) for i in range(count + 1)]
        return [[bounds[i], bounds[i + 1]] for i in range(count)]

    backward = [[body, body + 1]] + split(2)[::-1]
    return {"odd": (split(2) + [[body, body + 1]], backward), "even": (split(3) + [[body, body + 1]], backward),
            "one": (split(1) + [[body, body + 1]], [[body, body + 1]] + split(1))}


class Clock(L.Callback):
    def __init__(self, skip: int, mode: str, accumulate: int, microbatches: int) -> None:
        self.skip, self.starts, self.cpu_s, self.predicted = skip, [], [], []
        self.mode, self.accumulate, self.microbatches = mode, accumulate, microbatches
        self.predicted_idle, self.predicted_steady = float("nan"), None

    def on_train_end(self, trainer, pl_module) -> None:
        choice = trainer.strategy.engine.plan_choice  # the automatic choice (partition="auto"), else None
        self.choice = None if choice is None else dict(
            forward_stages=[[r.start, r.stop] for r in choice.partition.forward_stages],
            backward_stages=[[r.start, r.stop] for r in choice.partition.backward_stages],
            microbatches_per_round=choice.microbatches_per_round, num_microbatches=choice.num_microbatches)
        self.predicted_steady, self.predicted_idle = predicted_idle(trainer.strategy.engine, self.mode, self.accumulate,
                                                                    self.microbatches)
        self.predicted_drained = predicted_drained(trainer.strategy.engine, self.mode, self.accumulate, self.microbatches)
        self.optimizer_samples = [seconds for _, seconds in getattr(trainer.strategy.engine, "_optimizer_samples", [])]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_s.append(time.process_time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if len(self.starts) > self.skip:
            value = trainer.strategy.step_metrics.get("roundpipe/predicted_step(s)")
            if value is not None:
                self.predicted.append(float(value))


def busy_idle(timelines: list, num_devices: int, window: tuple[float, float]) -> float:
    """Mean per-device idle % of the compute streams over ``window`` (host ``perf_counter`` seconds:
    from the first measured batch's start to the last batch's start, so the fit's final drain, which
    no next step fills, is left out in every mode alike), op intervals clipped to it."""
    start, end = window
    spans = [(max(start, t.origin_s + i.start_s), min(end, t.origin_s + i.end_s), i.device_index)
             for t in timelines for i in t.intervals if i.stream == "compute"]
    return sum(100.0 * (1.0 - sum(max(0.0, e - s) for s, e, d in spans if d == device) / (end - start))
               for device in range(num_devices)) / num_devices


def predicted_idle(engine, mode: str, accumulate: int, microbatches: int) -> tuple[float | None, float]:
    """The simulator's (seconds per batch, mean idle %) for the mode: the steady-state program for the
    overlapped modes (the host's ``OPT`` at the measured optimizer rate), the drained program's idle
    (seconds ``None``: the strategy's own ``roundpipe/predicted_step(s)`` is used) otherwise."""
    microbatches = engine.split_num_microbatches or microbatches  # the automatic choice's finer cut, if any
    if mode in ("async", "sync-accum4"):
        steady = steady_state_prediction(engine, engine.fused_stages, engine.measured_profiles,
                                         engine.microbatches_per_round, microbatches,
                                         mode="async" if mode == "async" else "sync",
                                         accumulate_grad_batches=accumulate)
        return steady.step_s, steady.mean_idle_pct
    program = engine.program(microbatches, 0, fused=True)
    return None, simulate_program(program, engine.measured_profiles, engine.hardware_model(),
                                  microbatch_weights=engine.microbatch_weights(microbatches)).mean_idle_pct


def predicted_drained(engine, mode: str, accumulate: int, microbatches: int) -> float:
    """The simulator's seconds per batch of the same run drained every batch, from this run's own
    layer profiles and optimizer rate: async, ``max(pipeline, OPT)``; sync, ``pipeline + OPT /
    accumulate``. Beside the overlapped run's prediction, the gain the simulator sees with one
    set of profiles (each run profiles its own layers, under its own contention for the cores)."""
    microbatches = engine.split_num_microbatches or microbatches
    program = engine.program(microbatches, 0, fused=True)
    pipeline = simulate_program(program, engine.measured_profiles, engine.hardware_model(),
                                microbatch_weights=engine.microbatch_weights(microbatches)).iteration_s
    optimizer_s = predicted_optimizer_s(engine) or 0.0
    return max(pipeline, optimizer_s) if mode.startswith("async") else pipeline + optimizer_s / accumulate


def run(mode: str, cut: tuple[list, list] | dict | None, args, devices: int | None = None) -> dict:
    """One fit in ``mode``: ``cut`` is ``(forward, backward)`` stages, the keyword arguments of an
    explicit plan (a recorded automatic choice), or ``None`` (``partition="auto"``)."""
    kwargs, accumulate = MODES[mode]
    profile_steps = 3
    skip = (profile_steps + args.warmup) * accumulate
    batches = skip + args.batches * accumulate
    finished: list = []
    real_finish = Executor.finish

    def finish(executor, run_):
        timeline = real_finish(executor, run_)
        finished.append((clock_count(), timeline))
        return timeline

    clock = Clock(skip, mode, accumulate, args.microbatches)

    def clock_count() -> int:
        return len(clock.starts)

    Executor.finish = finish
    module = Module(make_model(args), args.optimizer)
    plan = (dict(num_microbatches=args.microbatches) if cut is None else dict(cut) if isinstance(cut, dict)
            else dict(num_microbatches=args.microbatches, forward_stages=cut[0], backward_stages=cut[1]))
    strategy = lightning_roundpipe.RoundPipeStrategy(profile_steps=profile_steps, trace_every_n_steps=0, **plan,
                                                     **kwargs)
    devices = devices or args.devices
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=batches // accumulate,
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[clock])
    try:
        trainer.fit(module, DataLoader(Tokens(batches * args.batch, args.seq, 512), batch_size=args.batch))
    finally:
        Executor.finish = real_finish
    end = time.perf_counter()
    starts = clock.starts[skip:] + [end]
    per_batch = statistics.median(b - a for a, b in zip(starts, starts[1:]))
    timelines = [timeline for count, timeline in finished if count > skip and timeline is not None]
    predicted = clock.predicted  # the programs each batch ran (one batch's, also when accumulating)
    if args.verbose:
        ops = [(i.kind, i.end_s - i.start_s) for t in timelines for i in t.intervals if i.stream == "compute"]
        kinds = sorted({k for k, _ in ops})
        print(f"  {mode}: {len(timelines)} timelines, compute busy "
              f"{sum(d for _, d in ops) / max(1, len(timelines)):.4f} s/batch; mean op s "
              + ", ".join(f"{k}={statistics.mean(d for kk, d in ops if kk == k):.4f}x{sum(1 for kk, _ in ops if kk == k)}"
                          for k in kinds)
              + f"; optimizer steps measured while profiling (s): {[round(v, 4) for v in clock.optimizer_samples]}")
    # the process's CPU seconds (every thread) per batch over the same window, and the cores they used
    window_s = clock.starts[-1] - clock.starts[skip]
    cpu_per_batch = (clock.cpu_s[-1] - clock.cpu_s[skip]) / (len(clock.starts) - 1 - skip)
    return {"step": per_batch, "idle": busy_idle(timelines, devices, (clock.starts[skip], clock.starts[-1])),
            "cpu": cpu_per_batch, "cores": (clock.cpu_s[-1] - clock.cpu_s[skip]) / window_s,
            "choice": getattr(clock, "choice", None),
            "predicted": (clock.predicted_steady if clock.predicted_steady is not None
                          else statistics.median(predicted) if predicted else float("nan")),
            "predicted_idle": clock.predicted_idle, "predicted_drained": clock.predicted_drained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--optimizer", choices=["adamw", "adamw-unfused", "sgd"], default="adamw")
    parser.add_argument("--cuts", default="one,odd,even")
    parser.add_argument("--compare-choice", action="store_true",
                        help="on 2 and 3 devices: the automatic choice made for the steady state vs the one made for"
                             " drained steps (the choice before the steady state), both run in the steady state")
    parser.add_argument("--compare-devices", default="2,3", help="device counts of --compare-choice")
    parser.add_argument("--verbose", action="store_true", help="per mode: compute busy seconds and mean op times")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    modes = args.modes.split(",")
    if args.compare_choice:
        compare_choice(args)
        return
    for cut_name, cut in cuts(args.layers).items():
        if cut_name not in args.cuts.split(","):
            continue
        measured: dict[str, list[dict]] = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode in modes:
                measured[mode].append(run(mode, cut, args))
        print(f"\n{cut_name} cut: forward {cut[0]} + fused tail, {args.devices} CPU virtual devices, Llama"
              f" {args.layers} layers x {args.hidden}, batch {args.batch} x {args.seq} tokens,"
              f" {args.microbatches} microbatches, {args.optimizer}, {args.repeats} repeats")
        print(f"{'mode':<21}{'s/batch':>9}{'predicted':>11}{'meas/pred':>11}{'bubble %':>10}{'predicted %':>13}"
              f"{'CPU s/batch':>13}{'cores used':>12}{'CPU bound':>11}")
        medians = {}
        for mode in modes:
            runs = measured[mode]
            step = statistics.median(r["step"] for r in runs)
            idle = statistics.median(r["idle"] for r in runs)
            predicted = statistics.median(r["predicted"] for r in runs)
            medians[mode] = (step, predicted, statistics.median(r["predicted_drained"] for r in runs))
            p_idle = statistics.median(r["predicted_idle"] for r in runs)
            cpu, cores = (statistics.median(r[key] for r in runs) for key in ("cpu", "cores"))
            print(f"{mode:<21}{step:>9.4f}{predicted:>11.4f}{step / predicted:>11.2f}{idle:>10.1f}{p_idle:>13.1f}"
                  f"{cpu:>13.4f}{cores:>12.2f}{cpu / CORES:>11.4f}")
        for a, b in (("async", "sync"), ("async", "async-drained"), ("sync-accum4", "sync-accum4-drained")):
            if a in medians and b in medians:
                print(f"{a} / {b}: {medians[a][0] / medians[b][0]:.3f} (predicted {medians[a][1] / medians[b][1]:.3f})")
        for a in ("async", "sync-accum4"):  # the same profiles: the overlapped run's, drained and overlapped
            if a in medians:
                print(f"{a}, its own profiles: overlapped / drained predicted {medians[a][1] / medians[a][2]:.3f}")


def compare_choice(args) -> None:
    """``partition="auto"`` in ``async``: the plan chosen for the steady state (this run) against the
    plan the same automatic choice makes for drained steps (``overlap_batches=False``), the latter
    re-run in the steady state with that plan given explicitly; on 2 and 3 devices."""
    for devices in (int(d) for d in args.compare_devices.split(",")):
        old, new, old_in_steady = [], [], []
        for _ in range(args.repeats):
            drained = run("async-drained", None, args, devices)
            new.append(run("async", None, args, devices))
            old_in_steady.append(run("async", drained["choice"], args, devices))
            old.append(drained)
        now, before = statistics.median(r["step"] for r in new), statistics.median(r["step"] for r in old_in_steady)
        predicted_now, predicted_before = (statistics.median(r["predicted"] for r in runs) for runs in (new, old_in_steady))
        print(f"\n{devices} devices, automatic choice, async steady state: chosen for the steady state {now:.4f} s/batch"
              f" (predicted {predicted_now:.4f}; {new[-1]['choice']}); chosen for drained steps {before:.4f} s/batch"
              f" (predicted {predicted_before:.4f}; {old[-1]['choice']}); ratio {now / before:.3f}"
              f" (predicted {predicted_now / predicted_before:.3f}); {CORES} cores")


if __name__ == "__main__":
    main()
