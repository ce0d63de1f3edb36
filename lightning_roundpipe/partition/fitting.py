"""Partitions whose modelled device peak fits the device (issue 30): the one memory model
(:mod:`lightning_roundpipe.partition.memory`) applied to the partitioner's candidates, for plans made
without a run (``roundpipe plan``). Pure: no torch, no device."""

from __future__ import annotations

from typing import Sequence

from lightning_roundpipe.partition.candidates import candidate_partitions
from lightning_roundpipe.partition.costmodel import ModelledProfiles
from lightning_roundpipe.partition.memory import planner_stage_bytes
from lightning_roundpipe.partition.partitioner import StageSummary, auto_partition, describe_stages, min_stage_memory_bytes
from lightning_roundpipe.partition.seqlen import peak_device_memory_bytes
from lightning_roundpipe.partition.types import PartitionPlan


def fitting_candidates(mp: ModelledProfiles, num_devices: int, num_microbatches: int, budget: int, method: str,
                       banks: int, dtype_bytes: int, memory_bytes: int, lower: bool = True
                       ) -> tuple[list[tuple[str, PartitionPlan]], int]:
    """The candidate partitions (``method="auto"``: every method's and the filling ones; else that
    method's) whose modelled device peak (:func:`modelled_peak`) fits ``memory_bytes``, and the per-stage
    budget they were cut with: while none fits and ``lower`` (no `--stage-memory-gib` given), the budget
    is lowered by 15 % and the stages cut again, down to the smallest budget a single layer admits.
    Returns every candidate when none fits (the report warns)."""
    floor = min_stage_memory_bytes(mp.profiles, mp.saved_activation_bytes)
    while True:
        if method == "auto":
            candidates = candidate_partitions(mp.profiles, num_devices, budget,
                                              saved_activation_bytes=mp.saved_activation_bytes)
        else:
            candidates = [(method, auto_partition(mp.profiles, num_devices, budget, method,
                                                  saved_activation_bytes=mp.saved_activation_bytes))]
        fit = [(name, part) for name, part in candidates
               if modelled_peak(mp, describe_stages(part, mp.profiles, mp.saved_activation_bytes, mp.shared_weights),
                                num_devices, num_microbatches, banks, dtype_bytes) <= memory_bytes]
        if fit:
            return fit, budget
        if not lower or int(budget * 0.85) < floor:
            return candidates, budget
        budget = int(budget * 0.85)


def modelled_peak(mp: ModelledProfiles, stages: Sequence[StageSummary], num_devices: int, num_microbatches: int,
                  banks: int, dtype_bytes: int) -> int:
    """Peak bytes on any device, the one memory model
    (:func:`~lightning_roundpipe.partition.seqlen.peak_device_memory_bytes`): pools x ``banks`` (2 in the
    overlapped modes: async, or sync with accumulation), the fp32 accumulators under mixed precision, the
    transfer slots of the step's program, and the largest stage working set with the dequantised copies
    of its frozen weights (``mp.frozen``'s format)."""
    kinds = [(s.kind, s.layers) for s in stages]
    return peak_device_memory_bytes(mp, kinds, num_devices, num_microbatches, banks=banks,
                                    stage_bytes=planner_stage_bytes(mp.profiles, kinds, dtype_bytes,
                                                                    mp.frozen_layer_bytes))
