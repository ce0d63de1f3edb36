"""`roundpipe plan`: partition a model for N devices from its config alone and predict the step.

Example (the paper's Qwen3-32B setting on 8x RTX 4090)::

    roundpipe plan --preset qwen3-32b --devices 8 --device-memory-gib 24 --h2d-gbps 25 \\
        --tflops 165 --seq-len 2048 --microbatch-size 4

Prints the stage table (layers, bytes, seconds per microbatch, forward and backward), the
device-by-step grid of the round-robin plan, predicted tokens/s, per-device idle %, peak device
memory and the longest sequence that fits. No weights are allocated: layer costs come from
:mod:`lightning_roundpipe.partition.costmodel` (arithmetic on the config), times of the whole step
from :mod:`lightning_roundpipe.simulate.steady` in the run's own optimizer mode (docs/partitioner.md;
design section 11): ``--optimizer sync`` is one pipeline with fill and drain plus the host's optimizer step,
``--optimizer async`` the steady state with one-step-stale weights, where the next step's forward
stages fill this step's drain and the optimizer step overlaps. The partition is the candidate
(:func:`~lightning_roundpipe.partition.candidates.candidate_partitions`, each with one round or
rounds of D microbatches) the simulator times fastest in that mode; both modes' predictions are
printed side by side, with the paper's figures for its models.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Callable, Sequence

from lightning_roundpipe.cli import mixed_plan
from lightning_roundpipe.cli.plan_fit import budget_label, fit_lines, fitting_remedies, remedies_hint
from lightning_roundpipe.cli.plan_frozen import frozen_lines
from lightning_roundpipe.cli.plan_table import stage_table
from lightning_roundpipe.cli.plan_args import (  # noqa: F401 (also plan_cmd's names before plan_args.py)
    DEFAULT_DEVICE_MEMORY_GIB,
    DEFAULT_TFLOPS,
    DTYPE_BYTES,
    MAX_DEVICES,
    MAX_MICROBATCHES,
    METHOD_CHOICES,
    MODES,
    GiB,
    PlanInputs,
    _truncated_grid,
    model_param_counts,
    parse_devices,
    plan_inputs,
)
from lightning_roundpipe.partition.costmodel import KNOWN_MODEL_TYPES, CostModel, ModelledProfiles
from lightning_roundpipe.partition.partitioner import (
    StageSummary,
    describe_stages,
    min_stage_memory_bytes,
    schedule_ranges,
)
from lightning_roundpipe.partition.presets import preset_names
from lightning_roundpipe.partition.profile import (
    ADAM_COUNTED_BYTES_PER_PARAM,
    ADAM_HOST_TRAFFIC_BYTES_PER_PARAM,
    DEFAULT_HOST_MEMORY_BYTES_PER_S,
    HardwareModel,
    STALENESS_CORRECTION_BYTES_PER_PARAM,
    optimizer_step_bytes,
    staleness_correction_bytes,
)
from lightning_roundpipe.partition.fitting import fitting_candidates, modelled_peak
from lightning_roundpipe.partition.memory import overlap_banks
from lightning_roundpipe.partition.seqlen import largest_fitting
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.partition.units import format_bytes
from lightning_roundpipe.schedule import ExecutionPlan, build_roundpipe_plan, build_stages

#: Upper bound of the longest-sequence search, tokens (a result equal to it means "at least").
MAX_SEQ_LEN_SEARCHED = 1 << 22


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """Everything `roundpipe plan` prints, as data (tests read this)."""

    modelled: ModelledProfiles
    """Layer sequence with modelled costs."""
    hardware: HardwareModel
    """The device model."""
    num_devices: int
    """Devices of the round robin."""
    num_microbatches: int
    """Microbatches per step."""
    partition: PartitionPlan
    """The partitioner's result."""
    stages: tuple[StageSummary, ...]
    """Stages in round-robin order."""
    execution_plan: ExecutionPlan
    """The round-robin plan (stage k on device k mod D)."""
    step_s: float
    """Predicted seconds per step (steady state when the simulator ran)."""
    idle_pct: tuple[float, ...]
    """Predicted idle share per device, percent."""
    predictor: str
    """What produced ``step_s`` / ``idle_pct``."""
    peak_device_memory_bytes: int
    """The memory model's peak on any device (:func:`modelled_peak`: pools x banks + the largest working set), bytes."""
    max_seq_len: int
    """Longest sequence (tokens, at this microbatch size) whose every layer fits the per-stage budget;
    :data:`MAX_SEQ_LEN_SEARCHED` means at least that many (the search stops there)."""
    max_seq_len_mb1: int
    """The same with one sequence per microbatch."""
    stage_memory_bytes: int
    """The per-stage memory budget the stages were cut with, bytes (lowered from half the device memory
    until the modelled peak fits: :func:`fitting_candidates`)."""
    layer_budget_bytes: int | None = None
    """The per-stage budget ``max_seq_len`` is searched against (the given one), bytes; ``None``: ``stage_memory_bytes``."""
    max_seq_len_bound: int = MAX_SEQ_LEN_SEARCHED
    """Upper bound of the longest-sequence search: ``max_seq_len`` equal to it means "at least"."""
    optimizer: str = "sync"
    """The run's optimizer mode (``--optimizer``): the plan above is the one chosen for it."""
    mode_choices: dict = dc_field(default_factory=dict)
    """Per mode (``"sync"``, ``"async"``), the :class:`~lightning_roundpipe.simulate.steady.ModeChoice`
    the simulator made (empty when the simulator is unavailable)."""
    num_candidates: int = 1
    """Candidate partitions the simulator judged."""
    optimizer_bytes: int = 0
    """Bytes one optimizer step touches: the trainable fp32 masters and their two Adam moments."""
    optimizer_step_s: float = 0.0
    """Seconds of one optimizer step on the host (``optimizer_bytes`` over the host's optimizer rate)."""
    correction_bytes: int = 0
    """Bytes (as ``optimizer_bytes``) the async mode's staleness correction adds to its optimizer step
    (``--staleness-correction``; 0: none)."""
    staleness_correction: str = "none"
    """``--staleness-correction``."""
    accumulate_grad_batches: int = 1
    """Batches per optimizer step (``--accumulate-grad-batches``); ``step_s`` is per batch."""
    microbatches_per_round: int | None = None
    """The microbatch rounds of the plan above (``None``: one round)."""
    stage_memory_given: bool = False
    """Whether ``layer_budget_bytes`` came from `--stage-memory-gib` (else half the device memory)."""
    banks: int = 1
    """Pool banks of the run's mode counted in the peak (2: async, or accumulation, with overlapped batches)."""
    remedies: tuple = ()
    """When the plan does not fit: the single changes whose plan fits by the same memory model
    (:func:`~lightning_roundpipe.cli.plan_fit.fitting_remedies`)."""
    formats: tuple = ()
    """With ``--lora --frozen-weights``: per compared format, its re-planned
    :class:`~lightning_roundpipe.cli.plan_frozen.FormatRow` (empty otherwise)."""

    @property
    def host_weight_bytes(self) -> tuple[int, int]:
        """``(frozen, trainable)`` host bytes of the weights and their training state
        (:meth:`~lightning_roundpipe.partition.costmodel.ModelledProfiles.host_weight_bytes`)."""
        return self.modelled.host_weight_bytes()

    @property
    def weight_h2d_bytes(self) -> int:
        """Weight bytes one step uploads, all devices: every stage's packed weights once per round of
        microbatches (a tied embedding / LM head once per stage that uses it)."""
        rounds = 1 if self.microbatches_per_round is None else -(-self.num_microbatches // self.microbatches_per_round)
        return rounds * sum(s.param_bytes for s in self.stages)

    @property
    def fits(self) -> bool:
        """Whether the modelled peak fits the device memory (the run's check before its first step agrees)."""
        return self.peak_device_memory_bytes <= self.hardware.memory_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.num_microbatches * self.modelled.tokens_per_microbatch / self.step_s


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `roundpipe plan`."""
    p = subparsers.add_parser(
        "plan",
        help="partition a model for N devices from its config and predict throughput (no weights loaded)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=f"model shape preset, one of {preset_names()}")
    src.add_argument("--model", metavar="PATH", help="a local Hugging Face config.json (file or folder)")
    p.add_argument("--devices", default="8",
                   help="number of devices D (default 8), or a list of mixed devices: known GPUs by name"
                        " (4090,4090,3090,3060; see `partition.devices.KNOWN_GPUS`) or bf16 TFLOP/s:memory GiB pairs"
                        " (330:24,142:24), which then replace --tflops and --device-memory-gib; a list prints the plan"
                        " and prediction of both dispatch rules, round robin and weighted by device speed and memory"
                        " (docs/partitioner.md)")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help=f"memory of one device, GiB (default {DEFAULT_DEVICE_MEMORY_GIB:g}; not with a device list)")
    p.add_argument("--stage-memory-gib", type=float, default=None,
                   help="per-stage memory budget, GiB (default: half of --device-memory-gib, as the next stage is prefetched)")
    p.add_argument("--h2d-gbps", type=float, default=25.0, help="host-to-device bandwidth per device, GB/s (1e9 bytes/s; default 25)")
    p.add_argument("--d2h-gbps", type=float, default=None, help="device-to-host bandwidth, GB/s (default: --h2d-gbps)")
    p.add_argument("--duplex-h2d-gbps", type=float, default=None,
                   help="host-to-device bandwidth while downloads run too, GB/s (default: --h2d-gbps)")
    p.add_argument("--tflops", type=float, default=None,
                   help=f"dense peak of one device in the compute dtype, TFLOP/s (default {DEFAULT_TFLOPS:g}, an RTX 4090"
                        " in bf16; 330 in fp16 with fp16 accumulation; not with a device list)")
    p.add_argument("--efficiency", type=float, default=CostModel().gemm_efficiency,
                   help="achieved share of --tflops for dense GEMMs (default %(default)s, fitted to the paper's 4090 timings)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--microbatch-size", type=int, default=4, help="sequences per microbatch (default 4)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step M (default devices + 1: bubbles nearly vanish once M >= D + 1)")
    p.add_argument("--lora", action="store_true", help="LoRA: frozen base, only adapters train")
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank, with --lora (default 16)")
    p.add_argument("--dtype-bytes", type=int, default=2, choices=DTYPE_BYTES,
                   help="bytes of the compute dtype: 1 (fp8), 2 (bf16/fp16) or 4 (fp32); default 2")
    p.add_argument("--frozen-weights", default=None, metavar="{bf16,fp8,nf4,int8}",
                   help="with --lora, how the frozen base's matmul weights are held on the host and uploaded: bf16 (the"
                        " compute dtype; default), fp8 (RoundPipeStrategy(frozen_weights='fp8')), nf4 (frozen_weights="
                        "'nf4'; a model loaded with BitsAndBytesConfig(load_in_4bit=True) holds the same bytes and"
                        " dequantises per matmul), int8 (a model loaded in 8 bits); given, the plan also prints bf16,"
                        " fp8 and nf4 side by side (host memory, uploads, tokens/s), each re-planned")
    p.add_argument("--method", choices=METHOD_CHOICES, default="auto",
                   help="partition: `auto` (default), the candidate the simulator times fastest in the run's"
                        " optimizer mode; or one partitioner method's partition")
    p.add_argument("--optimizer", choices=MODES, default="sync",
                   help="the run's optimizer mode (RoundPipeStrategy(optimizer=...)): `sync` (default; a step is one"
                        " pipeline plus the host's optimizer step) or `async` (the paper's steady state, weights one step"
                        " stale); the plan is chosen for it, both modes' predictions are printed (a device list: this mode's)")
    p.add_argument("--staleness-correction", choices=["none", *STALENESS_CORRECTION_BYTES_PER_PARAM], default="none",
                   help="`--optimizer async`'s RoundPipeStrategy(staleness_correction=...): its measured host cost is"
                        " added to the async mode's optimizer step (partition.profile.STALENESS_CORRECTION_BYTES_PER_PARAM)")
    p.add_argument("--optimizer-gbps", type=float, default=None,
                   help="host optimizer rate: GB/s of fp32 master weights and Adam moments (12 bytes per trainable"
                        " parameter) one optimizer step gets through (default"
                        f" {DEFAULT_HOST_MEMORY_BYTES_PER_S / 1e9:.0f} GB/s of host memory bandwidth x"
                        f" {ADAM_COUNTED_BYTES_PER_PARAM}/{ADAM_HOST_TRAFFIC_BYTES_PER_PARAM} bytes counted per byte"
                        " moved; a run measures it: `roundpipe/optimizer(s)`)")
    p.add_argument("--accumulate-grad-batches", type=int, default=1,
                   help="batches per optimizer step (default 1); the prediction is per batch")
    p.add_argument("--no-overlap-batches", dest="overlap_batches", action="store_false",
                   help="the run's `overlap_batches=False`: one pool bank on each device also with `--optimizer async`"
                        " or `--accumulate-grad-batches` (default: two, the next batch's pipeline overlaps the drain)")
    p.add_argument("--grid-rows", type=int, default=40, help="grid rows shown before truncating (0: all; default 40)")
    p.add_argument("--full-table", action="store_true", help="one row per stage (default: alike neighbours share a row)")
    p.set_defaults(func=run)
    return p


# ---------------------------------------------------------------------- building the report
class PlanDoesNotFit(ValueError):
    """No partition exists: a single layer alone is over the per-stage memory budget (`roundpipe plan` exits 1,
    as for a plan whose peak exceeds the device, not 2 as for a bad argument)."""


def make_report(args: argparse.Namespace, compare: bool = True) -> PlanReport:
    """Compute the plan and its predictions from parsed `roundpipe plan` arguments (a count of equal
    devices; a device list is :func:`~lightning_roundpipe.cli.mixed_plan.make_mixed_report`'s); with
    ``compare``, ``--lora`` and ``--frozen-weights``, each format of
    :data:`~lightning_roundpipe.partition.frozen.COMPARED_FORMATS` re-planned (:attr:`PlanReport.formats`).

    Raises:
        ValueError: a bad argument value (named, with the valid range), or a layer that does not fit
            the per-stage memory budget.
    """
    given = plan_inputs(args)
    hw, D, M, budget = given.hardware, given.num_devices, given.num_microbatches, given.stage_memory_bytes
    optimizer, accumulate, method = given.optimizer, given.accumulate_grad_batches, given.method

    def modelled(seq_len: int, mb: int) -> ModelledProfiles:
        return given.modelled(seq_len, mb, args.dtype_bytes)

    mp = modelled(args.seq_len, args.microbatch_size)
    banks = overlap_banks(optimizer, accumulate, given.overlap_batches)
    layer_budget = budget  # the longest sequence: every single layer within the given per-stage budget
    remedy_args = dict(seq_len=args.seq_len, microbatch_size=args.microbatch_size, dtype_bytes=args.dtype_bytes,
                       lora_rank=args.lora_rank, stage_memory_given=args.stage_memory_gib is not None)
    try:
        candidates, budget = fitting_candidates(mp, D, M, budget, method, banks, args.dtype_bytes, hw.memory_bytes,
                                                lower=args.stage_memory_gib is None)
    except ValueError as error:  # a single layer over the per-stage budget: name the changes that fit
        raise PlanDoesNotFit(str(error).split(" HINT:")[0] + " "
                             + remedies_hint(fitting_remedies(given, **remedy_args, current=None))) from None
    optimizer_bytes = optimizer_step_bytes(model_param_counts(mp)[1])
    correction = getattr(args, "staleness_correction", "none")
    correction_bytes = staleness_correction_bytes(model_param_counts(mp)[1], None if correction == "none" else correction)
    choices = choose_modes(candidates, mp, hw, D, M, optimizer_bytes, accumulate, correction_bytes)
    chosen = choices.get(optimizer)
    part = candidates[0][1] if chosen is None else chosen.partition
    per_round = None if chosen is None else chosen.microbatches_per_round
    stages = tuple(describe_stages(part, mp.profiles, mp.saved_activation_bytes, mp.shared_weights))
    fwd, bwd = schedule_ranges(part)
    eplan = build_roundpipe_plan(build_stages(fwd, bwd, fused_tail=True), D, M, microbatches_per_round=per_round)
    peak = modelled_peak(mp, stages, D, M, banks, args.dtype_bytes)
    remedies = () if peak <= hw.memory_bytes else tuple(fitting_remedies(given, **remedy_args, current=peak))
    if chosen is None:
        step_s, idle, predictor = _predict(eplan, mp, hw)
    else:
        step_s, idle = chosen.prediction.step_s, chosen.prediction.idle_pct
        predictor = f"simulator, {optimizer} optimizer" + (", steady state" if optimizer == "async" else "")
    report = PlanReport(
        modelled=mp, hardware=hw, num_devices=D, num_microbatches=M, partition=part, stages=stages,
        execution_plan=eplan, step_s=step_s, idle_pct=idle, predictor=predictor,
        optimizer=optimizer, mode_choices=choices, num_candidates=len(candidates), optimizer_bytes=optimizer_bytes,
        optimizer_step_s=optimizer_bytes / hw.optimizer_bytes_per_s, accumulate_grad_batches=accumulate,
        correction_bytes=correction_bytes, staleness_correction=correction,
        microbatches_per_round=per_round,
        peak_device_memory_bytes=peak, remedies=remedies, banks=banks, stage_memory_given=args.stage_memory_gib is not None,
        max_seq_len=longest_sequence(lambda s: modelled(s, args.microbatch_size), layer_budget),
        max_seq_len_mb1=longest_sequence(lambda s: modelled(s, 1), layer_budget),
        stage_memory_bytes=budget, layer_budget_bytes=layer_budget,
        max_seq_len_bound=MAX_SEQ_LEN_SEARCHED,
    )
    if compare and args.lora and getattr(args, "frozen_weights", None) is not None:
        from lightning_roundpipe.cli.plan_frozen import compare_formats

        report = dataclasses.replace(report, formats=compare_formats(args, report, make_report))
    return report


def longest_sequence(modelled: Callable[[int], ModelledProfiles], stage_memory_bytes: int) -> int:
    """Longest sequence length (tokens) for which every single layer fits a backward stage within
    ``stage_memory_bytes`` (so a partition exists; stage memory grows with the sequence). 0 if none.
    The search stops at :data:`MAX_SEQ_LEN_SEARCHED` tokens: that value means "at least this many".

    Args:
        modelled: sequence length -> modelled profiles (microbatch size fixed by the caller).
        stage_memory_bytes: the per-stage budget, bytes.
    """

    def fits(seq_len: int) -> bool:
        mp = modelled(seq_len)
        return min_stage_memory_bytes(mp.profiles, mp.saved_activation_bytes) <= stage_memory_bytes

    return largest_fitting(fits, MAX_SEQ_LEN_SEARCHED)


def choose_modes(candidates: Sequence[tuple[str, PartitionPlan]], mp: ModelledProfiles, hw: HardwareModel,
                 num_devices: int, num_microbatches: int, optimizer_bytes: int,
                 accumulate_grad_batches: int = 1, async_extra_bytes: int = 0) -> dict:
    """Per optimizer mode, the candidate (each with one round or, when ``M > D > 1``, rounds of D
    microbatches, as the paper's artifact runs) the simulator times fastest in that mode
    (:func:`~lightning_roundpipe.simulate.steady.choose_for_mode`); ``{}`` when the simulator is
    unavailable. ``async_extra_bytes``: added to the async mode's ``OPT`` op (a staleness correction)."""
    try:
        importlib.import_module("lightning_roundpipe.simulate.engine")  # the event simulator itself
        from lightning_roundpipe.simulate.steady import choose_for_mode
    except ImportError:
        return {}
    rounds = [None] + ([num_devices] if num_microbatches > num_devices > 1 else [])
    return {mode: choose_for_mode(candidates, mp.profiles, hw, num_devices, num_microbatches, optimizer=mode,
                                  optimizer_bytes=optimizer_bytes + (async_extra_bytes if mode == "async" else 0),
                                  round_options=rounds,
                                  accumulate_grad_batches=accumulate_grad_batches) for mode in MODES}


def _predict(plan: ExecutionPlan, mp: ModelledProfiles, hw: HardwareModel) -> tuple[float, tuple[float, ...], str]:
    """Step seconds and per-device idle % of a compute-only list-order walk (transfers free, one
    step with fill and drain, no optimizer step): the fallback when the simulator is unavailable."""
    from lightning_roundpipe.schedule import walk_in_order

    cost = {}
    for spec in plan.stages:
        per_layer = (lambda p: p.forward_s) if spec.kind == "forward" else (lambda p: p.recompute_backward_s)
        cost[spec.stage_index] = sum(per_layer(mp.profiles[i]) for i in spec.layers)
    events = walk_in_order(plan, lambda a: cost[a.stage_index] if a.kind.is_compute else 0.0)
    wall = max(e for _, _, _, e in events)
    busy = [0.0] * plan.num_devices
    for d, a, s, e in events:
        busy[d] += e - s
    return wall, tuple(100.0 * (1 - b / wall) for b in busy), "compute-only walk (simulator unavailable)"


# ---------------------------------------------------------------------- printing
def format_report(r: PlanReport, grid_rows: int = 40, full_table: bool = False) -> str:
    """The text `roundpipe plan` prints."""
    mp, hw, sh = r.modelled, r.hardware, r.modelled.shape
    total_params, trainable = model_param_counts(mp)
    nf = sum(1 for s in r.stages if s.kind == "forward")
    nb = len(r.stages) - nf
    lines = [
        f"model: {sh.name} ({sh.model_type}, {sh.num_hidden_layers} decoder layers, layer sequence L = {sh.num_layers};"
        f" {total_params / 1e9:.3g}B weights, {trainable / 1e9:.3g}B trainable{', LoRA r=' + str(mp.lora.rank) if mp.lora else ''})",
        f"workload: microbatch {mp.microbatch_size} x {mp.seq_len} tokens = {mp.tokens_per_microbatch} tokens,"
        f" {r.num_microbatches} microbatches per step ({r.num_microbatches * mp.tokens_per_microbatch} tokens)",
        f"hardware: {r.num_devices} device{'s' if r.num_devices != 1 else ''} x {_num(hw.memory_bytes / GiB)} GiB, {_num(hw.flops_per_s / 1e12)} TFLOP/s"
        f" peak (GEMM efficiency {_num(mp.cost_model.gemm_efficiency)}), H2D {_num(hw.h2d_bytes_per_s / 1e9)} GB/s,"
        f" D2H {_num(hw.d2h_bytes_per_s / 1e9)} GB/s; per-stage memory budget {budget_label(r)}",
    ]
    if sh.model_type not in KNOWN_MODEL_TYPES:
        lines.append(f"note: model_type `{sh.model_type}` is not one the cost model knows ({', '.join(KNOWN_MODEL_TYPES)}):"
                     " its layers are costed as a llama-style decoder's from the config's sizes")
    lines += [
        f"partition: {nf} forward + {nb} backward stages (incl. the fused tail) = {len(r.stages)} stages;"
        f" objective max(S, D) x W = {r.partition.objective_s:.3f} s" + _choice_note(r),
        "",
        stage_table(r, full_table),
        "",
        f"round-robin plan (stage k on device k mod {r.num_devices}; unit time per compute):",
        _truncated_grid(r.execution_plan, grid_rows),
        "",
        f"predicted step: {r.step_s:.3f} s  ->  {r.tokens_per_s:,.0f} tokens/s  [{r.predictor}]",
        "idle per device (%): " + "  ".join(f"dev{d} {x:.1f}" for d, x in enumerate(r.idle_pct))
        + f"   (mean {sum(r.idle_pct) / len(r.idle_pct):.1f})",
        *_mode_table(r),
        f"peak device memory: {format_bytes(r.peak_device_memory_bytes)} of {format_bytes(hw.memory_bytes)}"
        f" ({'two pool banks' if r.banks == 2 else 'one pool bank'} of stage weight slots, accumulators and transfer"
        " slots + the largest stage working set)",
        f"longest sequence a stage can hold: {_tokens(r.max_seq_len, r.max_seq_len_bound)} at microbatch size"
        f" {mp.microbatch_size}"
        + (f"; {_tokens(r.max_seq_len_mb1, r.max_seq_len_bound)} at microbatch size 1" if mp.microbatch_size != 1 else "")
        + f" (every single layer within the {format_bytes(r.layer_budget_bytes or r.stage_memory_bytes)} per-stage"
        f" budget{'' if r.stage_memory_given else ', half the device memory'}"
        + (", before the lowering above" if r.stage_memory_bytes < (r.layer_budget_bytes or 0) else "")
        + "; an upper bound: the pools come on top,"
        " `--seq-len N` plans a length against the device"
        + (f"; the search stops at {r.max_seq_len_bound:,} tokens)" if r.max_seq_len_mb1 >= r.max_seq_len_bound else ")"),
        *frozen_lines(r),
        *(f"ERROR: {line}" if i == 0 else line for i, line in enumerate(fit_lines(r))),
    ]
    return "\n".join(lines)


def _choice_note(r: PlanReport) -> str:
    chosen = r.mode_choices.get(r.optimizer)
    if chosen is None:
        return ""
    rounds = "" if r.microbatches_per_round is None else f", rounds of {r.microbatches_per_round} microbatches"
    return (f"; `{chosen.label}`{rounds}, the fastest in the simulator for the {r.optimizer} optimizer of"
            f" {r.num_candidates} candidate partition(s)")


def paper_model_name(mp: ModelledProfiles) -> str:
    """The paper's column name for the model (``"Qwen3-235B-A22B-LoRA"`` for the LoRA run)."""
    return mp.shape.name + ("-LoRA" if mp.lora is not None else "")


def _mode_table(r: PlanReport) -> list[str]:
    """Both modes' predictions side by side, the optimizer step, and the paper's figures for the model."""
    if not r.mode_choices:
        return []
    tokens = r.num_microbatches * r.modelled.tokens_per_microbatch
    rate = r.hardware.optimizer_bytes_per_s
    source = ("--optimizer-gbps" if r.hardware.host_optimizer_bytes_per_s is not None else
              f"default: {DEFAULT_HOST_MEMORY_BYTES_PER_S / 1e9:.0f} GB/s host memory x"
              f" {ADAM_COUNTED_BYTES_PER_PARAM}/{ADAM_HOST_TRAFFIC_BYTES_PER_PARAM}")
    accumulate = f", every {r.accumulate_grad_batches} batches" if r.accumulate_grad_batches > 1 else ""
    lines = ["", f"optimizer step on the host: {r.optimizer_bytes / 1e9:.3g} GB of fp32 masters and Adam moments at"
                 f" {rate / 1e9:.3g} GB/s ({source}) = {r.optimizer_step_s:.3f} s{accumulate}",
             *([f"async with staleness_correction={r.staleness_correction!r}: + {r.correction_bytes / 1e9:.3g} GB counted"
                f" = {r.correction_bytes / rate:.3f} s more per optimizer step (benchmarks/staleness_cost.py)"]
               if r.correction_bytes else []),
             f"{'mode':<8} {'plan for the mode':<34} {'step s':>8} {'tokens/s':>10} {'mean idle %':>12}"]
    for mode in MODES:
        choice = r.mode_choices[mode]
        rounds = "one round" if choice.microbatches_per_round is None else f"rounds of {choice.microbatches_per_round}"
        label = "" if choice.label.endswith("stages") else f" ({choice.label})"
        plan = f"{_stages_of(choice.partition)} stages{label}, {rounds}"
        mark = "*" if mode == r.optimizer else " "
        lines.append(f"{mode + mark:<8} {plan:<34} {choice.prediction.step_s:>8.3f}"
                     f" {choice.prediction.tokens_per_s(tokens):>10,.0f} {choice.prediction.mean_idle_pct:>12.1f}")
    lines.append("  (* the plan shown above; sync: one pipeline with fill and drain + the optimizer step; async: steady"
                 " state, the next step's forward stages fill this step's drain, weights one step stale)")
    try:
        from lightning_roundpipe.simulate.paper_data import paper_reference
    except ImportError:
        return lines
    ref = paper_reference(paper_model_name(r.modelled))
    if "steady_idle_pct" in ref:
        lines.append(f"paper ({paper_model_name(r.modelled)}, simulated, 8 GPUs x 16 microbatches): idle"
                     f" {ref['one_iteration_idle_pct']:.1f} % one iteration, {ref['steady_idle_pct']:.1f} % steady state")
    if "async_tokens_per_s" in ref:
        lines.append(f"paper (measured, 8x RTX 4090, 16 x 4 x 2048 tokens): {ref['async_tokens_per_s']:,.0f} tokens/s"
                     f" async, {ref.get('sync_tokens_per_s', float('nan')):,.0f} sync")
    return lines


def _stages_of(partition: PartitionPlan) -> int:
    return len(partition.forward_stages) + len(partition.backward_stages) - 1


def _num(x: float) -> str:
    """A hardware figure with enough digits: 165, 0.1, 24, 25.5, 0.0125."""
    return f"{x:.4g}"


def _tokens(n: int, bound: int) -> str:
    return f"at least {n:,} tokens" if n >= bound else f"{n:,} tokens"




def run(args: argparse.Namespace) -> int:
    """`roundpipe plan`: print the report; exit status 2 on a bad input, 1 when the plan does not fit the
    device memory (the report is printed, the reason and the changes that fit on stderr)."""
    try:
        devices = parse_devices(args.devices) if isinstance(args.devices, str) else args.devices
        if not isinstance(devices, int):
            print(mixed_plan.format_mixed_report(mixed_plan.make_mixed_report(args, devices), args.grid_rows))
            return 0
        args.devices = devices
        report = make_report(args)
    except PlanDoesNotFit as e:
        print(f"roundpipe plan: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"roundpipe plan: error: {e}", file=sys.stderr)
        return 2
    print(format_report(report, args.grid_rows, args.full_table))
    if not report.fits:
        print("roundpipe plan: error: " + " ".join(fit_lines(report)), file=sys.stderr)
        return 1
    return 0
