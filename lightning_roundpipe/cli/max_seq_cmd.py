"""`roundpipe max-seq`: the longest sequence that trains one step, measured, beside the planner's estimate.

Builds the model from its config with random weights (``--tiny``: a two-layer model of SmolLM2's
architecture, vocabulary 49152; ``--model``: a local ``config.json``), pipelines it with RoundPipe on
``--devices`` CPU virtual devices, each with a memory budget of ``--device-memory-mib`` (enforced:
a step that would hold more raises ``DeviceMemoryError``), or on GPUs with their own memory, and
finds the longest sequence by bisection on real training steps
(:func:`lightning_roundpipe.runtime.tuning.max_seq.measure_max_seq_len`). The planner's estimate is the
cost model's peak device memory for the same stages
(:func:`lightning_roundpipe.partition.seqlen.planned_max_seq_len`). ``--lora`` trains PEFT adapters on a
frozen base, which ``--frozen-weights fp8|nf4`` holds and uploads in that format (the run's
``frozen_weights``; the planner counts the packed weights and their dequantised copies). Example::

    roundpipe max-seq --tiny --devices 2 --device-memory-mib 96
    roundpipe max-seq --tiny --devices 2 --device-memory-mib 96 --lora --frozen-weights fp8
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class MaxSeqReport:
    """Everything `roundpipe max-seq` prints, as data (tests read this)."""

    measured: int
    """Longest sequence whose step ran, tokens."""
    planned: int
    """The planner's longest sequence, tokens."""
    first_failing: int | None
    """Shortest sequence that ran out of memory (``None``: none up to ``--limit``)."""
    trials: tuple[tuple[int, bool], ...]
    """``(seq_len, ran)`` of each step tried."""
    measured_peak_bytes: int | None
    """Largest per-device peak at ``measured`` (CPU virtual devices), bytes."""
    planned_peak_bytes: int
    """The cost model's peak device memory at ``measured``, bytes."""
    device_memory_bytes: int
    """The budget, bytes."""
    error: str | None
    """The out-of-memory message at ``first_failing``."""

    @property
    def ratio(self) -> float:
        """``planned / measured`` (1.0: exact)."""
        return self.planned / self.measured if self.measured else float("inf")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `roundpipe max-seq`."""
    p = subparsers.add_parser("max-seq", help="longest sequence that trains one step (bisection on real steps) vs the planner",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tiny", action="store_true", help="a two-layer random model of SmolLM2's architecture")
    src.add_argument("--model", metavar="PATH", help="a local Hugging Face config.json (file or folder); random weights")
    p.add_argument("--devices", type=int, default=2, help="devices (default 2)")
    p.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu", help="CPU virtual devices (default) or GPUs")
    p.add_argument("--device-memory-mib", type=float, default=None,
                   help="memory budget of one device, MiB (required on CPU virtual devices; GPUs: their free memory less a margin of max(512 MiB, 5 %%))")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default devices + 1)")
    p.add_argument("--microbatch-size", type=int, default=1, help="sequences per microbatch (default 1)")
    p.add_argument("--start", type=int, default=16, help="first sequence length tried (default 16)")
    p.add_argument("--limit", type=int, default=1 << 16, help="longest sequence length tried (default 65536)")
    p.add_argument("--resolution", type=int, default=8, help="bisection stops at this many tokens (default 8)")
    p.add_argument("--lora", action="store_true",
                   help="LoRA (PEFT, rank 16 on the attention and MLP projections): a frozen base, only adapters train")
    p.add_argument("--frozen-weights", default=None, metavar="{bf16,fp8,nf4}",
                   help="with --lora, the run's `frozen_weights`: bf16 (the model's dtype; default), fp8 or nf4; the"
                        " planner counts the same format")
    p.set_defaults(func=run)
    return p


def _model(args: argparse.Namespace):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.tiny:
        from lightning_roundpipe.recipes.smollm2 import tiny_smollm2

        return tiny_smollm2()
    from pathlib import Path

    path = Path(args.model)
    if not (path.is_file() or (path / "config.json").is_file()):
        raise ValueError(f"`--model {args.model}`: no Hugging Face config at {path} (a config.json file or a folder"
                         " holding one). HINT: `--tiny` for a two-layer random SmolLM2.")
    config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _frozen_format(args: argparse.Namespace) -> str:
    """``--frozen-weights`` checked: ``bf16``, ``fp8`` or ``nf4``, with ``--lora`` for the latter two.

    Raises:
        ValueError: another value (with the valid ones and a HINT), or a format without ``--lora``.
    """
    from lightning_roundpipe.partition.frozen import check_frozen_format

    value = getattr(args, "frozen_weights", None)
    frozen = "bf16" if value is None else check_frozen_format(value)
    if frozen == "int8":
        raise ValueError("`--frozen-weights int8` is a model loaded in 8 bits by bitsandbytes; `roundpipe max-seq` builds"
                         " its model from a config. HINT: `--frozen-weights fp8` holds the frozen base in 1 byte per"
                         " parameter too; `roundpipe plan --lora --frozen-weights int8` plans an 8-bit model.")
    if frozen != "bf16" and not getattr(args, "lora", False):
        raise ValueError(f"`--frozen-weights {frozen}` needs `--lora`: without it every weight trains and none is"
                         " frozen. HINT: add `--lora`, or leave out `--frozen-weights`.")
    return frozen


def make_report(args: argparse.Namespace) -> MaxSeqReport:
    """Measure and plan from parsed `roundpipe max-seq` arguments.

    Raises:
        ValueError: bad argument values (named), or no budget on CPU virtual devices.
    """
    import torch

    from lightning_roundpipe.adapters import make_layer_sequence
    from lightning_roundpipe.partition.costmodel import ModelShape, model_profiles
    from lightning_roundpipe.partition.profile import HardwareModel
    from lightning_roundpipe.partition.seqlen import frozen_stage_bytes, peak_device_memory_bytes, planned_max_seq_len
    from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
    from lightning_roundpipe.runtime.tuning.max_seq import causal_lm_step, measure_max_seq_len

    hints = {"devices": "the number of devices to measure on, e.g. `--devices 2`",
             "microbatch_size": "sequences per microbatch, e.g. 1 (the default)",
             "start": "the first sequence length tried, e.g. 16 (the default)",
             "limit": "the longest sequence length tried, e.g. 65536 (the default)",
             "resolution": "the bisection's last step in tokens, e.g. 8 (the default)"}
    for name, hint in hints.items():
        if getattr(args, name) < 1:
            raise ValueError(f"`--{name.replace('_', '-')}` must be >= 1, got {getattr(args, name)}. HINT: {hint}.")
    if args.limit < args.start:
        raise ValueError(f"`--limit` ({args.limit}) must be >= `--start` ({args.start}). HINT: raise `--limit`, or"
                         " lower `--start`.")
    if args.accelerator == "cpu" and args.device_memory_mib is None:
        raise ValueError("`--device-memory-mib` is required with `--accelerator cpu`: CPU virtual devices have no"
                         " memory limit of their own. HINT: e.g. `--device-memory-mib 96`.")
    if args.device_memory_mib is not None and not args.device_memory_mib > 0:
        raise ValueError(f"`--device-memory-mib` must be > 0, got {args.device_memory_mib}. HINT: each device's"
                         " memory in MiB, e.g. `--device-memory-mib 96`.")
    frozen = _frozen_format(args)
    D = args.devices
    if args.microbatches is not None and args.microbatches < 1:
        raise ValueError(f"`--microbatches` must be >= 1, got {args.microbatches}. HINT: leave it out for devices + 1"
                         f" ({D + 1}), the fewest that fill the round robin.")
    M = D + 1 if args.microbatches is None else args.microbatches
    if args.accelerator == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() < D:
            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise ValueError(f"`--accelerator cuda --devices {D}` needs {D} CUDA devices; this torch sees {found}."
                             " HINT: `--accelerator cpu --device-memory-mib 96` measures on CPU virtual devices.")
        devices = [torch.device("cuda", i) for i in range(D)]
        budget = int(args.device_memory_mib * MiB) if args.device_memory_mib is not None else None
        enforced = None
    else:
        devices = [torch.device("cpu")] * D
        budget = enforced = int(args.device_memory_mib * MiB)
    model = _model(args)
    lora = None
    if getattr(args, "lora", False):
        from peft import LoraConfig, get_peft_model

        from lightning_roundpipe.partition.costmodel import LoRASpec

        lora = LoRASpec()
        model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=2 * lora.rank,
                                                 target_modules=list(lora.target_modules)))
    engine = RoundPipeEngine(make_layer_sequence(model), devices, M, device_memory_bytes=enforced,
                             frozen_weights=None if frozen == "bf16" else frozen)
    # measured: the allocator (CUDA) or the ledger (CPU) decides what fits, not the memory model's check
    # before each program, which is the planned figure below
    engine.executor.memory_check = None
    if budget is None:  # CUDA: the memory this process can have (free + reserved, less the margin)
        budget = min(backend.device_budget_bytes() for backend in engine.backends)
    engine.install()
    try:
        train_step = causal_lm_step(model, M * args.microbatch_size, model.config.vocab_size)
        peaks: dict[int, int] = {}

        def step(seq_len: int) -> None:
            # the peak of each step that ran (not a re-run: a device's peak depends a little on when
            # its copy threads land the next upload, so a re-run at the same length may differ)
            engine.pop_device_memory_peaks()
            train_step(seq_len)
            measured = engine.pop_device_memory_peaks()
            if measured:
                peaks[seq_len] = max(measured)

        result = measure_max_seq_len(step, start=args.start, limit=args.limit, resolution=args.resolution)
        measured_peak = peaks.get(result.max_seq_len)
        stages = [("fused" if s.fused else s.kind, s.layers) for s in engine.fused_stages]
    finally:
        engine.close()
    shape = ModelShape.from_config(model.config)
    hardware = HardwareModel(flops_per_s=1e12, h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, memory_bytes=budget)
    dtype_bytes = next(p for p in model.parameters() if p.is_floating_point()).element_size()

    def modelled(seq_len: int):
        return model_profiles(shape, hardware, seq_len=seq_len, microbatch_size=args.microbatch_size,
                              compute_dtype_bytes=dtype_bytes, lora=lora, frozen_weights=frozen)

    planned = planned_max_seq_len(modelled, stages, D, budget, limit=args.limit, num_microbatches=M, frozen=True)
    at = modelled(max(result.max_seq_len, 1))
    planned_peak = peak_device_memory_bytes(at, stages, D, M, stage_bytes=frozen_stage_bytes(at, stages))
    return MaxSeqReport(measured=result.max_seq_len, planned=planned, first_failing=result.first_failing,
                        trials=result.trials, measured_peak_bytes=measured_peak, planned_peak_bytes=planned_peak,
                        device_memory_bytes=budget, error=result.error)


def format_report(r: MaxSeqReport) -> str:
    lines = [f"device memory: {r.device_memory_bytes / MiB:.1f} MiB per device",
             "steps tried (tokens: ran?): " + ", ".join(f"{s}:{'ok' if ok else 'OOM'}" for s, ok in r.trials),
             f"longest sequence, measured: {r.measured} tokens"
             + (f" ({r.first_failing} ran out of memory)" if r.first_failing else " (the search limit)"),
             f"longest sequence, planner:  {r.planned} tokens"
             + (f" (planner / measured = {r.ratio:.3f})" if r.measured else "")]
    if r.measured_peak_bytes is not None:
        lines.append(f"peak device memory at {r.measured} tokens: measured {r.measured_peak_bytes / MiB:.1f} MiB,"
                     f" planner {r.planned_peak_bytes / MiB:.1f} MiB")
    if r.error:
        lines.append(f"out of memory at {r.first_failing}: {r.error}")
    return "\n".join(lines)


def no_fit_hint(r: MaxSeqReport, args: argparse.Namespace) -> str:
    """Why not even the first sequence tried ran, and the changes that give each device more room (more
    devices do not: every device holds its pool of the largest stage's weights whatever their number)."""
    changes = [f"raise `--device-memory-mib` (the planner's peak at 1 token is {r.planned_peak_bytes / MiB:.1f} MiB"
               " a device)"]
    if args.microbatch_size > 1:
        changes.append("`--microbatch-size 1`")
    if args.start > 1:
        changes.append(f"a lower `--start` (now {args.start} tokens)")
    return (f"not even the shortest sequence tried ({args.start} tokens) fits {r.device_memory_bytes / MiB:.1f} MiB"
            f" per device. HINT: {', or '.join(changes)}.")


def run(args: argparse.Namespace) -> int:
    try:
        report = make_report(args)
    except ValueError as error:
        print(f"roundpipe max-seq: error: {error}", file=sys.stderr)
        return 2
    print(format_report(report))
    if report.measured == 0:
        print(f"roundpipe max-seq: error: {no_fit_hint(report, args)}", file=sys.stderr)
        return 2
    return 0
