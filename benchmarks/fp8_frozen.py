"""fp8 and NF4 frozen weights (``frozen_weights="fp8"``/``"nf4"``, issues 21 and 33): memory and loss on the main job.

1. **Conversion** of SmolLM2-135M + LoRA (the main job's model, fp32 masters, loaded without mmap): the
   weight store converts the frozen base linears one at a time. Printed: the process's resident memory
   (``VmRSS``) before and after, and its peak during the conversion (``VmHWM``, reset through
   ``/proc/self/clear_refs`` right before), against the bytes of the fp32 base and of its fp8 copy, and
   the resident memory once glibc has returned the freed heap pages (``malloc_trim(0)``: SmolLM2's weights,
   1-3.5 MB each, live in malloc's heap, whose free pages stay resident until trimmed; weights above
   malloc's mmap threshold, at most 32 MiB, go back to the system when freed).
2. **Training**: the main job (``conf/``: SmolLM2-135M-Instruct, LoRA r=16 on the attention
   projections, Shakespeare, the same seed) on 2 CPU virtual devices under ``bf16-mixed`` for
   ``--steps`` steps, once per ``--modes`` entry (default: the bf16 base, ``frozen_weights=None``, the fp8
   base and the NF4 base), in this process, one after the other. Printed per run: the logged
   ``roundpipe/frozen_matmul_host_bytes_per_param(bytes)``, ``roundpipe/frozen_host_bytes_per_param(bytes)``
   and ``roundpipe/h2d_weights(bytes)`` (mean over the steps after the profiled ones, which run the
   automatic partition), the base linears' share of those bytes (each ``LOAD`` chunk's bytes times its
   stage's base share: exact per ``LOAD``), the step time (same), and the validation loss before and
   after training; then each mode's ratios to bf16. The rest of the weight bytes is mostly the tied embedding /
   LM head, uploaded in fp32 under ``bf16-mixed`` (the embedding reads it in fp32) by every stage using it.

Run: ``python benchmarks/fp8_frozen.py [--steps 20] [--val-blocks 48] [--modes bf16,fp8,nf4] [--skip-training]``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

KEYS = ("roundpipe/frozen_matmul_host_bytes_per_param(bytes)", "roundpipe/frozen_host_bytes_per_param(bytes)",
        "roundpipe/h2d_weights(bytes)", "roundpipe/step(s)", "base_h2d(bytes)")


def base_h2d_bytes(engine) -> float:
    """Weight H2D bytes of the step's programs that are the frozen base linears' (codes and scales, or bf16)."""
    from lightning_roundpipe.runtime.host.layout import _padded_bytes

    store, total = engine.store, 0.0
    for program, timeline in zip(engine._step_programs, engine._timelines):
        for interval in timeline.intervals:
            if interval.stream == "weights" and interval.kind == "H2D":
                layout = store.layout(program.plan.stages[interval.stage_index].layers)
                base = sum(_padded_bytes(store.tensors[k]) for k in layout.tensors
                           if k in store.frozen_matmul or store.tensors[k].packed is not None)
                total += interval.nbytes * base / layout.total_bytes
    return total


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def conversion_memory(mode: str = "fp8") -> None:
    from peft import LoraConfig, get_peft_model

    from lightning_roundpipe.adapters import make_layer_sequence
    from lightning_roundpipe.recipes.smollm2 import load_smollm2_model
    from lightning_roundpipe.runtime.host.fp8 import fp8_candidates
    from lightning_roundpipe.runtime.host.store import WeightStore

    model = get_peft_model(load_smollm2_model(mmap=False), LoraConfig(
        task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    seq = make_layer_sequence(model)
    candidates = fp8_candidates(seq.layers)
    weights = [p for p in model.parameters() if id(p) in candidates]
    fp32 = sum(p.numel() * p.element_size() for p in weights)
    numel = sum(p.numel() for p in weights)  # before the conversion (nf4 packs two parameters a byte)
    rss_before = _status_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current RSS
    started = time.perf_counter()
    store = WeightStore(seq.layers, torch.bfloat16, frozen_weights=mode)
    seconds = time.perf_counter() - started
    peak, rss_after = _status_kib("VmHWM") * 1024, _status_kib("VmRSS") * 1024
    blocks = sum(e.block.numel() for e in store.tensors.values() if e.block is not None)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss_trimmed = _status_kib("VmRSS") * 1024
    mib = 2**20
    print(f"conversion: {len(weights)} frozen base linears, {numel / 1e6:.1f}M parameters,"
          f" fp32 {fp32 / mib:.1f} MiB -> {mode} blocks {blocks / mib:.1f} MiB (codes + scales) in {seconds:.2f} s")
    print(f"  host RSS before {rss_before / mib:.1f} MiB, after {rss_after / mib:.1f} MiB"
          f" ({(rss_after - rss_before) / mib:+.1f} MiB); peak during the conversion {peak / mib:.1f} MiB"
          f" ({(peak - rss_before) / mib:+.1f} MiB over before; a copy-all-then-free conversion would reach"
          f" +{blocks / mib:.1f} MiB)")
    print(f"  after malloc_trim(0): RSS {rss_trimmed / mib:.1f} MiB ({(rss_trimmed - rss_before) / mib:+.1f} MiB; fp32 -> {mode}"
          f" frees {(fp32 - blocks) / mib:.1f} MiB)")
    store.restore_frozen()


def train(frozen_weights: str | None, steps: int, val_blocks: int) -> dict[str, float]:
    import lightning.pytorch as pl
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate

    import lightning_roundpipe
    from lightning_roundpipe.train import CONF_DIR, build_trainer

    overrides = [f"trainer.max_steps={steps}", "trainer.precision=bf16-mixed", "trainer.enable_progress_bar=false",
                 f"data.val_blocks={val_blocks}", "logger=none", "callbacks=none", "save_adapter=false",
                 f"strategy.frozen_weights={frozen_weights or 'null'}", "strategy.trace_every_n_steps=0"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    pl.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    module = instantiate(cfg.model)
    seen: list[dict[str, float]] = []

    class Record(lightning_roundpipe.RoundPipeMetricsCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            base = base_h2d_bytes(trainer.strategy.engine)  # before the parent pops the step's programs
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            seen.append({**self.last_metrics, "base_h2d(bytes)": base})

    trainer = build_trainer(cfg, instantiate(cfg.strategy), [], [Record()])
    datamodule.setup("fit")

    def validate() -> float:
        return float(trainer.validate(module, datamodule=datamodule, verbose=False)[0]["val/loss"])

    before = validate()
    trainer.fit(module, datamodule=datamodule)
    after = validate()
    steady = seen[cfg.strategy.profile_steps:] or seen
    out = {key: statistics.fmean(m[key] for m in steady) for key in KEYS}
    out.update(val_before=before, val_after=after)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps of each run (default 20)")
    parser.add_argument("--val-blocks", type=int, default=48, help="validation blocks of 128 tokens (default 48)")
    parser.add_argument("--skip-training", action="store_true", help="the conversion's memory only")
    parser.add_argument("--modes", default="bf16,fp8,nf4", help="frozen bases to train, comma-separated (default all)")
    args = parser.parse_args()
    modes = [None if m == "bf16" else m for m in args.modes.split(",")]
    for mode in modes:
        if mode is not None:
            conversion_memory(mode)
    if args.skip_training:
        return
    runs = {mode: train(mode, args.steps, args.val_blocks) for mode in modes}
    print(f"\nSmolLM2-135M + LoRA r=16, {args.steps} steps, bf16-mixed, 2 CPU virtual devices (means over the steps"
          " after the profiled ones)")
    print(f"{'frozen base':<12} {'B/param base':>12} {'B/param frozen':>14} {'H2D weights/step':>17} {'of it base':>14}"
          f" {'step (s)':>9} {'val before':>11} {'val after':>10}")
    for mode, r in runs.items():
        print(f"{mode or 'bf16':<12} {r[KEYS[0]]:>12.3f} {r[KEYS[1]]:>14.3f} {r[KEYS[2]] / 2**20:>13.1f} MiB"
              f" {r[KEYS[4]] / 2**20:>10.1f} MiB {r[KEYS[3]]:>9.2f} {r['val_before']:>11.4f} {r['val_after']:>10.4f}")
    bf16 = runs.get(None)
    for mode, r in runs.items():
        if mode is None or bf16 is None:
            continue
        print(f"{mode} / bf16: host bytes per base parameter {r[KEYS[0]] / bf16[KEYS[0]]:.3f}, H2D weight bytes per step"
              f" {r[KEYS[2]] / bf16[KEYS[2]]:.3f} (the base's {r[KEYS[4]] / bf16[KEYS[4]]:.3f}), step time"
              f" {r[KEYS[3]] / bf16[KEYS[3]]:.3f}; validation loss after"
              f" {r['val_after']:.4f} vs {bf16['val_after']:.4f} ({100 * (r['val_after'] / bf16['val_after'] - 1):+.2f} %)")


if __name__ == "__main__":
    main()
