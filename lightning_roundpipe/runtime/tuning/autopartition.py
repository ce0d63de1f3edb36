"""The simulator's view of a running engine (DESIGN.md section 6): the automatic partition, where
after the profiled steps the candidate partitions, each with the candidate microbatch rounds, are
timed by the simulator on the measured layer times and the fastest wins; with a fixed partition, the
dispatch rule chosen the same way (:func:`follow_profiles`); and the prediction of the steps the engine runs.

Functions of a :class:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine` (passed in; this module
does not import it); :func:`fused_stages` is also the engine's fused-path stage list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from lightning_roundpipe.partition.profile import LayerProfile
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.runtime.execution.microbatch import split_sizes
from lightning_roundpipe.runtime.tuning.mixed import (_drop_plans, build_plan, compares_rules, describe_speeds,
                                                      device_stage_budgets, set_dispatch_rule)
from lightning_roundpipe.runtime.tuning.optimizer_mode import measured_optimizer_rate, mode_step_s
from lightning_roundpipe.schedule import build_stages, default_stage_ranges
from lightning_roundpipe.schedule.dispatch import DISPATCH_RULES


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
        num_microbatches: microbatches the batch is cut into from now on, when the choice cuts it
            into more than the configured count (:func:`split_options`); ``None``: the configured count.
        dispatch_rule: the rule the plans are built with from now on: ``"round_robin"`` or
            ``"weighted"`` (devices of unequal speed or memory, :mod:`~lightning_roundpipe.runtime.tuning.mixed`).
    """

    partition: PartitionPlan
    microbatches_per_round: int | None
    simulated_s: float | None = None
    num_microbatches: int | None = None
    dispatch_rule: str = "round_robin"


BALANCE_MARGIN = 0.02
"""A finer cut of the batch (:func:`split_options`) is taken only when the simulator times it at
least this much (a fraction of the step) faster than the best plan on the configured microbatches."""

SINGLE_STAGE_MARGIN = 0.10
"""With more than one device, the whole model as one stage (no pipeline: each device runs every layer
of its microbatches) is taken only when the simulator times it at least this much (a fraction of the
step) faster than the best plan of several stages; the choice's line then gives both times. The
margin stands for what the simulator does not see of such a plan: it is timed on per-layer times
profiled on stages of the first plan, and with no stage boundary a device holds the whole model's
weights and every layer's activations of a microbatch at once."""

DISPATCH_MARGIN = 0.03
"""On devices of unequal speed or memory (``dispatch="auto"``), the weighted dispatch is taken only when
the simulator times it at least this much (a fraction of the step) faster than the best round-robin
plan: the round robin is the paper's, and the weighted plan's advantage rests on the measured speeds."""


def split_options(engine: Any, num_microbatches: int, rows: int) -> list[int]:
    """Microbatch counts the automatic choice may cut a batch of ``rows`` rows into: the configured
    ``M`` first and, with ``balance_microbatches`` on, the next multiple of the D devices,
    ``min(rows, ceil(M / D) * D)``, where that is more.

    Why: with the whole model as one stage, or any plan whose last round holds fewer microbatches
    than devices, ``M`` not a multiple of ``D`` leaves devices idle (8 rows in 3 microbatches of
    3, 3, 2 on 2 devices: at best 5 rows on one device, 3 on the other); 4 microbatches of 2 rows give
    each device 4. A finer cut never puts more rows in a microbatch (activation memory per microbatch
    only shrinks), and the loss is normalised by the whole batch, so the gradient is the same up to
    rounding. Not offered with one device, with ``microbatches_per_round`` set by the user, for a
    routing model (its load-balancing statistics are per microbatch) or for a model with random
    layers (dropout masks are drawn per (layer, microbatch): a cut that depends on the device count
    would make a run depend on it).
    """
    devices = len(engine.backends)
    out = [num_microbatches]
    if not engine.balance_microbatches or devices == 1 or no_split_reason(engine) is not None:
        return out
    finer = min(rows, math.ceil(num_microbatches / devices) * devices)
    if finer > num_microbatches:
        out.append(finer)
    return out


def no_split_reason(engine: Any) -> str | None:
    """Why :func:`split_options` offers no finer cut whatever the rows and devices (a phrase for the
    choice's line), or ``None``."""
    from lightning_roundpipe.runtime.replay.rng import rng_layers

    if engine.rounds_pinned:
        return "`microbatches_per_round` is set"
    if engine.seq.routing is not None:
        return "a routing model's load-balancing statistics are per microbatch"
    if rng_layers(engine.seq):
        return "random layers (dropout) draw their masks per microbatch"
    return None


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


def stage_budget(engine: Any) -> int | None:
    """The per-stage memory budget of the automatic choice, bytes: the engine's (``device_memory_bytes``
    // 2, or half a GPU's memory), lowered on GPUs to what the profiled steps measured
    (:meth:`~lightning_roundpipe.runtime.backends.cuda.CudaBackend.measured_stage_budget`, the smallest
    over the devices)."""
    sharing: dict = {}  # logical devices on one GPU split its memory
    for backend in engine.backends:
        sharing[backend.device] = sharing.get(backend.device, 0) + 1
    measured = [backend.measured_stage_budget() for backend in engine.backends]
    measured = [None if m is None else m // sharing[b.device] for m, b in zip(measured, engine.backends)]
    if not measured or any(m is None for m in measured):
        return engine.stage_memory_bytes
    if engine.stage_memory_bytes is None:
        return min(measured)
    return min(engine.stage_memory_bytes, min(measured))


def choose_partition(engine: Any, profiles: Sequence[LayerProfile]) -> PlanChoice:
    """The partition and microbatch rounds to run from now on, chosen by the simulator on the
    measured layer times.

    Candidates: what each of the partitioner's methods proposes (DESIGN.md section 6), the uniform
    asymmetric cuts (forward stages of 1..4 layers, backward stages of 1..2) and the whole model as
    one fused stage (no recomputation at all; with rounds, microbatches go to the devices in turn),
    each only where every stage fits the stage memory budget; the partitions whose stage count is
    a multiple of the devices around the optimal one's (:func:`filling_candidates`); each with
    every option of :func:`round_options`. The simulator times the program each would run (same microbatches, fused
    or not, the same link) and the fastest wins (ties: listed first, so fewer rounds and the
    partitioner's own cut), with two margins: a finer cut of the batch must be
    :data:`BALANCE_MARGIN` faster, and with more than one device a plan of one stage (no pipeline)
    must be :data:`SINGLE_STAGE_MARGIN` faster than the best plan of several stages (the line says
    so with both times either way). On devices of unequal speed or memory with ``dispatch="auto"``
    (:func:`~lightning_roundpipe.runtime.tuning.mixed.compares_rules`) every option is also timed
    with the weighted dispatch (and the partitions that fit the largest device's budget, which only
    it can place), which is taken when :data:`DISPATCH_MARGIN` faster than the best round robin.
    The partitioner's objective, ``max(S, D) x`` the largest stage cost, does not see the fill and
    drain of the round robin, which dominate with few devices and microbatches.
    """
    from lightning_roundpipe.partition import METHODS, auto_partition, plan_objective_s, stage_memory

    n = len(engine.seq)
    budget = stage_budget(engine)
    try:
        candidates = [auto_partition(profiles, len(engine.backends), budget, method=m) for m in METHODS]
    except ValueError:  # a single layer over the per-stage budget (half the device) while the running partition fits
        budget = None  # the device's modelled peak (`fits_memory`) decides which candidates fit
        candidates = [auto_partition(profiles, len(engine.backends), None, method=m) for m in METHODS]
    if engine._last_call is None:
        return PlanChoice(candidates[0], engine.microbatches_per_round)

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
    candidates += filling_candidates(profiles, len(engine.backends), budget, candidates[0])
    both = compares_rules(engine)
    rules = ["round_robin", "weighted"] if both else [getattr(engine, "dispatch_rule", "round_robin")]
    round_robin_fits = len(candidates)  # candidates from here on fit only the larger devices (weighted only)
    largest = max(device_stage_budgets(engine), key=lambda b: math.inf if b is None else b) if both else None
    if both and budget is not None and (largest is None or largest > budget):
        candidates += [auto_partition(profiles, len(engine.backends), largest, method=m) for m in METHODS]
    counts = split_options(engine, engine._last_call[0], sum(engine._last_sizes))
    timed = []
    for count in counts:
        for per_round in round_options(engine, count):
            for i, candidate in enumerate(candidates):
                for rule in rules:
                    if rule == "round_robin" and i >= round_robin_fits:
                        continue
                    if not fits_memory(engine, candidate, count, per_round, rule if both else None):
                        continue
                    try:
                        step_s = simulated_step_s(engine, candidate, profiles, per_round, count,
                                                  **({"dispatch_rule": rule} if both else {}))
                    except ValueError:  # the weighted rule: a stage no device's memory holds
                        continue
                    timed.append((step_s, len(timed), i, per_round, count, rule))
    if not timed:  # no candidate fits the memory model: the first (the check before the step names the device)
        return PlanChoice(candidates[0], engine.microbatches_per_round)
    if both:  # the weighted dispatch only by DISPATCH_MARGIN; the search below runs within the chosen rule
        plain = min((t for t in timed if t[5] == "round_robin"), default=None)  # None: none fits the memory model
        weighted = min((t for t in timed if t[5] == "weighted"), default=None)
        rule = "weighted" if weighted is not None and (plain is None or weighted[0] < (1 - DISPATCH_MARGIN) * plain[0]) \
            else "round_robin"
        gain = 0.0 if weighted is None or plain is None else 1 - weighted[0] / plain[0]
        dispatch_note = (f"; dispatch {rule.replace('_', ' ')} (device speeds {describe_speeds(engine)}): weighted"
                         f" {'n/a' if weighted is None else f'{weighted[0] * 1e3:.1f} ms'} vs round robin"
                         f" {'n/a (no partition fits)' if plain is None else f'{plain[0] * 1e3:.1f} ms'},"
                         f" {100 * gain:.1f}% faster"
                         f"{'' if rule == 'weighted' else f', under the {100 * DISPATCH_MARGIN:.0f}% margin'}")
        timed = [t for t in timed if t[5] == rule]
    else:
        rule, dispatch_note = rules[0], ""

    def fastest(entries: list[tuple]) -> tuple:  # a finer cut only by BALANCE_MARGIN
        best = min(t for t in entries if t[4] == counts[0])
        finer = [t for t in entries if t[4] != counts[0]]
        return min(finer) if finer and min(finer)[0] < (1 - BALANCE_MARGIN) * best[0] else best

    devices = len(engine.backends)
    best = fastest(timed)
    single = ""
    if devices > 1 and one_stage(candidates[best[2]]):
        several = [t for t in timed if not one_stage(candidates[t[2]])]
        if several:
            pipelined = fastest(several)
            gain = 1 - best[0] / pipelined[0]
            other = candidates[pipelined[2]]
            numbers = (f"the whole model as one stage {best[0] * 1e3:.1f} ms vs {pipelined[0] * 1e3:.1f} ms for the"
                       f" best plan of several stages (candidate {pipelined[2]}: {len(other.forward_stages)} forward,"
                       f" {len(other.backward_stages)} backward), {100 * gain:.1f}% faster")
            if gain >= SINGLE_STAGE_MARGIN:
                single = (f"; one stage on {devices} devices (no pipeline, microbatches to the devices in turn:"
                          " each device runs the whole model's forward and backward of its microbatch at once,"
                          " with no recomputation and no stage fill or drain):"
                          f" {numbers}, at least the {100 * SINGLE_STAGE_MARGIN:.0f}% margin required")
            else:
                single = (f"; kept a pipeline: {numbers}, under the {100 * SINGLE_STAGE_MARGIN:.0f}% margin"
                          " one stage needs on several devices")
                best = pipelined
    best_s, _, index, per_round, count, _ = best
    cut = "" if count == counts[0] else f", the batch cut into {count} microbatches instead of {counts[0]}"
    reason = no_split_reason(engine)
    if engine.balance_microbatches and devices > 1 and counts[0] % devices and reason is not None:
        cut += f"; no cut into a multiple of the {devices} devices: {reason}"
    options = sum(len(round_options(engine, count)) for count in counts)
    engine.info(f"RoundPipe: simulated step of {len(candidates)} candidate partitions x"
                f" {options} microbatch options: {min(t[0] for t in timed) * 1e3:.1f} .."
                f" {max(t[0] for t in timed) * 1e3:.1f} ms; chose candidate {index} with"
                f" {describe_rounds(per_round, count)}{cut} (simulated step {best_s * 1e3:.1f} ms){single}{dispatch_note}")
    set_dispatch_rule(engine, rule)
    return PlanChoice(candidates[index], per_round, best_s, None if count == counts[0] else count, rule)


def fits_memory(engine: Any, partition: PartitionPlan, num_microbatches: int, microbatches_per_round: int | None,
                dispatch_rule: str | None = None) -> bool:
    """Whether the memory model's one-bank peak of ``partition``'s plan (the last call's shape, fused or not)
    fits every device's budget (:func:`~lightning_roundpipe.runtime.tuning.device_memory.plans_fit`; the
    check before each program counts the second bank of the overlapped modes and falls back to one). A
    plan the weighted rule cannot build counts as fitting here (the timing refuses it)."""
    from lightning_roundpipe.runtime.tuning.device_memory import plans_fit

    if all(backend.device_budget_bytes() is None for backend in engine.backends):
        return True
    _, fused = engine._last_call
    stages = fused_stages(partition) if fused else build_stages(partition.forward_stages, partition.backward_stages)
    try:
        plan = build_plan(engine, stages, num_microbatches, 0, microbatches_per_round, dispatch_rule)
    except ValueError:
        return True
    return plans_fit(engine, [plan])


def one_stage(partition: PartitionPlan) -> bool:
    """Whether ``partition`` is the whole model as one stage (one forward and one backward stage)."""
    return len(partition.forward_stages) == 1 and len(partition.backward_stages) == 1


def filling_candidates(profiles: Sequence[LayerProfile], num_devices: int, budget: int | None,
                       base: PartitionPlan) -> list[PartitionPlan]:
    """Partitions whose stage count (the fused tail counted) is a multiple of the devices, around
    ``base``'s count (:func:`~lightning_roundpipe.partition.candidates.filling_stage_counts`), each
    the smallest largest stage cost with that count, where one exists (DESIGN.md section 6)."""
    from lightning_roundpipe.partition import filling_stage_counts, partition_with_stage_count, stage_count

    out = []
    for count in filling_stage_counts(stage_count(base), num_devices):
        plan = partition_with_stage_count(profiles, count, budget)
        if plan is not None:
            out.append(plan)
    return out


def describe_rounds(microbatches_per_round: int | None, num_microbatches: int) -> str:
    """``"one round"`` or ``"rounds of P microbatch(es)"``: what a plan of ``num_microbatches`` runs
    (a round size of ``M`` or more is one round)."""
    if microbatches_per_round is None or microbatches_per_round >= num_microbatches:
        return "one round"
    return f"rounds of {microbatches_per_round} microbatch(es)"


def describe_choice(engine: Any, choice: PlanChoice, profiles: Sequence[LayerProfile], measured_steps: int) -> str:
    """The line the engine reports when it switches to ``choice``: the partitioner objective, the
    rounds and the cut of the batch as run, and the stage table."""
    from lightning_roundpipe.partition import describe_stages

    new = choice.partition
    rows = "\n".join(
        f"  stage {s.stage_index:3d} {s.kind:8s} layers {s.layers.start}..{s.layers.stop - 1}"
        f"  cost {s.cost_s * 1e3:9.3f} ms  params {s.param_bytes / 2**20:9.2f} MiB"
        for s in describe_stages(new, profiles, shared_weights=engine.store.shared_weights()))
    count = choice.num_microbatches or (engine._last_call[0] if engine._last_call else 1)
    cut = (f", the batch cut into {choice.num_microbatches} microbatches instead of {engine.num_microbatches}"
           f" (a multiple of the {len(engine.backends)} devices; `balance_microbatches=False` keeps"
           f" {engine.num_microbatches})" if choice.num_microbatches else "")
    return (f"RoundPipe: automatic partition from {measured_steps} measured step(s) (partitioner objective"
            f" max(stages, devices) x largest stage cost per microbatch: {(new.objective_s or 0.0) * 1e3:.3f} ms),"
            f" {describe_rounds(choice.microbatches_per_round, count)}{cut}:\n{rows}")


def simulated_step_s(engine: Any, partition: PartitionPlan, profiles: Sequence[LayerProfile],
                     microbatches_per_round: int | None = None, num_microbatches: int | None = None,
                     dispatch_rule: str | None = None) -> float:
    """Simulated time of one step of the last call's shape (rows, fused or not) under ``partition``
    with ``microbatches_per_round``, seconds; the batch cut into ``num_microbatches`` (``None``: as
    the last call was); the plan built with ``dispatch_rule`` (``None``: the engine's). In the run's
    own optimizer mode, the host's optimizer step included
    (:func:`~lightning_roundpipe.runtime.tuning.optimizer_mode.mode_step_s`).

    Raises:
        ValueError: the weighted rule with a stage that fits no device's memory."""
    from lightning_roundpipe.simulate import simulate_program

    last, fused = engine._last_call
    num_microbatches = last if num_microbatches is None else num_microbatches
    stages = fused_stages(partition) if fused else None
    if fused:
        plans = [build_plan(engine, stages, num_microbatches, 0, microbatches_per_round, dispatch_rule)]
    else:
        plan = build_plan(engine, build_stages(partition.forward_stages, partition.backward_stages), num_microbatches, 0,
                          microbatches_per_round, dispatch_rule)
        plans = [plan.phase("forward"), plan.phase("backward")]
    hardware, weights = engine.hardware_model(), engine.microbatch_weights(num_microbatches)
    drained = sum(simulate_program(engine._lower(p), profiles, hardware, microbatch_weights=weights).iteration_s
                  for p in plans)
    return mode_step_s(engine, drained, stages, profiles, microbatches_per_round, num_microbatches,
                       plans[0]._meta.get("builder", {}).get("dispatch"))


def follow_profiles(engine: Any) -> None:
    """Call between steps. Once the measured profiles arrive (or change): with a fixed partition
    (no automatic choice runs) and ``dispatch="auto"`` on unequal devices, choose the rule here
    (:func:`choose_rule`); under the weighted rule, drop the cached plans, so the next plans balance
    the measured stage costs instead of the layer-count estimate."""
    profiles = engine.measured_profiles
    if profiles is None or getattr(engine, "_dispatch_profiles", None) is profiles:
        return
    engine._dispatch_profiles = profiles
    if engine.auto_partition_after_steps is None and engine._last_call is not None and compares_rules(engine):
        choose_rule(engine, profiles)
    if getattr(engine, "dispatch_rule", "round_robin") == "weighted":
        _drop_plans(engine)


def choose_rule(engine: Any, profiles: Sequence[Any]) -> str:
    """The dispatch rule for the engine's own partition and rounds: both rules timed by the simulator
    on the last call's shape (:func:`simulated_step_s`), the weighted one taken when :data:`DISPATCH_MARGIN`
    faster; reported through ``engine.info`` and set
    (:func:`~lightning_roundpipe.runtime.tuning.mixed.set_dispatch_rule`)."""
    times = {}
    for rule in DISPATCH_RULES:
        try:
            times[rule] = simulated_step_s(engine, engine.partition, profiles, engine.microbatches_per_round,
                                           engine.split_num_microbatches, dispatch_rule=rule)
        except ValueError:  # the weighted rule: a stage no device's memory holds
            continue
    plain, weighted = times.get("round_robin"), times.get("weighted")
    rule = "weighted" if weighted is not None and (plain is None or weighted < (1 - DISPATCH_MARGIN) * plain) else "round_robin"
    shown = {name: "n/a" if value is None else f"{value * 1e3:.1f} ms" for name, value in (("weighted", weighted),
                                                                                          ("round robin", plain))}
    gain = ("" if None in (plain, weighted) else f", {100 * (1 - weighted / plain):.1f}% faster" if weighted <= plain
            else f", {100 * (weighted / plain - 1):.1f}% slower")
    engine.info(f"RoundPipe: dispatch {rule.replace('_', ' ')} for the fixed partition (device speeds"
                f" {describe_speeds(engine)}): simulated step weighted {shown['weighted']} vs round robin"
                f" {shown['round robin']}{gain}" + ("" if rule == "weighted" or weighted is None
                                                   else f", under the {100 * DISPATCH_MARGIN:.0f}% margin"))
    set_dispatch_rule(engine, rule)
    return rule


def hardware_model(engine: Any):
    """The link model the prediction uses: on CUDA the pinned H2D/D2H rates measured once, after the
    engine's overlapped runs are drained (nothing in flight), with every GPU
    copying at once, the slowest GPU's (bytes/s; duplex taken as the H2D rate); on CPU virtual devices the modelled link, or
    ``None`` when copies are unthrottled (transfers then cost nothing in the prediction). It carries
    the host's optimizer rate measured during the profiled steps
    (:func:`~lightning_roundpipe.runtime.tuning.optimizer_mode.measured_optimizer_rate`), when known."""
    from lightning_roundpipe.partition.profile import HardwareModel

    if engine.backends[0].is_cuda:
        from lightning_roundpipe.runtime.backends.cuda import measure_links

        cached = getattr(engine, "_measured_links", None)
        if cached is None:  # measured once, with nothing in flight: copies beside a step's time the step
            engine.drain()
            cached = measure_links(engine.backends)
        h2d, d2h = engine._measured_links = cached
    elif engine.cpu_link_bytes_per_s is not None:
        h2d = d2h = engine.cpu_link_bytes_per_s
    else:
        return None
    return HardwareModel(flops_per_s=1.0, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, h2d_duplex_bytes_per_s=h2d,
                         host_optimizer_bytes_per_s=measured_optimizer_rate(engine))


def microbatch_weights(sizes: Sequence[int], num_microbatches: int,
                       rows_per_microbatch: float | None = None) -> list[float] | None:
    """The simulator's ``microbatch_weights``: the rows of ``sizes`` (a call's microbatches) cut into
    ``num_microbatches`` (as ``sizes`` when of that count), each relative to ``rows_per_microbatch``,
    the profiled steps' mean microbatch (the measured layer times are per microbatch of that size;
    ``None``: the mean of ``sizes``). 8 rows in 3 microbatches, profiled so: ``[1.125, 1.125, 0.75]``;
    cut into 4: ``[0.75] * 4``. ``None`` when every weight is 1 or ``sizes`` is empty."""
    if not sizes:
        return None
    reference = rows_per_microbatch or sum(sizes) / len(sizes)
    if len(sizes) != num_microbatches:
        sizes = split_sizes(sum(sizes), num_microbatches)
    weights = [size / reference for size in sizes]
    return None if all(abs(w - 1.0) < 1e-12 for w in weights) else weights


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
