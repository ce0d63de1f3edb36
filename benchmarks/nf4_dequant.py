"""bitsandbytes' 4-bit dequantisation rate on this machine's CPU (issue 33 item 3): what a CPU virtual device
spends per parameter where a layer's ``Linear4bit`` dequantises its weight (its forward and its backward).

For each weight shape (a SmolLM2-135M projection, 576 x 1536; a Llama-3.1-8B attention projection, 4096 x
4096; its MLP projection, 14336 x 4096), the weight is quantised once with
``bitsandbytes.functional.quantize_4bit`` (nf4, blocksize 64, with and without double quantisation) and
``dequantize_4bit`` is timed ``--repeats`` times (one untimed call first) into the compute dtype. Printed per
case: the fastest and the median call (on a shared machine the fastest is the machine's rate, the median
what it gave meanwhile), and at the fastest, parameters per second and the bytes moved per second (the packed bytes read, by
:func:`lightning_roundpipe.partition.frozen.packed_weight_bytes`, plus the bf16 output written), the figure
the planner's :func:`~lightning_roundpipe.partition.frozen.dequant_seconds` divides by. The planner uses a
GPU's memory bandwidth for GPUs (the kernel is memory-bound there); on a CPU the rate is set by bitsandbytes'
CPU backend and the cores given to torch (``--threads``, default torch's).

Run: ``python benchmarks/nf4_dequant.py [--repeats 5] [--threads N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_roundpipe.partition.frozen import packed_weight_bytes

SHAPES = {"SmolLM2-135M MLP": (1536, 576), "Llama-3.1-8B attention": (4096, 4096), "Llama-3.1-8B MLP": (14336, 4096)}


def measure(rows: int, cols: int, double_quant: bool, repeats: int,
            dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """Fastest and median seconds of one ``dequantize_4bit`` of a ``rows x cols`` nf4 weight into ``dtype``."""
    import bitsandbytes.functional as bnb_functional

    weight = torch.randn(rows, cols, dtype=dtype, generator=torch.Generator().manual_seed(0))
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant,
                                                 quant_type="nf4")
    bnb_functional.dequantize_4bit(packed, state)  # warm-up (kernel selection, first-touch of the output)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        bnb_functional.dequantize_4bit(packed, state)
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"bitsandbytes dequantize_4bit (nf4, blocksize 64) into bf16 on the CPU, {torch.get_num_threads()} torch"
          f" threads, {args.repeats} calls each")
    print(f"{'weight':<24} {'shape':>13} {'double quant':>12} {'min ms':>8} {'median ms':>9} {'Gparam/s':>9} {'GB/s':>7}")
    for name, (rows, cols) in SHAPES.items():
        for double_quant in (True, False):
            seconds, median = measure(rows, cols, double_quant, args.repeats)
            numel = rows * cols
            moved = packed_weight_bytes("nf4", rows, cols, double_quant=double_quant) + 2 * numel
            print(f"{name:<24} {f'{rows}x{cols}':>13} {str(double_quant):>12} {seconds * 1e3:>8.2f} {median * 1e3:>9.2f}"
                  f" {numel / seconds / 1e9:>9.3f} {moved / seconds / 1e9:>7.2f}")


if __name__ == "__main__":
    main()
