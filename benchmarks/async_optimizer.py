"""The asynchronous optimizer's speed-up on CPU virtual devices, in one process.

RoundPipe paper (arXiv 2604.27085) section 4: "RoundPipe" (the CPU optimizer step of step k runs
while the devices compute step k+1) vs "RoundPipe-sync". Model: an ``nn.Sequential`` of wide
``Linear`` + ``GELU`` layers (the transparent path) trained with ``torch.optim.Adam(foreach=False)``,
whose per-tensor CPU step is a noticeable part of the step, over a modelled host link of
``--link-gb-per-s`` (default 3 GB/s per direction: the devices wait for transfers as on PCIe, as in
the paper's setting, so a core is free for the optimizer thread even on a 2-core machine; with
``--link-gb-per-s 0`` the device threads and the optimizer thread compete for the cores).
``optimizer="sync"`` and ``"async"`` runs alternate (``--repeats`` each) so a machine shared with
other work slows both alike.

Printed per mode: seconds per step (per run the median over the ``--steps`` steps after
``--warmup`` of the time from one batch's start to the next's, the last step's up to the end of
fit, so waits for the update in flight are included), the median over the repeats, and the ratio
sync / async. For the sync runs also the measured pipeline and optimizer
seconds per step (``roundpipe/pipeline(s)``, ``roundpipe/optimizer(s)``) and the overlap bound
``(pipeline + optimizer) / max(pipeline, optimizer)``: the simulator has no optimizer op, so this
is the whole model of the gain (on CPU virtual devices the optimizer thread also competes with
the devices for cores). The same bound from the simulator's time for the step's programs
(``roundpipe/predicted_step(s)`` less the measured optimizer time) is printed beside it, and for
the async runs the thread's time per update (``roundpipe/optimizer_thread(s)``: longer than the
sync step when the thread shares the cores with the devices) and the main thread's wait for it
(``roundpipe/optimizer_wait(s)``: 0 when the update hides behind the pipeline).

``--staleness-correction weight_prediction,delay_compensation,gradient_extrapolation`` adds an async
run per correction (``RoundPipeStrategy(staleness_correction=...)``, alternated with the others) and
prints its step time against plain async's.

Run: ``python benchmarks/async_optimizer.py [--devices 2] [--hidden 1024] [--layers 8]
[--link-gb-per-s 3] [--staleness-correction ...]`` (under a minute on 2 cores, plus a run per correction).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("WANDB_MODE", "disabled")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_roundpipe  # noqa: E402


class WideMLP(L.LightningModule):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(hidden, hidden), nn.GELU()]
        self.model = nn.Sequential(*blocks)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4, foreach=False)


class Clock(L.Callback):
    """Start time of every training batch and the end of fit (after the last update in flight)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.starts_s: list[float] = []
        self.pipeline_s: list[float] = []
        self.optimizer_s: list[float] = []
        self.predicted_s: list[float] = []
        self.thread_s: list[float] = []
        self.wait_s: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts_s.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            metrics = getattr(trainer.strategy, "step_metrics", {})  # the previous step's (the strategy's callback runs after this one)
            if "roundpipe/pipeline(s)" in metrics:
                self.pipeline_s.append(float(metrics["roundpipe/pipeline(s)"]))
            if "roundpipe/optimizer(s)" in metrics:
                self.optimizer_s.append(float(metrics["roundpipe/optimizer(s)"]))
            if "roundpipe/optimizer_thread(s)" in metrics:
                self.thread_s.append(float(metrics["roundpipe/optimizer_thread(s)"]))
                self.wait_s.append(float(metrics["roundpipe/optimizer_wait(s)"]))
            if "roundpipe/predicted_step(s)" in metrics:
                self.predicted_s.append(float(metrics["roundpipe/predicted_step(s)"]))

    def on_train_end(self, trainer, pl_module) -> None:
        self.starts_s.append(time.perf_counter())

    @property
    def step_s(self) -> float:
        """Median seconds from one batch's start to the next's (the last: to the end of fit), after
        the warm-up: robust to another process taking the cores for a moment."""
        times = self.starts_s[self.warmup:]
        return statistics.median(later - earlier for earlier, later in zip(times, times[1:]))


def run(args: argparse.Namespace, mode: str, correction: str | None = None) -> Clock:
    rows = args.batch * (args.warmup + args.steps)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(rows, args.hidden, generator=generator),
                         torch.randn(rows, args.hidden, generator=generator))
    clock = Clock(args.warmup)
    link = None if args.link_gb_per_s <= 0 else args.link_gb_per_s * 1e9
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=args.microbatches, partition="default",
                                                     cpu_link_bytes_per_s=link, optimizer=mode,
                                                     staleness_correction=correction)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.warmup + args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[clock], log_every_n_steps=1)
    trainer.fit(WideMLP(args.hidden, args.layers), DataLoader(data, batch_size=args.batch))
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--microbatches", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--link-gb-per-s", type=float, default=3.0,
                        help="modelled host link per direction, GB/s (0: unthrottled copies)")
    parser.add_argument("--staleness-correction", default="",
                        help="comma-separated staleness corrections, each timed as one more async run")
    args = parser.parse_args()
    corrections = [c for c in args.staleness_correction.split(",") if c]
    per_step: dict[str, list[float]] = {"sync": [], "async": [], **{f"async+{c}": [] for c in corrections}}
    pipeline, optimizer, predicted, thread, wait = [], [], [], [], []
    for _ in range(args.repeats):
        for mode in per_step:
            clock = run(args, mode.split("+")[0], mode.split("+")[1] if "+" in mode else None)
            per_step[mode].append(clock.step_s)
            if mode == "sync":
                pipeline += clock.pipeline_s
                optimizer += clock.optimizer_s
                predicted += clock.predicted_s
            elif mode == "async":
                thread += clock.thread_s
                wait += clock.wait_s
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    print(f"\nasync optimizer, {args.devices} CPU virtual devices, {args.layers} x Linear({args.hidden}), "
          f"{params / 1e6:.1f} M parameters, Adam(foreach=False), batch {args.batch}, {args.microbatches} microbatches,"
          f" link {args.link_gb_per_s:g} GB/s, {os.cpu_count()} cores")
    for mode, values in per_step.items():
        print(f"  {mode:5s}: {statistics.median(values) * 1e3:8.1f} ms/step  (runs: "
              + ", ".join(f"{v * 1e3:.1f}" for v in values) + ")")
    ratio = statistics.median(per_step["sync"]) / statistics.median(per_step["async"])
    print(f"  speed-up sync/async: {ratio:.2f}x")
    for correction in corrections:
        cost = statistics.median(per_step[f"async+{correction}"]) / statistics.median(per_step["async"]) - 1
        print(f"  staleness_correction={correction!r}: step time {cost * 100:+.1f} % against plain async")
    if pipeline and optimizer:
        pipe_s, opt_s = statistics.median(pipeline), statistics.median(optimizer)
        print(f"  sync components: pipeline {pipe_s * 1e3:.1f} ms, optimizer {opt_s * 1e3:.1f} ms;"
              f" overlap bound (pipeline + optimizer) / max = {(pipe_s + opt_s) / max(pipe_s, opt_s):.2f}x")
    if thread:
        print(f"  async: the thread ran the updates {statistics.median(thread) * 1e3:.1f} ms per step (sync:"
              f" {statistics.median(optimizer) * 1e3:.1f} ms), the main thread waited"
              f" {statistics.median(wait) * 1e3:.1f} ms per step")
    if predicted and optimizer:
        programs_s = statistics.median(predicted) - statistics.median(optimizer)
        print(f"  simulator: the step's programs {programs_s * 1e3:.1f} ms (no optimizer op: the simulator cannot"
              f" time the overlap itself); with the measured optimizer, sync {(programs_s + opt_s) * 1e3:.1f} ms,"
              f" async >= {max(programs_s, opt_s) * 1e3:.1f} ms: at most"
              f" {(programs_s + opt_s) / max(programs_s, opt_s):.2f}x")


if __name__ == "__main__":
    main()
