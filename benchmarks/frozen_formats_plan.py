"""Qwen3-235B-A22B LoRA on the paper's 8 x RTX 4090 with its frozen base in bf16, fp8 and nf4 (issue 33 item 3):
`roundpipe plan` for each, and what converting the MoE experts too would give (the runtime does not).

Prints one row per format: host memory for the weights and training state, host bytes per converted
parameter, weight bytes uploaded per step, peak device memory, the predicted step and tokens/s in the
``--optimizer`` mode, and the longest sequence a stage can hold; at the paper's flags (``--h2d-gbps 25
--duplex-h2d-gbps 13``) and, with ``--h2d-gbps 3``, at the per-device link rate at which the simulator
meets the paper's measured 1,820 tokens/s (docs/partitioner.md, section 7). The rows marked ``+experts``
count the fused 3-D expert weights (227B of the 235B parameters) as converted too: a what-if, since
neither ``frozen_weights`` nor transformers' bitsandbytes loading converts them (they are not
``nn.Linear`` weights), planned by the same model (their copies dequantised per residency as one weight
each, 3.2 GB in bf16 for a layer's ``gate_up_proj``).

Run: ``python benchmarks/frozen_formats_plan.py [--h2d-gbps 25 3] [--optimizer sync]`` (about 1 minute of
CPU per link rate and format).
"""

from __future__ import annotations

import argparse
import dataclasses

from lightning_roundpipe.cli import plan_cmd
from lightning_roundpipe.cli.plan_frozen import format_row
from lightning_roundpipe.partition.frozen import FrozenFormat

PAPER = ["plan", "--preset", "qwen3-235b-a22b", "--lora", "--devices", "8", "--device-memory-gib", "24", "--tflops", "330",
         "--seq-len", "2048", "--microbatch-size", "4", "--microbatches", "16"]


def plan(argv: list[str], experts: bool = False):
    """The :class:`~lightning_roundpipe.cli.plan_cmd.PlanReport` of ``argv`` (no comparison), with the MoE
    experts counted as converted when ``experts``."""
    parser = argparse.ArgumentParser()
    plan_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    original = plan_cmd.plan_inputs
    if experts:
        plan_cmd.plan_inputs = lambda a: dataclasses.replace(
            original(a), frozen=dataclasses.replace(original(a).frozen, experts=True))
    try:
        return plan_cmd.make_report(args, compare=False)
    finally:
        plan_cmd.plan_inputs = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--h2d-gbps", type=float, nargs="+", default=[25.0, 3.0])
    parser.add_argument("--optimizer", default="sync", choices=("sync", "async"))
    args = parser.parse_args()
    print(f"| H2D GB/s | frozen base | host GB | B/param | H2D GB/step | peak GiB | step s | tokens/s | longest seq |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gbps in args.h2d_gbps:
        duplex = 13.0 if gbps >= 13 else gbps
        link = ["--h2d-gbps", f"{gbps:g}", "--duplex-h2d-gbps", f"{duplex:g}", "--optimizer", args.optimizer]
        for name, experts in (("bf16", False), ("fp8", False), ("nf4", False), ("fp8", True), ("nf4", True)):
            try:
                report = plan([*PAPER, *link, "--frozen-weights", name], experts)
            except ValueError as error:
                print(f"| {gbps:g} | {name}{' +experts' if experts else ''} | {error} |")
                continue
            row = format_row(report)
            per_param = report.modelled.converted_bytes()
            bpp = per_param[1] / per_param[0] if per_param[0] else 2.0
            fits = "" if row.fits else " (does not fit)"
            print(f"| {gbps:g} | {name}{' +experts' if experts else ''} | {row.host_bytes / 1e9:,.1f} | {bpp:.3f} |"
                  f" {row.weight_h2d_bytes / 1e9:,.1f} | {row.peak_device_bytes / 2**30:.1f}{fits} | {row.step_s:.3f} |"
                  f" {row.tokens_per_s:,.0f} | {row.max_seq_len:,} |")


if __name__ == "__main__":
    main()
