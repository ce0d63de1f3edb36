"""CPU virtual devices: a model with dropout scales from 1 to 2 devices as well as without (issue 7).

Model: Llama-shaped (``--layers`` decoder layers, hidden ``--hidden``, vocab ``--vocab``, tied
embeddings, eager attention), batch ``--batch-size`` x ``--seq-len`` tokens, ``32-true``, SGD; one
training step = forward, fused tail, backward and the optimizer. Two variants, each with and
without dropout:

- ``full``: full fine-tuning, ``attention_dropout`` 0.1 vs 0.0 (HF eager attention's ``F.dropout``);
- ``lora``: PEFT LoRA r=8 on ``q,k,v,o_proj`` (the main job's adapter), ``lora_dropout`` 0.05 vs 0.0.

With dropout every decoder layer draws random numbers, so it runs under the private-generator
scope (``runtime/rng.py``). Printed per variant: step seconds (median of the measured steps, after
the warm-up and the profiled steps) on 1 and 2 devices, the 1 -> 2 speed-up, the dropout model's
speed-up relative to the model without dropout (target ~1.0: dropout does not serialise the
devices), and the dropout overhead on 1 device. All figures are ratios of runs in the same process.
Process CPU seconds per step (all threads) are printed beside: on a machine whose cores are busy
with other work a 2-device run cannot get two cores, and the CPU column shows whether the work
itself grew (the dropout scope's overhead) or only the wall time (no free core).

Run: ``python benchmarks/dropout_scaling.py [--only full,lora] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("WANDB_MODE", "disabled")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_roundpipe  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from cpu_scaling import StepTimes, median  # noqa: E402
from throughput import RandomTokens  # noqa: E402


class LM(L.LightningModule):
    def __init__(self, args: argparse.Namespace, variant: str, dropout: bool) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                          num_key_value_heads=max(1, args.hidden // 256), tie_word_embeddings=True,
                          attention_dropout=0.1 if (dropout and variant == "full") else 0.0)
        cfg._attn_implementation = "eager"
        model = LlamaForCausalLM(cfg)
        if variant == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05 if dropout else 0.0,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        self.model = model

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class CpuStepTimes(StepTimes):
    """Wall seconds (``times``) and process CPU seconds (``cpu``, all threads) of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu: list[float] = []
        self._cpu = 0.0

    def on_train_batch_start(self, trainer, *args) -> None:
        super().on_train_batch_start(trainer, *args)
        self._cpu = time.process_time()

    def on_train_batch_end(self, trainer, *args) -> None:
        super().on_train_batch_end(trainer, *args)
        self.cpu.append(time.process_time() - self._cpu)


def step_s(args: argparse.Namespace, variant: str, dropout: bool, devices: int) -> tuple[float, float]:
    """Median wall seconds and median process CPU seconds per training step of one run."""
    timer = CpuStepTimes()
    trainer = L.Trainer(accelerator="cpu", devices=devices,
                        strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=args.num_microbatches),
                        precision="32-true", max_steps=args.warmup + args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer])
    data = DataLoader(RandomTokens(args.batch_size * (args.warmup + args.steps), args.seq_len, args.vocab),
                      batch_size=args.batch_size)
    trainer.fit(LM(args, variant, dropout), data)
    return median(timer.times[args.warmup:]), median(timer.cpu[args.warmup:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4, help="steps dropped (warm-up and the 3 profiled steps)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per run")
    p.add_argument("--only", default="full,lora")
    args = p.parse_args()
    print(f"model: Llama-shaped, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; batch"
          f" {args.batch_size} x {args.seq_len} tokens, {args.num_microbatches} microbatches; 32-true;"
          f" {os.cpu_count()} CPU cores")
    print(f"{'variant':>8} {'dropout':>8} {'1 dev s/step':>13} {'2 dev s/step':>13} {'speed-up':>9}"
          f" {'1 dev CPU s/step':>17} {'2 dev CPU s/step':>17}")
    for variant in (v.strip() for v in args.only.split(",")):
        speedup = {}
        one_device = {}
        for dropout in (False, True):
            one, one_cpu = step_s(args, variant, dropout, 1)
            two, two_cpu = step_s(args, variant, dropout, 2)
            speedup[dropout], one_device[dropout] = one / two, one
            print(f"{variant:>8} {'yes' if dropout else 'no':>8} {one:>13.3f} {two:>13.3f} {one / two:>8.2f}x"
                  f" {one_cpu:>17.3f} {two_cpu:>17.3f}")
        print(f"{variant:>8}: speed-up with dropout / without = {speedup[True] / speedup[False]:.2f} (target ~1.0);"
              f" dropout overhead on 1 device {100 * (one_device[True] / one_device[False] - 1):+.1f}%")


if __name__ == "__main__":
    main()
