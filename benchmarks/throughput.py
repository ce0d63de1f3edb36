"""Training throughput (tokens/s) of a Llama-shaped model: RoundPipe vs plain training, same process.

    python benchmarks/throughput.py                       # CPU: 2 virtual devices vs the default strategy
    python benchmarks/throughput.py --accelerator cuda    # all GPUs vs plain single-GPU training

Prints one row per run and the ratio RoundPipe / baseline. Timing skips the warm-up steps and uses
``time.perf_counter`` around whole optimizer steps (with ``torch.cuda.synchronize`` on GPUs).
"""

from __future__ import annotations

import argparse
import os
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_roundpipe


class RandomTokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LM(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                          num_key_value_heads=max(1, args.hidden // 256), tie_word_embeddings=True)
        self.model = LlamaForCausalLM(cfg)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepTimer(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = None
        self.steps = 0

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.warmup and self.start is None:
            self._sync()
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.start is not None:
            self.steps += 1

    def on_train_end(self, trainer, *args) -> None:
        self._sync()
        self.elapsed = time.perf_counter() - self.start


def run(args: argparse.Namespace, strategy, devices: int) -> float:
    timer = StepTimer(args.warmup)
    module = LM(args)
    trainer = L.Trainer(accelerator=args.accelerator, devices=devices, strategy=strategy, precision=args.precision,
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    data = DataLoader(RandomTokens(args.batch_size * (args.warmup + args.steps), args.seq_len, args.vocab),
                      batch_size=args.batch_size)
    trainer.fit(module, data)
    return timer.steps * args.batch_size * args.seq_len / timer.elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--devices", type=int, default=None, help="RoundPipe devices (default: 2 on CPU, all GPUs on CUDA)")
    p.add_argument("--num-microbatches", type=int, default=None)
    p.add_argument("--precision", default=None, help="default: 32-true on CPU, bf16-mixed on CUDA")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.precision is None:
        args.precision = "bf16-mixed" if args.accelerator == "cuda" else "32-true"
    devices = args.devices or (torch.cuda.device_count() if args.accelerator == "cuda" else 2)
    base = run(args, "auto", 1)
    rp = run(args, lightning_roundpipe.RoundPipeStrategy(num_microbatches=args.num_microbatches), devices)
    print(f"model: Llama-shaped, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; batch {args.batch_size} x {args.seq_len} tokens; {args.precision}")
    print(f"{'run':<40} {'tokens/s':>12}")
    print(f"{'baseline (default strategy, 1 device)':<40} {base:>12.1f}")
    print(f"{f'roundpipe ({devices} {args.accelerator} devices)':<40} {rp:>12.1f}")
    print(f"ratio roundpipe/baseline: {rp / base:.3f}")


if __name__ == "__main__":
    main()
