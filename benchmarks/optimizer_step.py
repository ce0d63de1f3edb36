"""The optimizer step of a RoundPipe fit on CPU virtual devices vs a plain AdamW step, in one process.

Issue 20 ("the optimizer step stalls on CPU virtual devices"): the tiny Llama of the tests
(``tests/_helpers.py`` ``tiny_hf``: 5 layers, hidden 32, vocab 512, fp32) is fitted with
``RoundPipeStrategy`` on ``--devices`` CPU virtual devices and ``torch.optim.AdamW``; right before and
right after the fit, in the same process, a plain AdamW step is timed on copies of the same
parameters (same shapes and values, random gradients), with no RoundPipe thread running.

Printed per fit (over the measured steps, after ``--warmup`` steps, which include the profiled steps
of the automatic partition; means, as the stall hits some steps only, with median, p90 and max):

- ``optimizer.step()``: the wall time of the optimizer's own step inside the fit (the closure,
  i.e. forward and backward, excluded), and the strategy's ``roundpipe/optimizer(s)`` (from
  ``on_before_optimizer_step`` to the end of the batch: the step, ``zero_grad`` and what the strategy
  does after the step), read from ``strategy.step_metrics``;
- the plain step right before and right after the fit, and the whole step (``roundpipe/step(s)``);
- the ratio of the means ``optimizer.step()`` / plain step before the fit (target <= 3x), and the
  same for ``roundpipe/optimizer(s)``.

The fits run back to back, so a machine shared with other work slows the baselines and the fits
alike. At the end: the median ratios over the fits, also against the plain step before the first
fit (once a fit has left a setting behind, the next fit's "before" is no clean baseline), the plain
step after the last fit over the plain step before the first (a
process-wide setting the fit leaves behind shows here, and in the next fit's "before"), the main
thread's intra-op thread count, the count a thread started after the fits gets, and (where the MKL
build tells) whether MKL may choose its thread count per call ("dynamic"): the process-wide settings
the CPU driver's worker threads must leave as they found them
(:mod:`lightning_roundpipe.runtime.backends.threads`).

Run: ``python benchmarks/optimizer_step.py [--devices 2] [--steps 30] [--warmup 6] [--repeats 2]``
(about half a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("WANDB_MODE", "disabled")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_roundpipe  # noqa: E402
from lightning_roundpipe.runtime.backends.threads import mkl_dynamic  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _helpers import CausalLMModule, TokenData, tiny_hf  # noqa: E402


class TimedAdamW(torch.optim.AdamW):
    """``AdamW`` that records the wall time of each step without its closure, seconds."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_s: list[float] = []

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        super().step()
        self.step_s.append(time.perf_counter() - start)
        return loss


class Module(CausalLMModule):
    def configure_optimizers(self):
        return TimedAdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class StepMetrics(L.Callback):
    """``roundpipe/optimizer(s)`` and ``roundpipe/step(s)`` of every batch, seconds."""

    def __init__(self) -> None:
        self.optimizer_s: list[float] = []
        self.step_s: list[float] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        metrics = trainer.strategy.step_metrics
        if "roundpipe/optimizer(s)" in metrics:
            self.optimizer_s.append(float(metrics["roundpipe/optimizer(s)"]))
            self.step_s.append(float(metrics["roundpipe/step(s)"]))


def plain_step_s(params: list[torch.Tensor], steps: int = 30, skip: int = 3) -> list[float]:
    """Wall times of plain ``AdamW`` steps on copies of ``params`` (random gradients), seconds."""
    copies = [p.detach().clone().requires_grad_() for p in params]
    for copy in copies:
        copy.grad = torch.randn_like(copy)
    optimizer = torch.optim.AdamW(copies, lr=1e-3)
    times = []
    for _ in range(skip + steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times[skip:]


def fresh_thread_num_threads() -> int:
    """The intra-op thread count a thread started now gets (torch initialises it per thread)."""
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(xs: list[float]) -> str:
    return (f"mean {1e3 * statistics.fmean(xs):.2f} ms (median {1e3 * statistics.median(xs):.2f},"
            f" p90 {1e3 * percentile(xs, 0.9):.2f}, max {1e3 * max(xs):.2f})")


def run(args: argparse.Namespace, params: list[torch.Tensor], repeat: int) -> tuple[float, float, float]:
    """One fit; returns the ratio of the fit's mean ``optimizer.step()`` and ``roundpipe/optimizer(s)``
    to the plain step right before it, and the fit's mean ``optimizer.step()``, seconds."""
    module = Module(tiny_hf(layers=args.layers), lr=1e-3)
    before = plain_step_s(params)
    metric = StepMetrics()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices,
                        strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=args.num_microbatches),
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        log_every_n_steps=1, callbacks=[metric], default_root_dir=args.root)
    data = DataLoader(TokenData(args.batch_size * (args.warmup + args.steps)), batch_size=args.batch_size)
    trainer.fit(module, data)
    after = plain_step_s(params)
    steps = trainer.optimizers[0].step_s[args.warmup:]
    logged = metric.optimizer_s[args.warmup:]
    plain = statistics.fmean(before)
    step_ratio, logged_ratio = statistics.fmean(steps) / plain, statistics.fmean(logged) / plain
    print(f"fit {repeat + 1}/{args.repeats}:\n  optimizer.step() in the fit    {ms(steps)}\n"
          f"  roundpipe/optimizer(s)         {ms(logged)}\n  plain AdamW step right before  {ms(before)}\n"
          f"  plain AdamW step right after   {ms(after)}\n"
          f"  whole step roundpipe/step(s): median {1e3 * statistics.median(metric.step_s[args.warmup:]):.1f} ms\n"
          f"  optimizer.step() / plain step before (means) {step_ratio:.2f}x, roundpipe/optimizer(s) / plain"
          f" {logged_ratio:.2f}x (target <= 3x); plain after / before {statistics.fmean(after) / plain:.2f}x")
    return step_ratio, logged_ratio, statistics.fmean(steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=6, help="steps dropped (warm-up and the profiled steps)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per fit")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    import tempfile

    args.root = tempfile.mkdtemp(prefix="roundpipe-optimizer-step-")
    threads_before = torch.get_num_threads()
    print(f"tiny Llama ({args.layers} layers, hidden 32), AdamW, {args.devices} CPU virtual devices,"
          f" num_microbatches={args.num_microbatches}, batch {args.batch_size}; {os.cpu_count()} CPU cores;"
          f" main thread intra-op threads {threads_before}, MKL dynamic {mkl_dynamic()}")
    params = [param for param in tiny_hf(layers=args.layers).parameters() if param.requires_grad]
    first = plain_step_s(params)
    ratios = [run(args, params, repeat) for repeat in range(args.repeats)]
    last = plain_step_s(params)
    print(f"median over {args.repeats} fits: optimizer.step() / plain step right before the fit"
          f" {statistics.median(r[0] for r in ratios):.2f}x, roundpipe/optimizer(s) / plain"
          f" {statistics.median(r[1] for r in ratios):.2f}x; optimizer.step() / plain step before the first fit"
          f" (a baseline no fit has touched) {statistics.median(r[2] for r in ratios) / statistics.fmean(first):.2f}x"
          " (target <= 3x)")
    print(f"plain AdamW step after the last fit / before the first fit (means):"
          f" {statistics.fmean(last) / statistics.fmean(first):.2f}x")
    print(f"after the fits: main thread intra-op threads {torch.get_num_threads()} (before {threads_before}),"
          f" a new thread's {fresh_thread_num_threads()}, MKL dynamic {mkl_dynamic()}")


if __name__ == "__main__":
    main()
