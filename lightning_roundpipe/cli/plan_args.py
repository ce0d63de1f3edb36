"""`roundpipe plan`'s inputs, shared by its two reports (:mod:`~lightning_roundpipe.cli.plan_cmd` for a count
of equal devices, :mod:`~lightning_roundpipe.cli.mixed_plan` for a device list): the flags' defaults and
bounds, ``--devices`` parsed (:func:`parse_devices`), the arguments validated (:func:`plan_inputs`), and what
both reports print the same way (:func:`model_param_counts`, the truncated grid). Both reports import this
module; it imports neither. Pure: no torch, no weights.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from lightning_roundpipe.partition.costmodel import CostModel, LoRASpec, ModelledProfiles, ModelShape, model_profiles
from lightning_roundpipe.partition.devices import KNOWN_GPUS, GpuSpec, gpu_spec
from lightning_roundpipe.partition.frozen import FrozenFormat, check_frozen_format
from lightning_roundpipe.partition.partitioner import METHODS
from lightning_roundpipe.partition.presets import canonical_preset_name, preset_config
from lightning_roundpipe.partition.profile import HardwareModel
from lightning_roundpipe.schedule import ExecutionPlan

__all__ = ["PlanInputs", "model_param_counts", "parse_devices", "plan_inputs"]

GiB = 2**30
#: ``--tflops`` and ``--device-memory-gib`` when not given: an RTX 4090 (dense bf16 TFLOP/s, GiB).
DEFAULT_TFLOPS = 165.0
DEFAULT_DEVICE_MEMORY_GIB = 24.0
#: most microbatches per step one plan simulates (its time grows with them; 1024 took minutes)
MAX_MICROBATCHES = 256
#: most devices one plan covers (one machine; a 1000-device plan would take minutes to simulate)
MAX_DEVICES = 64
#: Bytes of a compute dtype ``--dtype-bytes`` accepts: 1 (fp8), 2 (bf16/fp16), 4 (fp32).
DTYPE_BYTES = (1, 2, 4)
#: Optimizer modes, in the order their predictions are printed.
MODES = ("sync", "async")
#: ``--method`` values: ``auto`` (the simulator's choice among the candidates) or one partitioner method.
METHOD_CHOICES = ("auto",) + tuple(METHODS)

MAX_TFLOPS = 3000
"""The largest dense bf16 TFLOP/s accepted for one device in ``TFLOPS:GiB`` (a B200 has about 2,250)."""


def parse_devices(text: str) -> int | tuple[GpuSpec, ...]:
    """``--devices``: a count of equal devices (``"8"``), or a list of devices separated by commas,
    each a known GPU's name (``4090``, ``rtx3090``: :data:`~lightning_roundpipe.partition.devices.KNOWN_GPUS`)
    or ``TFLOPS:GiB`` (dense bf16 TFLOP/s and memory GiB, e.g. ``330:24``). A single named device
    needs its ``rtx`` prefix or a trailing comma (``4090`` alone is a count).

    Raises:
        ValueError: an empty entry, an unknown name, or numbers that are not finite and > 0
            (named, with the known GPUs and a HINT).
    """
    text = str(text).strip()
    if text.lstrip("+-").isdigit():  # a count (`plan_inputs` checks its range)
        return int(text)
    entries = [entry.strip() for entry in text.split(",")]
    if entries and entries[-1] == "" and len(entries) > 1:
        entries = entries[:-1]  # "4090," : one device
    known = ", ".join(KNOWN_GPUS)
    out = []
    for position, entry in enumerate(entries):
        if not entry:
            raise ValueError(f"`--devices` has an empty entry at position {position} in {text!r}. HINT: separate devices"
                             " by single commas, e.g. `--devices 4090,4090,3090,3060`.")
        if ":" in entry:
            tflops, _, gib = entry.partition(":")
            try:
                values = float(tflops), float(gib)
            except ValueError:
                values = (math.nan, math.nan)
            if not all(0 < v < math.inf for v in values):
                raise ValueError(f"`--devices` entry {entry!r} must be `TFLOPS:GiB`, two finite numbers > 0 (dense bf16"
                                 " TFLOP/s and memory GiB). HINT: `--devices 330:24,142:24`.")
            if values[0] > MAX_TFLOPS:  # `4090:24`: a GPU's name where its TFLOP/s belong
                named = f" `{tflops}` is a GPU's name: write `--devices {tflops}`." if gpu_spec(tflops) else ""
                raise ValueError(f"`--devices` entry {entry!r}: {values[0]:g} dense bf16 TFLOP/s is more than any device"
                                 f" ({MAX_TFLOPS} at most).{named} HINT: `TFLOPS:GiB`, e.g. `330:24` for an RTX 4090.")
            out.append(GpuSpec(f"{values[0]:g} TFLOP/s", values[0] * 1e12, int(values[1] * GiB)))
            continue
        spec = gpu_spec(entry)
        if spec is None:
            raise ValueError(f"`--devices`: unknown GPU {entry!r}; known: {known}. HINT: give an unlisted device's dense"
                             " bf16 TFLOP/s and memory as `TFLOPS:GiB`, e.g. `--devices 4090,82.6:24`; a number alone"
                             " is a count of equal devices (`--devices 8`).")
        out.append(spec)
    return tuple(out)


@dataclass(frozen=True)
class PlanInputs:
    """`roundpipe plan`'s validated arguments (:func:`plan_inputs`)."""

    shape: ModelShape
    hardware: HardwareModel
    cost_model: CostModel
    lora: LoRASpec | None
    num_devices: int
    num_microbatches: int
    stage_memory_bytes: int
    optimizer: str
    accumulate_grad_batches: int
    method: str
    overlap_batches: bool = True
    frozen: FrozenFormat = FrozenFormat()
    """``--frozen-weights``: the format of the LoRA base's frozen matmul weights (``bf16``: the compute dtype)."""

    def modelled(self, seq_len: int, microbatch_size: int, dtype_bytes: int) -> ModelledProfiles:
        """The layer sequence's modelled costs at ``seq_len`` x ``microbatch_size``."""
        return model_profiles(self.shape, self.hardware, seq_len=seq_len, microbatch_size=microbatch_size,
                              compute_dtype_bytes=dtype_bytes, lora=self.lora, cost_model=self.cost_model,
                              frozen_weights=self.frozen)


DEFAULT_LORA_RANK = 16
"""``--lora-rank`` when ``--lora`` is given alone."""

def plan_inputs(args: argparse.Namespace) -> PlanInputs:
    """Validate parsed `roundpipe plan` arguments (``args.devices`` a count: an int or its digits) and
    load the model's shape.

    Raises:
        ValueError: a bad argument value (named, with the valid range).
    """
    if isinstance(args.devices, str):
        count = parse_devices(args.devices)
        if not isinstance(count, int):
            raise ValueError("`--devices` lists devices; `make_report` plans a count of equal devices."
                             " HINT: `lightning_roundpipe.cli.mixed_plan.make_mixed_report` plans a device list.")
        args.devices = count
    if getattr(args, "lora_rank", None) is None:
        args.lora_rank = DEFAULT_LORA_RANK
    elif not args.lora:
        raise ValueError(f"`--lora-rank {args.lora_rank}` needs `--lora`: without it every weight trains and no adapter"
                         " is planned, so the rank would be ignored. HINT: add `--lora`, or leave out `--lora-rank`.")
    hints = {"devices": f"a count (1..{MAX_DEVICES}) or a device list, e.g. `--devices 8` or `--devices 4090,3090`",
             "seq_len": "tokens per sequence, e.g. 2048", "microbatch_size": "sequences per microbatch, e.g. 4",
             "lora_rank": "the adapters' rank, e.g. 16"}
    for name, hint in hints.items():
        v = getattr(args, name)
        if v < 1:
            raise ValueError(f"`--{name.replace('_', '-')}` must be >= 1, got {v}. HINT: {hint}.")
    if args.dtype_bytes not in DTYPE_BYTES:
        raise ValueError(
            f"`--dtype-bytes` must be one of {list(DTYPE_BYTES)}, got {args.dtype_bytes}."
            " HINT: 1 for fp8, 2 for bf16/fp16, 4 for fp32."
        )
    grid_rows = getattr(args, "grid_rows", 0)
    if grid_rows < 0:
        raise ValueError(f"`--grid-rows` must be >= 0, got {grid_rows}. HINT: 0 shows every step of the grid.")
    if args.microbatches is not None and not 1 <= args.microbatches <= MAX_MICROBATCHES:
        raise ValueError(f"`--microbatches` must be in 1..{MAX_MICROBATCHES}, got {args.microbatches}. HINT: the"
                         " simulator's time grows with the microbatches and the bubble is nearly gone from"
                         " devices + 1 on (the default); for a larger global batch, plan"
                         " `--accumulate-grad-batches`.")
    if not 0 < args.efficiency <= 1:
        raise ValueError(f"`--efficiency` must be in (0, 1], got {args.efficiency}. HINT: the achieved share of"
                         " `--tflops` for dense GEMMs, e.g. 0.75.")
    optimizer = getattr(args, "optimizer", "sync")
    if optimizer not in MODES:
        raise ValueError(f"`--optimizer` must be one of {list(MODES)}, got {optimizer!r}.")
    accumulate = getattr(args, "accumulate_grad_batches", 1)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"`--accumulate-grad-batches` must be an int >= 1, got {accumulate!r}. HINT: 1 steps the"
                         " optimizer after every batch.")
    correction = getattr(args, "staleness_correction", "none")
    if correction not in (None, "none") and optimizer != "async":
        raise ValueError(f"`--staleness-correction {correction}` needs `--optimizer async` (as the strategy's"
                         " `staleness_correction` needs `optimizer='async'`): the synchronous step is not stale."
                         " HINT: add `--optimizer async`, or leave out `--staleness-correction`.")
    method = getattr(args, "method", "auto")
    if method not in METHOD_CHOICES:
        raise ValueError(f"`--method` must be one of {list(METHOD_CHOICES)}, got {method!r}.")
    frozen = getattr(args, "frozen_weights", None)
    frozen = "bf16" if frozen is None else check_frozen_format(frozen)
    if frozen != "bf16" and not args.lora:
        raise ValueError(f"`--frozen-weights {frozen}` needs `--lora`: without it every weight trains and no frozen"
                         " base is held in another format. HINT: add `--lora` (a frozen base, rank-16 adapters train),"
                         " or leave out `--frozen-weights`.")
    if args.preset is not None:
        key = canonical_preset_name(args.preset)
        shape = ModelShape.from_config(preset_config(key))
    else:
        shape = ModelShape.load(args.model)
    optimizer_gbps = getattr(args, "optimizer_gbps", None)
    tflops = DEFAULT_TFLOPS if args.tflops is None else args.tflops
    device_memory_gib = DEFAULT_DEVICE_MEMORY_GIB if args.device_memory_gib is None else args.device_memory_gib
    for flag, value in (("--tflops", tflops), ("--h2d-gbps", args.h2d_gbps), ("--d2h-gbps", args.d2h_gbps),
                        ("--duplex-h2d-gbps", args.duplex_h2d_gbps), ("--device-memory-gib", device_memory_gib),
                        ("--optimizer-gbps", optimizer_gbps)):
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"`{flag}` must be a finite number > 0, got {value}. HINT: see `roundpipe plan --help`"
                             " for each flag's default (" + ("a host's memory bandwidth share" if flag == "--optimizer-gbps"
                                                             else "an RTX 4090 on PCIe 4.0 x16") + ").")
    if tflops > MAX_TFLOPS:  # as a device list's `TFLOPS:GiB` entry
        raise ValueError(f"`--tflops` {tflops:g} is more than any device ({MAX_TFLOPS} dense TFLOP/s at most)."
                         " HINT: one device's dense peak in the compute dtype, e.g. 165 for an RTX 4090 in bf16.")
    if not 1 <= args.devices <= MAX_DEVICES:
        from lightning_roundpipe.partition.devices import gpu_spec

        named = (f" A count, not a GPU: for one {args.devices}, write `--devices rtx{args.devices}`."
                 if gpu_spec(str(args.devices)) is not None else "")
        raise ValueError(f"`--devices` must be in 1..{MAX_DEVICES} (devices of one machine), got {args.devices}.{named}"
                         " HINT: across machines, plan one node and add data parallelism (`Trainer(num_nodes=N)`).")
    gbps = 1e9
    hw = HardwareModel(
        flops_per_s=tflops * 1e12,
        h2d_bytes_per_s=args.h2d_gbps * gbps,
        d2h_bytes_per_s=(args.d2h_gbps or args.h2d_gbps) * gbps,
        h2d_duplex_bytes_per_s=None if args.duplex_h2d_gbps is None else args.duplex_h2d_gbps * gbps,
        memory_bytes=int(device_memory_gib * GiB),
        host_optimizer_bytes_per_s=None if optimizer_gbps is None else optimizer_gbps * gbps,
    )
    cm = CostModel(gemm_efficiency=args.efficiency)
    lora = LoRASpec(rank=args.lora_rank) if args.lora else None
    D = args.devices
    M = args.microbatches or D + 1
    budget = hw.memory_bytes // 2 if args.stage_memory_gib is None else int(args.stage_memory_gib * GiB)
    if not 0 < budget <= hw.memory_bytes:
        raise ValueError(f"`--stage-memory-gib` must be in (0, --device-memory-gib], got {args.stage_memory_gib}."
                         " HINT: leave it out for half the device memory (the next stage is prefetched beside it).")
    return PlanInputs(shape=shape, hardware=hw, cost_model=cm, lora=lora, num_devices=D, num_microbatches=M,
                      stage_memory_bytes=budget, optimizer=optimizer, accumulate_grad_batches=accumulate, method=method,
                      overlap_batches=getattr(args, "overlap_batches", True), frozen=FrozenFormat(name=frozen))


def model_param_counts(mp: ModelledProfiles) -> tuple[int, int]:
    """Weights of the model and trainable weights, elements, with a tied embedding / LM head weight
    counted once (the layer sequence counts it in both the prefix and the tail, which both upload it)."""
    total = sum(c.param_count for c in mp.costs)
    trainable = sum(c.trainable_param_count for c in mp.costs)
    if mp.shape.tie_word_embeddings:
        tied = mp.shape.vocab_size * mp.shape.hidden_size
        total -= tied
        if mp.costs[0].trainable_param_count >= tied and mp.costs[-1].trainable_param_count >= tied:
            trainable -= tied
    return total, trainable


def _truncated_grid(plan: ExecutionPlan, max_rows: int) -> str:
    grid = plan.format_grid().splitlines()
    head, body = grid[:2], grid[2:]
    if max_rows <= 0 or len(body) <= max_rows:
        return "\n".join(grid)
    keep_top = max_rows - max_rows // 4
    keep_bottom = max_rows // 4
    omitted = len(body) - keep_top - keep_bottom
    return "\n".join(head + body[:keep_top] + [f" ... | ({omitted} steps omitted; --grid-rows 0 shows all)"]
                     + body[len(body) - keep_bottom:])
