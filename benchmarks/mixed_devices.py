"""Mixed devices on CPU: plain round robin vs the weighted dispatch on 2 virtual devices of speeds [1.0, 0.5].

DESIGN.md section 12, issue 21 item 1. One process, the same model, batch and partition (the fixed
default: forward stages of 3 layers, backward stages of 1, fused tail) and the same microbatches for
both plans, so the work is the same and only the device each stage runs on differs:

- ``round_robin``: stage k on device k mod 2, so the half-speed device gets half the stages and sets
  the pace;
- ``weighted``: each stage to the device that would finish it first given its speed and load.

CPU virtual device 1 is throttled to half speed (``cpu_device_speeds=[1.0, 0.5]``: its compute thread
sleeps as long as each op ran). The device speeds are measured after the warm-up step, the layers are
profiled for ``profile_steps`` steps, and from then on every step logs the simulator's prediction for
the very programs it ran (``roundpipe/predicted_step(s)``) beside its measured time
(``roundpipe/step(s)``). Printed: per plan the median measured and predicted seconds per step over
the measured steps and their ratio (target within 15 %), the weighted plan's speed-up over the round
robin (target >= 1.2x), and the simulator's predicted speed-up.

Model: Llama-shaped (8 decoder layers, hidden 256, vocab 8192, tied embeddings), batch 8 x 256 tokens,
``32-true``, SGD. Two CPU virtual devices need two idle cores: the machine's own 2-thread speed-up on
plain matrix multiplies is printed before and after (2.0 on an idle 2-core machine). Run:
``python benchmarks/mixed_devices.py [--steps 4] [--microbatches 8] [--repeats 1]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("WANDB_MODE", "disabled")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_roundpipe  # noqa: E402
from cpu_scaling import LM  # noqa: E402  (the same Llama-shaped module, SGD)

sys.path.insert(0, os.path.dirname(__file__))
from throughput import RandomTokens  # noqa: E402


class StepMetrics(L.Callback):
    """RoundPipe's per-step metrics (measured and predicted step seconds) and the engine at the end."""

    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []
        self.engine = None

    def on_train_batch_end(self, trainer, *args) -> None:
        self.logged.append({k: float(v) for k, v in trainer.strategy.step_metrics.items() if k.startswith("roundpipe/")})

    def on_train_end(self, trainer, *args) -> None:
        self.engine = trainer.strategy.engine


def run(args: argparse.Namespace, dispatch: str) -> StepMetrics:
    metrics = StepMetrics()
    strategy = lightning_roundpipe.RoundPipeStrategy(
        num_microbatches=args.microbatches, partition="default", profile_steps=args.profile_steps,
        cpu_device_speeds=[1.0, args.slow_speed], dispatch=dispatch, trace_every_n_steps=0)
    steps = args.profile_steps + args.steps
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[metrics], log_every_n_steps=1)
    data = DataLoader(RandomTokens(args.batch_size * steps, args.seq_len, args.vocab), batch_size=args.batch_size)
    trainer.fit(LM(args), data)
    metrics.logged = metrics.logged[args.profile_steps:]  # warm-up and profiled steps
    return metrics


def two_thread_speedup(seconds: float = 0.3) -> float:
    """This machine's own 2-thread speed-up right now: fp32 matrix multiplies on one thread for
    ``seconds``, then on two threads at once (one intra-op thread each, as the CPU driver's compute
    threads run); with two idle cores about 2.0, lower while other work shares them."""
    import threading

    from lightning_roundpipe.runtime.backends.threads import limit_this_thread

    def work(count: list, stop: float) -> None:
        limit_this_thread(1)
        a = torch.randn(256, 256)
        while time.perf_counter() < stop:
            a @ a
            count[0] += 1

    def rate(threads: int) -> float:
        counts = [[0] for _ in range(threads)]
        stop = time.perf_counter() + seconds
        workers = [threading.Thread(target=work, args=(c, stop)) for c in counts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return sum(c[0] for c in counts)

    return rate(2) / rate(1)


def median_of(metrics: StepMetrics, key: str) -> float:
    values = [row[key] for row in metrics.logged if key in row]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per plan (after the profiled ones)")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps (the first is warm-up)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--slow-speed", type=float, default=0.5, help="relative speed of device 1")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs (round robin, then weighted)")
    args = parser.parse_args()

    started = time.perf_counter()
    before = two_thread_speedup()
    pairs = [{rule: run(args, rule) for rule in ("round_robin", "weighted")} for _ in range(args.repeats)]
    after = two_thread_speedup()
    for index, results in enumerate(pairs):
        report(args, results, f"pair {index + 1}/{args.repeats}")
    if args.repeats > 1:
        ratios = [median_of(p["round_robin"], "roundpipe/step(s)") / median_of(p["weighted"], "roundpipe/step(s)")
                  for p in pairs]
        print(f"median measured speed-up over {args.repeats} pairs: {statistics.median(ratios):.2f}x"
              f" (range {min(ratios):.2f}-{max(ratios):.2f}x)")
    print(f"this machine's 2-thread speed-up on plain matrix multiplies (2.0: two idle cores): {before:.2f}x before,"
          f" {after:.2f}x after; total {time.perf_counter() - started:.0f} s")


def report(args: argparse.Namespace, results: dict, label: str) -> None:
    print(f"\n== mixed devices ({label}): 2 CPU virtual devices, speeds [1.0, {args.slow_speed}], Llama-shaped"
          f" ({args.layers} layers, hidden {args.hidden}), batch {args.batch_size} x {args.seq_len} tokens,"
          f" {args.microbatches} microbatches, default partition; medians over {args.steps} steps")
    print(f"{'dispatch':<12} {'measured s/step':>16} {'predicted s/step':>17} {'measured/predicted':>19}"
          f"  stage dispatches per device  speeds")
    measured = {}
    predicted = {}
    for rule, metrics in results.items():
        measured[rule] = median_of(metrics, "roundpipe/step(s)")
        predicted[rule] = median_of(metrics, "roundpipe/predicted_step(s)")
        engine = metrics.engine
        plan = engine.plan(engine._last_call[0], 0, fused=engine._last_call[1])
        loads = [sum(1 for a in actions if a.kind.value == "LOAD") for actions in plan.actions]
        # CPU virtual devices run at their configured speeds (no probe); GPUs at the measured ones
        speeds = [round(s, 3) for s in (getattr(engine, "measured_device_speeds", None) or engine.device_speeds or [])]
        print(f"{rule:<12} {measured[rule]:>16.3f} {predicted[rule]:>17.3f} {measured[rule] / predicted[rule]:>19.3f}"
              f"  {loads!s:<27}  {speeds}")
    print(f"weighted speed-up over round robin: measured {measured['round_robin'] / measured['weighted']:.2f}x"
          f" (target >= 1.2x), predicted {predicted['round_robin'] / predicted['weighted']:.2f}x;"
          f" measured/predicted within {100 * max(abs(measured[r] / predicted[r] - 1) for r in measured):.1f} %"
          f" (target 15 %)")


if __name__ == "__main__":
    main()
