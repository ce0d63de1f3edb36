"""GPU benchmark for ``scripts/gpu_check.sh``: tokens/s, MFU and predicted vs measured step time.

Runs, in one process, plain Lightning training on one GPU (bf16-mixed) and RoundPipe on every GPU
(bf16-mixed) of a Llama-shaped model, and prints:

- the measured bf16 matmul peak of GPU 0 (8192^3 GEMMs timed with CUDA events), TFLOP/s;
- tokens/s of both runs and their ratio;
- MFU = model FLOPs (6 x non-embedding parameters x tokens, plus attention 12 x layers x hidden x
  seq_len x tokens; recomputation not counted) / step time / (peak x GPUs);
- RoundPipe's ``roundpipe/predicted_step(s)`` (the simulator on the measured layer times and the
  measured pinned link rates) beside ``roundpipe/step(s)``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import lightning_roundpipe  # noqa: E402
from cpu_scaling import LM, RandomTokens, StepTimes  # noqa: E402


def bf16_peak_tflops(n: int = 8192, reps: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def run(args, strategy, devices: int) -> StepTimes:
    import lightning as L
    from torch.utils.data import DataLoader

    timer = StepTimes()
    trainer = L.Trainer(accelerator="cuda", devices=devices, strategy=strategy, precision="bf16-mixed",
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer], log_every_n_steps=1)
    data = DataLoader(RandomTokens(args.batch_size * (args.warmup + args.steps), args.seq_len, args.vocab),
                      batch_size=args.batch_size)
    trainer.fit(LM(args), data)
    timer.times, timer.logged = timer.times[args.warmup:], timer.logged[args.warmup:]
    return timer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    gpus = torch.cuda.device_count()
    peak = bf16_peak_tflops()
    print(f"{gpus} x {torch.cuda.get_device_name(0)}; measured bf16 matmul peak {peak:.1f} TFLOP/s")
    tokens = args.batch_size * args.seq_len
    h, layers = args.hidden, args.layers
    params = layers * (4 * h * h * 0.625 + 3 * h * 4 * h)  # q, o full; k, v at hidden // 4 (GQA); SwiGLU MLP
    flops = 6 * params * tokens + 12 * layers * h * args.seq_len * tokens + 6 * h * args.vocab * tokens
    base = statistics.median(run(args, "auto", 1).times)
    rp_run = run(args, lightning_roundpipe.RoundPipeStrategy(), gpus)
    rp = statistics.median(rp_run.times)
    predicted = [r["roundpipe/predicted_step(s)"] for r in rp_run.logged if "roundpipe/predicted_step(s)" in r]
    print(f"plain 1 GPU: {tokens / base:,.0f} tokens/s, MFU {flops / base / (peak * 1e12):.1%}")
    print(f"RoundPipe {gpus} GPU(s): {tokens / rp:,.0f} tokens/s, MFU {flops / rp / (peak * 1e12 * gpus):.1%};"
          f" ratio RoundPipe/plain {base / rp:.2f}x")
    if predicted:
        pred = statistics.median(predicted)
        print(f"RoundPipe step: measured {rp:.3f} s, predicted {pred:.3f} s ({100 * (pred - rp) / rp:+.1f}%)")


if __name__ == "__main__":
    main()
