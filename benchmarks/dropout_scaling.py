"""CPU virtual devices: a model with dropout scales from 1 to 2 devices as well as without (issue 7).

Model: Llama-shaped (``--layers`` decoder layers, hidden ``--hidden``, vocab ``--vocab``, tied
embeddings, eager attention), batch ``--batch-size`` x ``--seq-len`` tokens, ``--num-microbatches``
microbatches, fp32. A step is one pipelined training call of :class:`RoundPipeEngine` (forward
stages, the fused tail and the backward stages: the work of a Lightning step without the
optimizer). Two variants:

- ``full``: full fine-tuning, ``attention_dropout`` 0.1 (HF eager attention's ``F.dropout``);
- ``lora``: PEFT LoRA r=8 on ``q,k,v,o_proj``, ``lora_dropout`` 0.05 (the main job's adapter).

Each variant runs in three forms: without dropout; with dropout (every decoder layer then runs
under ``runtime/replay/rng.py``'s private-generator scope); and, for reference, with dropout under the
former process-wide lock (the global CPU generator seeded per layer under one lock, emulated here
by replacing the executor's ``rng_scope``). Every form runs on 1 and 2 devices. All engines are
built first and their steps interleaved round-robin, so load from other processes hits every form
alike; figures are medians over ``--steps`` rounds after ``--warmup``. Printed: seconds per step on
1 and 2 devices, the speed-up, and each dropout form's speed-up relative to the form without
dropout (target ~1.0: dropout does not serialise the devices).

Run: ``python benchmarks/dropout_scaling.py [--only full,lora] [--steps 5]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time

import torch

from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.runtime.execution import executor
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
from lightning_roundpipe.runtime.replay.rng import rng_scope

_LOCK = threading.Lock()


@contextlib.contextmanager
def locked_scope(seed: int | None, device: torch.device, layer_index: int | None = None):
    """The former ``rng_scope`` on CPU: the global generator seeded under one process-wide lock."""
    if seed is None:
        yield
        return
    with _LOCK:
        state = torch.default_generator.get_state()
        torch.default_generator.manual_seed(seed)
        try:
            yield
        finally:
            torch.default_generator.set_state(state)


def build(args: argparse.Namespace, variant: str, dropout: bool) -> torch.nn.Module:
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
    return model.train()


FORMS = (("no dropout", False, rng_scope), ("dropout", True, rng_scope),
         ("dropout, former lock", True, locked_scope))


def measure(args: argparse.Namespace, variant: str) -> dict[tuple[str, int], float]:
    """Median seconds per step of every (form, devices) of ``variant``, steps interleaved."""
    runs = {}
    for form, dropout, _ in FORMS:
        for devices in (1, 2):
            model = build(args, variant, dropout)
            engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * devices,
                                     args.num_microbatches)
            engine.install()
            runs[(form, devices)] = (model, engine)
    ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0))
    times: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    try:
        for _ in range(args.warmup + args.steps):
            for form, _, scope in FORMS:
                executor.rng_scope = scope
                for devices in (1, 2):
                    model, _ = runs[(form, devices)]
                    started = time.perf_counter()
                    model(input_ids=ids, labels=ids).loss.backward()
                    times[(form, devices)].append(time.perf_counter() - started)
                    model.zero_grad(set_to_none=True)
    finally:
        executor.rng_scope = rng_scope
        for _, engine in runs.values():
            engine.close()
    return {key: statistics.median(values[args.warmup:]) for key, values in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="rounds dropped")
    p.add_argument("--steps", type=int, default=5, help="measured rounds (one step of every form each)")
    p.add_argument("--only", default="full,lora")
    args = p.parse_args()
    print(f"model: Llama-shaped, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; batch"
          f" {args.batch_size} x {args.seq_len} tokens, {args.num_microbatches} microbatches; fp32;"
          f" {os.cpu_count()} CPU cores")
    print(f"{'variant':>8} {'form':>22} {'1 dev s/step':>13} {'2 dev s/step':>13} {'speed-up':>9} {'vs no dropout':>14}")
    for variant in (v.strip() for v in args.only.split(",")):
        step_s = measure(args, variant)
        base = step_s[("no dropout", 1)] / step_s[("no dropout", 2)]
        for form, _, _ in FORMS:
            one, two = step_s[(form, 1)], step_s[(form, 2)]
            print(f"{variant:>8} {form:>22} {one:>13.3f} {two:>13.3f} {one / two:>8.2f}x {one / two / base:>13.2f}")


if __name__ == "__main__":
    main()
