"""Host generation cost: `generate()` under RoundPipe (un-pipelined, on the CPU masters) against plain
transformers on the same CPU, SmolLM2-135M-Instruct (fp32), greedy with KV cache.

    python benchmarks/generate.py [--new-tokens 32] [--devices 2]

Prints ms per new token for both and their ratio (same process, interleaved; on shared cores the
absolute numbers are noisy, the ratio less so). The RoundPipe figure is measured inside
`validation_step` of a `Trainer(strategy=RoundPipeStrategy(), accelerator="cpu", devices=N)`.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch

import lightning_roundpipe
from lightning_roundpipe.recipes.smollm2 import load_smollm2_model


class Gen(L.LightningModule):
    def __init__(self, model, prompt, new_tokens, repeats):
        super().__init__()
        self.model, self.prompt, self.new_tokens, self.repeats = model, prompt, new_tokens, repeats
        self.times: list[float] = []

    def validation_step(self, batch, batch_idx):
        for _ in range(self.repeats):
            self.times.append(_time(self.model, self.prompt, self.new_tokens))


def _time(model, prompt, new_tokens) -> float:
    start = time.perf_counter()
    model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
    return (time.perf_counter() - start) / new_tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = load_smollm2_model()
    model.generation_config.use_cache = True
    prompt = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    plain = [_time(model, prompt, args.new_tokens) for _ in range(args.repeats)]
    module = Gen(model, prompt, args.new_tokens, args.repeats)
    trainer = L.Trainer(strategy=lightning_roundpipe.RoundPipeStrategy(), accelerator="cpu", devices=args.devices,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, precision="32-true")
    trainer.validate(module, [torch.zeros(1)], verbose=False)
    after = [_time(model, prompt, args.new_tokens) for _ in range(args.repeats)]
    best_plain, best_rp = min(plain + after), min(module.times)
    print(f"torch threads {torch.get_num_threads()}; plain transformers: {min(plain) * 1e3:.1f} ms/token before,"
          f" {min(after) * 1e3:.1f} after; RoundPipe (host, in validation_step): {best_rp * 1e3:.1f} ms/token;"
          f" ratio to the best plain run {best_rp / best_plain:.2f}")


if __name__ == "__main__":
    main()
