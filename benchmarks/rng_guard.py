"""Cost of the per-thread global-draw guard on CPU virtual devices (issue 30).

Every layer call on a CPU virtual device runs under
:func:`~lightning_roundpipe.runtime.replay.rng_guard.global_draw_guard`: two reads of the global
generator's state, and, for a layer that saw it advance (suspect), a ``TorchDispatchMode`` of the
layer's thread that looks at every ATen op. This times one pipelined training step (fused path:
forward, loss and backward; 2 CPU virtual devices, 3 microbatches, the checking mode off) of the
tiny Llama of the tests (``tests/_helpers.py`` ``tiny_hf``: 5 layers, hidden 32, fp32, batch 6 x 8
tokens) in three variants, alternating in blocks of ``--steps`` steps so a machine shared with other
work slows them alike: the guard as it runs (no layer suspect), every layer suspect (the dispatch
mode on every layer call), and the guard replaced by a no-op. Prints the median and the minimum
seconds per step of each, and the ratios of the medians to the no-op's.

Run: ``python benchmarks/rng_guard.py [--dropout 0.1] [--blocks 12] [--steps 5]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from _helpers import TokenData, tiny_hf  # noqa: E402
from lightning_roundpipe.adapters import make_layer_sequence  # noqa: E402
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine  # noqa: E402
from lightning_roundpipe.runtime.replay import rng, rng_guard  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dropout", type=float, default=0.0, help="the Llama's attention dropout (0: no random layer)")
    parser.add_argument("--blocks", type=int, default=12, help="blocks per variant, alternating")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    args = parser.parse_args()
    data = TokenData(n=6)
    batch = {k: torch.stack([data[i][k] for i in range(6)]) for k in ("input_ids", "attention_mask", "labels")}
    model = tiny_hf("llama", dropout=args.dropout).train()
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * 2, 3, check_streams=False)
    engine.install()
    guard, every = rng.global_draw_guard, set(range(len(engine.seq.layers)))
    variants = {"guard (no layer suspect)": (guard, set()), "guard (every layer suspect)": (guard, every),
                "no guard": (lambda device, seeded, layer_index: contextlib.nullcontext(), set())}

    def step() -> None:
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    try:
        for _ in range(3):
            step()
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.blocks):
            for name, (variant, suspect) in variants.items():
                rng.global_draw_guard = variant
                rng_guard._SUSPECT.clear()
                rng_guard._SUSPECT.update(suspect)
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                seconds[name].append((time.perf_counter() - start) / args.steps)
    finally:
        rng.global_draw_guard = guard
        rng_guard._SUSPECT.clear()
        engine.close()
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values) * 1e3:.1f} ms, min {min(values) * 1e3:.1f} ms per step")
    base = statistics.median(seconds["no guard"])
    for name in list(variants)[:2]:
        print(f"{name} / no guard (medians): {statistics.median(seconds[name]) / base:.2f}")


if __name__ == "__main__":
    main()
