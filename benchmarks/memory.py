"""Host bytes per parameter: full fine-tuning and LoRA, ``32-true`` and ``bf16-mixed`` (issue 7 item 5).

1. A tiny Llama (4 decoder layers, hidden 64, vocab 1024, tied embeddings) trained 2 steps with
   AdamW under ``strategy="roundpipe"`` on 2 CPU virtual devices; at the end of the last step
   :func:`~lightning_roundpipe.runtime.host.memory.host_memory` counts, per trainable and per frozen
   parameter: the parameter tensors (masters), separate compute-dtype shadows, ``.grad``, host
   gradient buffers (peak during the step) and AdamW's state. The paper's figure for comparison:
   20 bytes per trainable parameter = 2 compute + 2 gradient slot + 4 master + 4 fp32 gradient + 8 Adam.
2. ``--smollm2``: the main job's model (SmolLM2-135M with the LoRA of ``conf/model/smollm2_lora.yaml``)
   from the local cache: host bytes per frozen parameter and the per-step weight H2D bytes from the
   weight store's stage sizes (a formula, nothing is trained).

Run: ``python benchmarks/memory.py [--smollm2]``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("WANDB_MODE", "disabled")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_roundpipe  # noqa: E402
from lightning_roundpipe.runtime.host.memory import PAPER_BYTES_PER_TRAINABLE_PARAM, HostMemory, host_memory  # noqa: E402

COLUMNS = ("master", "shadow", "grad", "grad_buffer", "optimizer", "total")


class LM(L.LightningModule):
    def __init__(self, lora: bool) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        self.model = LlamaForCausalLM(cfg)
        if lora:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class Capture(lightning_roundpipe.RoundPipeMetricsCallback):
    """Counts host memory at the end of every step, before the parent pops the gradient-buffer peak."""

    memory: HostMemory | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        self.memory = host_memory(engine.store, trainer.optimizers, engine.executor.peak_grad_bytes)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def tiny_table() -> None:
    ids = torch.randint(0, 1024, (16, 32), generator=torch.Generator().manual_seed(1))
    print("host bytes per parameter (tiny Llama, AdamW, strategy=roundpipe, 2 CPU virtual devices)")
    print(f"{'run':<22} {'group':<10} {'params':>8} " + " ".join(f"{c:>11}" for c in COLUMNS))
    for lora in (False, True):
        for precision in ("32-true", "bf16-mixed"):
            capture = Capture()
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3),
                                precision=precision, max_steps=2, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[capture])
            trainer.fit(LM(lora), DataLoader(TensorDataset(ids), batch_size=8))
            for name in ("trainable", "frozen"):
                group = getattr(capture.memory, name)
                per = group.per_param()
                if per:
                    run = f"{'LoRA' if lora else 'full'} {precision}"
                    print(f"{run:<22} {name:<10} {group.num_params:>8} " + " ".join(f"{per[c]:>11.2f}" for c in COLUMNS))
    paper = PAPER_BYTES_PER_TRAINABLE_PARAM
    print(f"{'paper (mixed, Adam)':<22} {'trainable':<10} {'':>8} {paper['master']:>11.2f} {paper['compute copy']:>11.2f}"
          f" {paper['fp32 gradient']:>11.2f} {paper['gradient slot']:>11.2f} {paper['adam']:>11.2f} {sum(paper.values()):>11.2f}")
    print("optimizer: AdamW's two fp32 moments and one fp32 `step` per tensor. grad_buffer: host gradient buffers at the\n"
          "step's peak beyond .grad: the fused path's fp32 buffers (they become the new .grad) held while the last\n"
          "step's .grad still exists (Lightning zeroes it after `training_step`), plus a tied weight's second download\n"
          "(full fine-tuning). total: the step's peak. The paper's 2-byte gradient slot is a bf16 download; here\n"
          "gradients come down in fp32 (summed over microbatches in fp32 on the device).")


def smollm2_figures() -> None:
    from peft import LoraConfig, get_peft_model

    from lightning_roundpipe.adapters import make_layer_sequence
    from lightning_roundpipe.recipes.smollm2 import load_smollm2_model
    from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine

    model = get_peft_model(load_smollm2_model(), LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.05,
                                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    seq = make_layer_sequence(model)
    print("\nSmolLM2-135M + LoRA r=16 (main job), 2 CPU virtual devices, default partition, one round per step")
    for precision, dtype in (("32-true", None), ("bf16-mixed", torch.bfloat16)):
        engine = RoundPipeEngine(seq, [torch.device("cpu")] * 2, num_microbatches=3, compute_dtype=dtype, autocast_dtype=dtype)
        try:
            engine.store.refresh()
            memory = engine.host_memory()
            h2d = sum(engine.store.stage_bytes(s.layers) for s in engine.fused_stages)
            d2h = sum(engine.store.stage_grad_bytes(s.layers) for s in engine.fused_stages if s.kind == "backward")
            frozen = memory.frozen
            before = frozen.num_params * (4 + (2 if dtype is not None else 0))  # fp32 master + bf16 shadow
            print(f"  {precision:<10} frozen params {frozen.num_params / 1e6:6.1f} M: host {frozen.total_bytes / frozen.num_params:.1f}"
                  f" bytes/param (before: {before / frozen.num_params:.1f}); per-step weight H2D {h2d / 2**20:7.1f} MiB"
                  f" (unchanged: uploads were already in the compute dtype); gradient D2H {d2h / 2**20:5.2f} MiB"
                  f" (before: {(d2h if dtype is None else d2h // 2) / 2**20:5.2f} MiB, gradients in the compute dtype)")
        finally:
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true", help="also the main job's model from the local cache")
    args = parser.parse_args()
    tiny_table()
    if args.smollm2:
        smollm2_figures()


if __name__ == "__main__":
    main()
