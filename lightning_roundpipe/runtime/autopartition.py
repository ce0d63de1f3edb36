"""The simulator's view of a running engine (DESIGN.md section 6): the automatic partition, where
after the profiled steps the candidate partitions, each with the candidate microbatch rounds, are
timed by the simulator on the measured layer times and the fastest wins; and the prediction of the
steps the engine runs.

Functions of a :class:`~lightning_roundpipe.runtime.engine.RoundPipeEngine` (passed in; this module
does not import it); :func:`fused_stages` is also the engine's fused-path stage list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from lightning_roundpipe.partition.profile import LayerProfile
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.schedule import build_stages, default_stage_ranges


def fused_stages(partition: PartitionPlan):
    """Stages of the fused path for ``partition``: forward stages clipped before the tail, the tail fused."""
    tail = partition.backward_stages[0]
    fwd = [range(r.start, min(r.stop, tail.start)) for r in partition.forward_stages]
    return build_stages([r for r in fwd if len(r)], partition.backward_stages, fused_tail=True)


@dataclass(frozen=True)
class PlanChoice:
    """What the automatic partition chose.

    Attributes:
        partition: the stage boundaries.
        microbatches_per_round: the microbatch rounds the plan is built with (``None``: one round).
        simulated_s: the simulator's time of one step of the last call's shape, seconds (``None``
            when nothing was timed: no call seen yet).
    """

    partition: PartitionPlan
    microbatches_per_round: int | None
    simulated_s: float | None = None


def round_options(engine: Any, num_microbatches: int) -> list[int | None]:
    """Microbatch rounds the automatic choice may try, fewest rounds (fewest weight uploads) first.

    The user's ``microbatches_per_round`` when set; otherwise one round (``None``), rounds of
    ``ceil(M / D)`` (one dispatch per device for a single-stage plan, as many uploads as one round),
    of ``D`` (the paper's artifact) and of 1. Only one round with one device (rounds would only add
    uploads) or with a routing model (the load-balancing loss needs every microbatch's forward before
    any recomputation, which several rounds do not give on the fused path).
    """
    pinned = engine.rounds_pinned
    if pinned or len(engine.backends) == 1 or engine.seq.routing is not None:
        return [engine.microbatches_per_round]
    devices = len(engine.backends)
    out: list[int | None] = [None]
    for per_round in (math.ceil(num_microbatches / devices), devices, 1):
        if per_round < num_microbatches and per_round not in out:
            out.append(per_round)
    return out


def choose_partition(engine: Any, profiles: Sequence[LayerProfile]) -> PlanChoice:
    """The partition and microbatch rounds to run from now on, chosen by the simulator on the
    measured layer times.

    Candidates: what each of the partitioner's methods proposes (DESIGN.md section 6), the uniform
    asymmetric cuts (forward stages of 1..4 layers, backward stages of 1..2) and the whole model as
    one fused stage (no recomputation at all; with rounds, microbatches go to the devices in turn),
    each only where every stage fits the stage memory budget; each with every option of
    :func:`round_options`. The simulator times the program each would run (same microbatches, fused
    or not, the same link) and the fastest wins (ties: listed first, so fewer rounds and the
    partitioner's own cut). The partitioner's objective, ``max(S, D) x`` the largest stage cost,
    does not see the fill and drain of the round robin, which dominate with few devices and
    microbatches.
    """
    from lightning_roundpipe.partition import METHODS, auto_partition, plan_objective_s, stage_memory

    n = len(engine.seq)
    candidates = [auto_partition(profiles, len(engine.backends), engine.stage_memory_bytes, method=m) for m in METHODS]
    if engine._last_call is None:
        return PlanChoice(candidates[0], engine.microbatches_per_round)
    budget = engine.stage_memory_bytes

    def fits(fwd: Sequence[range], bwd: Sequence[range]) -> bool:
        return budget is None or all(stage_memory(profiles, r, kind) <= budget
                                     for rs, kind in ((fwd, "forward"), (bwd, "backward")) for r in rs)

    for forward_layers in range(1, 5):
        for backward_layers in (1, 2):
            _, bwd = default_stage_ranges(n, forward_layers, backward_layers)
            tail = bwd[0]  # auto_partition's form: the forward stages end with the fused tail's range
            fwd = tuple(range(i, min(i + forward_layers, tail.start)) for i in range(0, tail.start, forward_layers))
            fwd += (tail,)
            if fits(fwd, bwd):
                uniform = PartitionPlan(fwd, bwd)
                candidates.append(PartitionPlan(fwd, bwd, plan_objective_s(uniform, profiles, len(engine.backends))))
    whole = (range(0, n),)
    if fits(whole, whole):
        candidates.append(PartitionPlan(whole, whole, plan_objective_s(PartitionPlan(whole, whole), profiles,
                                                                        len(engine.backends))))
    timed = []
    for per_round in round_options(engine, engine._last_call[0]):
        for i, candidate in enumerate(candidates):
            timed.append((simulated_step_s(engine, candidate, profiles, per_round), len(timed), i, per_round))
    best_s, _, best, per_round = min(timed)
    engine.info(f"RoundPipe: simulated step of {len(candidates)} candidate partitions x"
                f" {len(timed) // len(candidates)} microbatch-round options: {best_s * 1e3:.1f} .."
                f" {max(t[0] for t in timed) * 1e3:.1f} ms; chose candidate {best} with"
                f" {describe_rounds(per_round, engine._last_call[0])} (simulated step {best_s * 1e3:.1f} ms)")
    return PlanChoice(candidates[best], per_round, best_s)


def describe_rounds(microbatches_per_round: int | None, num_microbatches: int) -> str:
    """``"one round"`` or ``"rounds of P microbatch(es)"``: what a plan of ``num_microbatches`` runs
    (a round size of ``M`` or more is one round)."""
    if microbatches_per_round is None or microbatches_per_round >= num_microbatches:
        return "one round"
    return f"rounds of {microbatches_per_round} microbatch(es)"


def simulated_step_s(engine: Any, partition: PartitionPlan, profiles: Sequence[LayerProfile],
                     microbatches_per_round: int | None = None) -> float:
    """Simulated time of one step of the last call's shape (microbatches, fused or not) under
    ``partition`` with ``microbatches_per_round``, seconds."""
    from lightning_roundpipe.simulate import simulate_program

    num_microbatches, fused = engine._last_call
    if fused:
        plans = [engine._build_plan(fused_stages(partition), num_microbatches, 0, microbatches_per_round)]
    else:
        plan = engine._build_plan(build_stages(partition.forward_stages, partition.backward_stages), num_microbatches, 0,
                             microbatches_per_round)
        plans = [plan.phase("forward"), plan.phase("backward")]
    hardware, weights = engine.hardware_model(), engine.microbatch_weights(num_microbatches)
    return sum(simulate_program(engine._lower(p), profiles, hardware, microbatch_weights=weights).iteration_s
               for p in plans)


def hardware_model(engine: Any):
    """The link model the prediction uses: on CUDA the measured pinned H2D/D2H rates of the first
    GPU (bytes/s; duplex taken as the H2D rate); on CPU virtual devices the modelled link, or
    ``None`` when copies are unthrottled (transfers then cost nothing in the prediction)."""
    from lightning_roundpipe.partition.profile import HardwareModel

    if engine.backends[0].is_cuda:
        h2d, d2h = engine.backends[0].measure_link()
    elif engine.cpu_link_bytes_per_s is not None:
        h2d = d2h = engine.cpu_link_bytes_per_s
    else:
        return None
    return HardwareModel(flops_per_s=1.0, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, h2d_duplex_bytes_per_s=h2d)


def microbatch_weights(sizes: Sequence[int], num_microbatches: int) -> list[float] | None:
    """Rows of each microbatch relative to their mean (a batch of 8 in 3 microbatches:
    ``[1.125, 1.125, 0.75]``), the simulator's ``microbatch_weights``; ``None`` when they are equal or
    ``sizes`` is of another microbatch count."""
    if len(sizes) != num_microbatches or len(set(sizes)) <= 1:
        return None
    mean = sum(sizes) / len(sizes)
    return [size / mean for size in sizes]


def predict_step_s(engine: Any, programs: Sequence[Any]) -> float | None:
    """The simulator's time for ``programs`` (one step's), seconds, from the engine's measured
    per-layer profiles and the last call's microbatch sizes; ``None`` before the profiled steps are
    over. The same programs the executor ran are timed (DESIGN.md section 3: one program, two
    consumers); each program's time is cached by the engine."""
    if engine.measured_profiles is None or not programs:
        return None
    from lightning_roundpipe.simulate import simulate_program

    total = 0.0
    for program in programs:
        got = engine._predictions.get(id(program))
        if got is None or got[0] is not program:
            weights = engine.microbatch_weights(program.plan.num_microbatches)
            got = engine._predictions[id(program)] = (program, simulate_program(
                program, engine.measured_profiles, engine.hardware_model(), microbatch_weights=weights).iteration_s)
        total += got[1]
    return total
