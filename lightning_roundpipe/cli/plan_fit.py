"""`roundpipe plan` for a plan that does not fit: which single changes would fit, by the same memory model.

:func:`fitting_remedies` tries the changes a user can make one at a time (LoRA, an nf4 frozen base
under LoRA, a smaller microbatch, a shorter sequence, one pool bank, the automatic lowering of the per-stage budget, devices with more
memory; not more devices: they add transfer slots and take no stage weights off a device), each through the partitioner's candidates and the one memory model
(:func:`~lightning_roundpipe.partition.fitting.fitting_candidates`, :func:`~lightning_roundpipe.partition.fitting.modelled_peak`),
and names only those whose plan fits the device. Pure: no torch, no device, no simulator.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from lightning_roundpipe.partition.costmodel import LoRASpec
from lightning_roundpipe.partition.frozen import FrozenFormat
from lightning_roundpipe.partition.fitting import fitting_candidates, modelled_peak
from lightning_roundpipe.partition.memory import overlap_banks
from lightning_roundpipe.partition.partitioner import describe_stages, min_stage_memory_bytes
from lightning_roundpipe.partition.units import format_bytes

GiB = 2**30
#: shortest sequence a halving remedy proposes, tokens
MIN_REMEDY_SEQ_LEN = 128


@dataclasses.dataclass(frozen=True)
class Remedy:
    """One change that makes the plan fit.

    Attributes:
        change: the change as the user writes it (`roundpipe plan`'s flags, the run's setting).
        peak_bytes: the modelled peak of the plan with that change, bytes.
        memory_bytes: one device's memory with that change, bytes.
        flags: `roundpipe plan` arguments to add (a later value of a flag wins).
        dropped: `roundpipe plan` flags to leave out (with their value).
    """

    change: str
    peak_bytes: int
    memory_bytes: int
    flags: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.change} (peak {format_bytes(self.peak_bytes)} of {format_bytes(self.memory_bytes)})"


def plan_peak(given: Any, *, seq_len: int, microbatch_size: int, dtype_bytes: int, lower: bool,
              banks: int | None = None) -> int | None:
    """The smallest modelled device peak, bytes, among the partitions `roundpipe plan` would consider for
    ``given`` (its :class:`~lightning_roundpipe.cli.plan_cmd.PlanInputs`, possibly changed) at this sequence
    and microbatch size, with the per-stage budget lowered while none fits when ``lower``; ``None`` when a
    single layer exceeds the per-stage budget (no partition exists)."""
    mp = given.modelled(seq_len, microbatch_size, dtype_bytes)
    if banks is None:
        banks = overlap_banks(given.optimizer, given.accumulate_grad_batches, given.overlap_batches)
    try:
        candidates, _ = fitting_candidates(mp, given.num_devices, given.num_microbatches, given.stage_memory_bytes,
                                           given.method, banks, dtype_bytes, given.hardware.memory_bytes, lower=lower)
    except ValueError:
        return None
    return min(modelled_peak(mp, describe_stages(part, mp.profiles, mp.saved_activation_bytes, mp.shared_weights),
                             given.num_devices, given.num_microbatches, banks, dtype_bytes) for _, part in candidates)


def fitting_remedies(given: Any, *, seq_len: int, microbatch_size: int, dtype_bytes: int, lora_rank: int,
                     stage_memory_given: bool, current: int | None) -> list[Remedy]:
    """The single changes whose plan fits the device, by the memory model (see the module docstring).

    Args:
        given: the plan's validated inputs (:class:`~lightning_roundpipe.cli.plan_cmd.PlanInputs`).
        seq_len, microbatch_size, dtype_bytes: the plan's workload and compute dtype.
        lora_rank: the adapters' rank a `--lora` remedy uses.
        stage_memory_given: whether `--stage-memory-gib` was given (then the budget is not lowered).
        current: the plan's own modelled peak, bytes (a device that large is tried, re-planned for it);
            ``None``: a single layer exceeds the per-stage budget (a device twice that layer's need is tried).

    Returns:
        the remedies that fit, each with the smallest modelled peak among its fitting partitions (the plan
        with that change picks the fastest of them); empty when no single change fits.
    """
    memory = given.hardware.memory_bytes
    lower = not stage_memory_given
    workload = dict(seq_len=seq_len, microbatch_size=microbatch_size, dtype_bytes=dtype_bytes)
    out: list[Remedy] = []

    def fits(change: str, flags: tuple[str, ...], inputs: Any = given, lowering: bool = lower, dropped: tuple = (),
             **kw: Any) -> bool:
        peak = plan_peak(inputs, **{**workload, **kw, "lower": lowering})
        if peak is not None and peak <= memory:
            out.append(Remedy(change, peak, memory, flags, dropped))
            return True
        return False

    if given.lora is None:
        fits(f"`--lora` (rank {lora_rank}: a frozen base, only adapters train)", ("--lora",),
             dataclasses.replace(given, lora=LoRASpec(rank=lora_rank)))
    elif given.frozen.name in ("bf16", "fp8"):  # a packed base: smaller stage weight slots
        fits("`--frozen-weights nf4` (the run's `frozen_weights=\"nf4\"`: the frozen base packed in 4 bits)",
             ("--frozen-weights", "nf4"), dataclasses.replace(given, frozen=FrozenFormat(name="nf4")))
    size = microbatch_size // 2
    while size >= 1 and not fits(f"`--microbatch-size {size}`", ("--microbatch-size", str(size)),
                                        microbatch_size=size):
        size //= 2
    length = seq_len // 2
    while length >= MIN_REMEDY_SEQ_LEN and not fits(f"`--seq-len {length}`", ("--seq-len", str(length)),
                                                         seq_len=length):
        length //= 2
    if overlap_banks(given.optimizer, given.accumulate_grad_batches, given.overlap_batches) == 2:
        fits("`--no-overlap-batches` (the run's `overlap_batches=False`: one pool bank instead of two)",
             ("--no-overlap-batches",), banks=1)
    if stage_memory_given:
        fits("leaving out `--stage-memory-gib` (the per-stage budget is then lowered until a partition fits)", (),
             dataclasses.replace(given, stage_memory_bytes=memory // 2), lowering=True, dropped=("--stage-memory-gib",))
    if current is None:  # a single layer over the budget: from a device whose half holds the largest layer
        mp = given.modelled(seq_len, microbatch_size, dtype_bytes)
        current = 2 * min_stage_memory_bytes(mp.profiles, mp.saved_activation_bytes)
    if current:  # a device as large as this plan's peak, re-planned for it (a larger budget cuts larger stages)
        gib = _round_up(current / GiB)
        for _ in range(4):
            larger = dataclasses.replace(given, hardware=dataclasses.replace(given.hardware, memory_bytes=int(gib * GiB)),
                                         stage_memory_bytes=given.stage_memory_bytes if stage_memory_given
                                         else int(gib * GiB) // 2)
            peak = plan_peak(larger, **workload, lower=lower)
            if peak is None:
                break
            if peak <= int(gib * GiB):
                out.append(Remedy(f"devices of {gib:g} GiB (`--device-memory-gib {gib:g}`)", peak, int(gib * GiB),
                                  ("--device-memory-gib", f"{gib:g}")))
                break
            gib = _round_up(peak / GiB)
    return out


def _round_up(gib: float) -> float:
    """``gib`` rounded up to two significant digits (12.54 -> 13, 0.0586 -> 0.059)."""
    step = 10.0 ** (math.floor(math.log10(gib)) - 1)
    return float(f"{math.ceil(gib / step - 1e-9) * step:.2g}")


def budget_label(r: Any) -> str:
    """The per-stage budget the stages of report ``r`` were cut with, and where it comes from (the given
    or default budget, or that budget lowered until the modelled peak fits)."""
    given = r.layer_budget_bytes or r.stage_memory_bytes
    origin = "`--stage-memory-gib`" if r.stage_memory_given else "half the device memory"
    if r.stage_memory_bytes >= given:
        return f"{format_bytes(r.stage_memory_bytes)} ({origin})"
    banks = "two pool banks" if r.banks == 2 else "one pool bank"
    until = (f"until the modelled peak with {banks} fits the device" if r.fits else
             f"as far as a single layer admits; the modelled peak with {banks} still exceeds the device")
    return f"{format_bytes(r.stage_memory_bytes)} (lowered from {format_bytes(given)}, {origin}, {until})"


def fit_lines(r: Any) -> list[str]:
    """When report ``r``'s plan does not fit the device: the error line (first) and its HINT, naming only
    the changes whose plan fits (:attr:`remedies`); else no lines."""
    if r.fits:
        return []
    memory = r.hardware.memory_bytes
    peak = f"the plan does not fit: its modelled peak is {format_bytes(r.peak_device_memory_bytes, exact=True)} on a device of" \
           f" {format_bytes(memory, exact=True)}"
    lines = [peak + (" (`--stage-memory-gib` given: the per-stage budget is not lowered)" if r.stage_memory_given else
                     ", with the per-stage budget lowered as far as a single layer allows")]
    return [*lines, remedies_hint(r.remedies)]


def remedies_hint(remedies: Sequence[Remedy]) -> str:
    """The HINT naming ``remedies`` (the changes that fit), or saying that no single change tried fits."""
    if remedies:
        return "HINT: each of these fits by the same memory model: " + "; ".join(r.describe() for r in remedies) + "."
    return ("HINT: no single change tried fits (LoRA, an nf4 base, a smaller microbatch, a shorter sequence, one pool bank, devices"
            " with more memory); combine them.")

