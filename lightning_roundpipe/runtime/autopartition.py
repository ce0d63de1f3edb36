"""The automatic partition of a running engine (DESIGN.md section 6): after the profiled steps,
the candidate partitions are timed by the simulator on the measured layer times and the fastest wins.

Functions of a :class:`~lightning_roundpipe.runtime.engine.RoundPipeEngine` (passed in; this module
does not import it); :func:`fused_stages` is also the engine's fused-path stage list.
"""

from __future__ import annotations

from typing import Any, Sequence

from lightning_roundpipe.partition.profile import LayerProfile
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.schedule import build_stages, default_stage_ranges


def fused_stages(partition: PartitionPlan):
    """Stages of the fused path for ``partition``: forward stages clipped before the tail, the tail fused."""
    tail = partition.backward_stages[0]
    fwd = [range(r.start, min(r.stop, tail.start)) for r in partition.forward_stages]
    return build_stages([r for r in fwd if len(r)], partition.backward_stages, fused_tail=True)


def choose_partition(engine: Any, profiles: Sequence[LayerProfile]) -> PartitionPlan:
    """The partition to run from now on, chosen by the simulator on the measured layer times.

    Candidates: what each of the partitioner's methods proposes (DESIGN.md section 6), and the
    uniform asymmetric cuts (forward stages of 1..4 layers, backward stages of 1..2) that fit
    the stage memory budget; the simulator times the program each would run (same
    microbatches, fused or not, the same link) and the fastest wins (ties: listed first). The
    partitioner's objective, ``max(S, D) x`` the largest stage cost, does not see the fill and
    drain of the round robin, which dominate with few devices and microbatches.
    """
    from lightning_roundpipe.partition import METHODS, auto_partition, plan_objective_s, stage_memory

    n = len(engine.seq)
    candidates = [auto_partition(profiles, len(engine.backends), engine.stage_memory_bytes, method=m) for m in METHODS]
    if engine._last_call is None:
        return candidates[0]
    for forward_layers in range(1, 5):
        for backward_layers in (1, 2):
            _, bwd = default_stage_ranges(n, forward_layers, backward_layers)
            tail = bwd[0]  # auto_partition's form: the forward stages end with the fused tail's range
            fwd = tuple(range(i, min(i + forward_layers, tail.start)) for i in range(0, tail.start, forward_layers))
            fwd += (tail,)
            budget = engine.stage_memory_bytes
            if budget is None or all(stage_memory(profiles, r, kind) <= budget
                                     for rs, kind in ((fwd, "forward"), (bwd, "backward")) for r in rs):
                uniform = PartitionPlan(fwd, bwd)
                candidates.append(PartitionPlan(fwd, bwd, plan_objective_s(uniform, profiles, len(engine.backends))))
    timed = [(simulated_step_s(engine, c, profiles), i) for i, c in enumerate(candidates)]
    best_s, best = min(timed)
    engine.info(f"RoundPipe: simulated step of {len(timed)} candidate partitions: {best_s * 1e3:.1f} .."
              f" {max(t for t, _ in timed) * 1e3:.1f} ms; chose candidate {best} ({best_s * 1e3:.1f} ms)")
    return candidates[best]

def simulated_step_s(engine: Any, partition: PartitionPlan, profiles: Sequence[LayerProfile]) -> float:
    """Simulated time of one step of the last call's shape (microbatches, fused or not) under ``partition``."""
    from lightning_roundpipe.simulate import simulate_program

    num_microbatches, fused = engine._last_call
    if fused:
        plans = [engine._build_plan(fused_stages(partition), num_microbatches, 0)]
    else:
        plan = engine._build_plan(build_stages(partition.forward_stages, partition.backward_stages), num_microbatches, 0)
        plans = [plan.phase("forward"), plan.phase("backward")]
    hardware = engine.hardware_model()
    return sum(simulate_program(engine._lower(p), profiles, hardware).iteration_s for p in plans)
