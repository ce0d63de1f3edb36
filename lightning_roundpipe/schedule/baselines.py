"""Baseline pipeline schedules with weight binding, as :class:`ExecutionPlan` s (for comparison).

Every baseline binds each (virtual) stage to one device for the whole step ("weight binding"):
the layer sequence is cut into ``V`` consecutive *virtual stages* ``stage_layers[0..V-1]`` (the LM
head, the last layer of the sequence, sits in the last one) and virtual stage ``v`` lives on device
``v mod D``. GPipe, 1F1B and ZB-H1 use ``V == D``; interleaved 1F1B and looped BFS use ``V = k * D``
(``k`` chunks per device).

A bound stage runs both the forward and the backward of its layers. In the plan IR, stages are
either forward or backward, so a bound virtual stage ``v`` becomes two :class:`StageSpec` s on the
same device: forward stage ``v`` (kind ``F``) and backward stage ``2V - 1 - v`` (kind ``B``; plan
order lists backward stages last layers first). The plan's existing dependencies then express the
pipeline exactly: ``F(v, m)`` needs ``F(v - 1, m)``, the first backward stage needs the last
forward, and ``B`` of virtual stage ``v`` needs the gradient from virtual stage ``v + 1``. ZB-H1
splits the backward into ``B`` (input gradient, on the critical path) and ``W`` (weight gradient,
which only needs the ``B`` of its own stage and microbatch).

Weights are resident for the whole step: each device's list starts with a ``LOAD`` of all its
stages and ends with their ``DROP`` (the simulator charges nothing for them when the plan's
``_meta["weight_binding"]`` is set). ``_meta["recompute"]`` records whether a ``B`` re-runs its
layers' forward (activation checkpointing; the paper's artifact simulates its baselines that way).

Per-device orders follow ``torch.distributed.pipelining`` (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``) and Qi et al. 2023 (ZB-H1). Pure data: no
torch, no devices.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

from lightning_roundpipe.schedule.ir import Action, ActionKind
from lightning_roundpipe.schedule.plan import ExecutionPlan, StageSpec, tiling_gap

# One planned op of a bound schedule: (kind "F" | "B" | "W", virtual stage, microbatch).
_Op = tuple[str, int, int]

__all__ = [
    "BASELINE_BUILDERS",
    "balanced_stage_layers",
    "bound_stages",
    "build_1f1b_plan",
    "build_baseline_plan",
    "build_gpipe_plan",
    "build_interleaved_1f1b_plan",
    "build_looped_bfs_plan",
    "build_zb_h1_plan",
    "megatron_stage_layers",
    "virtual_stage_of",
]


# ---------------------------------------------------------------------------------------- stages
def bound_stages(stage_layers: Sequence[range]) -> tuple[StageSpec, ...]:
    """Stage specs of a bound schedule: forward stages ``0..V-1``, then backward stages.

    Args:
        stage_layers: ``V`` ascending, consecutive, non-empty ``range`` s of layer indices, one per
            virtual stage, together covering ``0..L-1``.

    Returns:
        ``2V`` specs: forward stage ``v`` covers ``stage_layers[v]``; backward stage ``2V - 1 - v``
        covers the same layers (backward stages in execution order, last layers first).

    Raises:
        ValueError: ``stage_layers`` is empty or does not tile ``0..L-1`` in order.
    """
    ranges = tuple(stage_layers)
    if not ranges:
        raise ValueError("`stage_layers` is empty: a bound schedule needs at least one virtual stage.")
    gap = tiling_gap(ranges)
    if gap is not None:
        raise ValueError(
            f"`stage_layers` must be consecutive non-empty ascending ranges starting at layer 0, got"
            f" {list(ranges)!r} (expected a range starting at {gap[1]}). HINT: use"
            " `balanced_stage_layers(costs, num_stages)`."
        )
    n = len(ranges)
    fwd = [StageSpec(v, "forward", r) for v, r in enumerate(ranges)]
    bwd = [StageSpec(n + j, "backward", ranges[n - 1 - j]) for j in range(n)]
    return tuple(fwd + bwd)


def virtual_stage_of(plan: ExecutionPlan, stage_index: int) -> int:
    """The virtual stage ``v`` a stage of a bound plan belongs to (forward ``v`` or backward ``2V-1-v``)."""
    n = len(plan.stages) // 2
    return stage_index if stage_index < n else 2 * n - 1 - stage_index


def balanced_stage_layers(costs_s: Sequence[float], num_stages: int) -> tuple[range, ...]:
    """Cut a layer sequence into ``num_stages`` consecutive stages with the smallest largest cost.

    Among the partitions with the smallest largest stage cost, the one with the smallest sum of
    squared stage costs (the most even) is returned; remaining ties put the larger stages last (next
    to the LM head), so that the early waves of an interleaved schedule are uniform. Exact (dynamic
    programming), ``O(num_stages x L x layers per stage)``.

    Args:
        costs_s: per-layer cost of one microbatch through a bound stage (forward + backward, plus
            recomputation if the schedule recomputes), seconds; ``>= 0``.
        num_stages: number of stages, ``1 <= num_stages <= len(costs_s)``.

    Returns:
        ``num_stages`` ascending ranges covering ``0..L-1``.

    Raises:
        ValueError: for a negative cost or ``num_stages`` outside ``1..len(costs_s)``.
    """
    costs = [float(c) for c in costs_s]
    n = len(costs)
    if any(c < 0 for c in costs):
        raise ValueError(f"`costs_s` must be >= 0, got {costs!r}.")
    if not isinstance(num_stages, int) or not 1 <= num_stages <= n:
        raise ValueError(
            f"`num_stages` must be an int in 1..{n} (one layer per stage at least), got {num_stages!r}."
            " HINT: use fewer virtual stages per device, or more layers in the layer sequence."
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def seg(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    # Smallest feasible largest-stage cost: binary search over the candidate segment sums.
    def stages_needed(limit: float) -> int:
        count, start = 1, 0
        for i in range(n):
            if seg(start, i + 1) > limit * (1 + 1e-12) + 1e-15:
                count, start = count + 1, i
        return count

    lo = max(costs)
    candidates = sorted({seg(i, j) for i in range(n) for j in range(i + 1, n + 1) if seg(i, j) >= lo})
    a, b = 0, len(candidates) - 1
    while a < b:
        mid = (a + b) // 2
        if stages_needed(candidates[mid]) <= num_stages:
            b = mid
        else:
            a = mid + 1
    limit = candidates[a] * (1 + 1e-12) + 1e-15
    inf = float("inf")
    # best[k][i]: least sum of squares for the first i layers in k stages (each stage <= limit).
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(i - 1, k - 2, -1):
                c = seg(j, i)
                if c > limit:
                    break
                if best[k - 1][j] == inf:
                    continue
                v = best[k - 1][j] + c * c
                # `j` descends, so on a tie the later candidate has the larger last stage: keep it.
                if v <= best[k][i] + 1e-12 * max(1.0, abs(v)):
                    best[k][i], cut[k][i] = v, j
    out: list[range] = []
    i = n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        out.append(range(j, i))
        i = j
    return tuple(reversed(out))


def megatron_stage_layers(costs_s: Sequence[float], num_stages: int) -> tuple[range, ...]:
    """Megatron-LM's layout of a layer sequence ``[embedding, L decoder layers, LM head]``.

    When the ``L = len(costs_s) - 2`` decoder layers divide evenly, every stage gets ``L /
    num_stages`` of them, the embedding joins the first stage and the LM head the last (Megatron's
    default; the head's extra cost is not balanced). Otherwise a custom layout is needed, and the
    balanced one of :func:`balanced_stage_layers` is used.

    Args:
        costs_s: per-entry cost of one microbatch, seconds; entry 0 is the embedding, the last one the
            LM head.
        num_stages: number of (virtual) stages.

    Returns:
        ``num_stages`` ascending ranges covering ``0..len(costs_s)-1``.

    Raises:
        ValueError: as :func:`balanced_stage_layers`.
    """
    n = len(costs_s)
    decoder = n - 2
    if isinstance(num_stages, int) and num_stages >= 1 and decoder >= num_stages and decoder % num_stages == 0:
        per = decoder // num_stages
        bounds = [0] + [1 + per * v for v in range(1, num_stages)] + [n]
        return tuple(range(a, b) for a, b in zip(bounds, bounds[1:]))
    return balanced_stage_layers(costs_s, num_stages)


# ---------------------------------------------------------------------------------------- orders
def _check_args(num_devices: int, num_microbatches: int, num_virtual: int, per_device: int | None) -> int:
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"`num_devices` must be a positive int, got {num_devices!r}.")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"`num_microbatches` must be a positive int, got {num_microbatches!r}.")
    if per_device is not None and num_virtual != per_device * num_devices:
        raise ValueError(
            f"This schedule needs exactly {per_device * num_devices} stages for {num_devices} devices,"
            f" got {num_virtual} in `stage_layers`. HINT: one stage per device"
            " (`balanced_stage_layers(costs, num_devices)`)."
        )
    if num_virtual % num_devices != 0:
        raise ValueError(
            f"`stage_layers` has {num_virtual} stages, not a multiple of `num_devices`={num_devices}."
            " HINT: interleaved 1F1B and looped BFS put the same number of chunks on every device."
        )
    return num_virtual // num_devices


def _gpipe_ops(rank: int, num_devices: int, num_microbatches: int, chunks: int) -> list[_Op]:
    return [("F", rank, m) for m in range(num_microbatches)] + [("B", rank, m) for m in range(num_microbatches)]


def _1f1b_ops(rank: int, num_devices: int, num_microbatches: int, chunks: int) -> list[_Op]:
    warmup = min(num_microbatches, num_devices - 1 - rank)
    ops: list[_Op] = [("F", rank, m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        ops += [("F", rank, warmup + i), ("B", rank, i)]
    ops += [("B", rank, m) for m in range(num_microbatches - warmup, num_microbatches)]
    return ops


def _zb_h1_ops(rank: int, num_devices: int, num_microbatches: int, chunks: int) -> list[_Op]:
    # 1F1B order of F and B (input gradient); the W (weight gradient) of microbatch m follows
    # B(m + rank): later stages defer their W passes so that B, the critical path, reaches the
    # earlier stages sooner, and the deferred W passes fill the cooldown. Peak in-flight microbatches
    # stay at D as in 1F1B; with F = B = W the bubble is (D - 1) x (F + B - W), a third of 1F1B's
    # (ZB-H1, Qi et al. 2023, section 3).
    lag = min(rank, num_microbatches)
    ops: list[_Op] = []
    next_w = 0
    for kind, v, m in _1f1b_ops(rank, num_devices, num_microbatches, chunks):
        ops.append((kind, v, m))
        if kind == "B" and m - lag >= 0:
            ops.append(("W", v, m - lag))
            next_w = m - lag + 1
    ops += [("W", rank, m) for m in range(next_w, num_microbatches)]
    return ops


def _looped_bfs_ops(rank: int, num_devices: int, num_microbatches: int, chunks: int) -> list[_Op]:
    stages = [c * num_devices + rank for c in range(chunks)]
    ops: list[_Op] = [("F", v, m) for v in stages for m in range(num_microbatches)]
    ops += [("B", v, m) for v in reversed(stages) for m in reversed(range(num_microbatches))]
    return ops


def _interleaved_ops(rank: int, num_devices: int, num_microbatches: int, chunks: int) -> list[_Op]:
    # torch.distributed.pipelining.ScheduleInterleaved1F1B: microbatches go in rounds of
    # `per_round`; warmup forwards fill the pipeline, then one forward and one backward alternate.
    rounds = max(1, num_microbatches // num_devices)
    per_round = num_microbatches // rounds
    total = chunks * num_microbatches
    warmup = min((chunks - 1) * per_round + 2 * (num_devices - 1 - rank), total)
    fwd_mb: dict[int, int] = defaultdict(int)
    bwd_mb: dict[int, int] = defaultdict(int)

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % chunks) * num_devices + rank

    def bwd_stage(step: int) -> int:
        return (chunks - 1 - ((step - warmup) // per_round) % chunks) * num_devices + rank

    ops: list[_Op] = []
    for step in range(total + warmup):
        if step < total:
            v = fwd_stage(step)
            ops.append(("F", v, fwd_mb[v]))
            fwd_mb[v] += 1
        if step >= warmup:
            v = bwd_stage(step)
            ops.append(("B", v, bwd_mb[v]))
            bwd_mb[v] += 1
    return ops


def _check_interleaved_microbatches(num_devices: int, num_microbatches: int) -> None:
    rounds = max(1, num_microbatches // num_devices)
    if num_microbatches % rounds != 0:
        raise ValueError(
            f"Interleaved 1F1B runs microbatches in {rounds} equal rounds, but `num_microbatches`="
            f"{num_microbatches} is not a multiple of {rounds}. HINT: use a multiple of `num_devices`"
            f"={num_devices}, or fewer than {2 * num_devices} microbatches."
        )


# ---------------------------------------------------------------------------------------- builders
def _build(
    name: str,
    order: Callable[[int, int, int, int], list[_Op]],
    stage_layers: Sequence[range],
    num_devices: int,
    num_microbatches: int,
    per_device: int | None,
    recompute: bool,
) -> ExecutionPlan:
    stages = bound_stages(stage_layers)
    n = len(stages) // 2
    chunks = _check_args(num_devices, num_microbatches, n, per_device)
    kind_of = {"F": ActionKind.F, "B": ActionKind.B, "W": ActionKind.W}
    actions: list[tuple[Action, ...]] = []
    for rank in range(num_devices):
        mine = [c * num_devices + rank for c in range(chunks)]
        held = mine + [2 * n - 1 - v for v in reversed(mine)]
        acts = [Action(s, ActionKind.LOAD) for s in held]
        for kind, v, m in order(rank, num_devices, num_microbatches, chunks):
            acts.append(Action(v if kind == "F" else 2 * n - 1 - v, kind_of[kind], m))
        acts += [Action(s, ActionKind.DROP) for s in held]
        actions.append(tuple(acts))
    plan = ExecutionPlan(stages, tuple(actions), num_microbatches, max_resident_stages=2 * chunks)
    plan._meta.update(
        schedule=name, weight_binding=True, recompute=bool(recompute), stage_layers=tuple(stage_layers)
    )
    return plan.validate()


_DOC_ARGS = """
    Args:
        stage_layers: the virtual stages' layer ranges (ascending, tiling the layer sequence; the
            LM head, the sequence's last layer, in the last one). Virtual stage ``v`` runs on device
            ``v mod num_devices``.
        num_devices: devices ``D`` (>= 1).
        num_microbatches: microbatches ``M`` per step (>= 1).
        recompute: whether a ``B`` re-runs its layers' forward first (activation checkpointing);
            stored in ``plan._meta["recompute"]`` for the simulator.

    Returns:
        A validated :class:`ExecutionPlan` with weight binding.

    Raises:
        ValueError: for a bad stage count, ``num_devices`` or ``num_microbatches``.
"""


def build_gpipe_plan(
    stage_layers: Sequence[range], num_devices: int, num_microbatches: int, *, recompute: bool = False
) -> ExecutionPlan:
    """GPipe (Huang et al. 2019): every device runs all forwards, then all backwards; ``V == D``."""
    return _build("gpipe", _gpipe_ops, stage_layers, num_devices, num_microbatches, 1, recompute)


def build_1f1b_plan(
    stage_layers: Sequence[range], num_devices: int, num_microbatches: int, *, recompute: bool = False
) -> ExecutionPlan:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): ``D - 1 - rank`` warmup forwards, then one
    forward and one backward alternate; ``V == D``."""
    return _build("1f1b", _1f1b_ops, stage_layers, num_devices, num_microbatches, 1, recompute)


def build_zb_h1_plan(
    stage_layers: Sequence[range], num_devices: int, num_microbatches: int, *, recompute: bool = False
) -> ExecutionPlan:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split into
    ``B`` (input gradient) and ``W`` (weight gradient); on device ``rank`` the ``W`` of microbatch
    ``m`` follows ``B(m + rank)``, so the deferred ``W`` passes fill the cooldown bubbles; ``V == D``."""
    return _build("zb_h1", _zb_h1_ops, stage_layers, num_devices, num_microbatches, 1, recompute)


def build_looped_bfs_plan(
    stage_layers: Sequence[range], num_devices: int, num_microbatches: int, *, recompute: bool = False
) -> ExecutionPlan:
    """Looped BFS (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism"): each device runs every
    microbatch through one of its chunks before the next chunk, forwards ascending, then backwards
    (chunks and microbatches in reverse); ``V = k x D``."""
    return _build("looped_bfs", _looped_bfs_ops, stage_layers, num_devices, num_microbatches, None, recompute)


def build_interleaved_1f1b_plan(
    stage_layers: Sequence[range], num_devices: int, num_microbatches: int, *, recompute: bool = False
) -> ExecutionPlan:
    """Interleaved 1F1B (Megatron-LM virtual pipeline, Narayanan et al. 2021), in the order of
    ``torch.distributed.pipelining.ScheduleInterleaved1F1B``; ``V = k x D``; microbatches run in
    ``max(1, M // D)`` equal rounds (``M`` must be a multiple of the round count)."""
    _check_interleaved_microbatches(num_devices, num_microbatches)
    return _build("interleaved_1f1b", _interleaved_ops, stage_layers, num_devices, num_microbatches, None, recompute)


for _f in (build_gpipe_plan, build_1f1b_plan, build_zb_h1_plan, build_looped_bfs_plan, build_interleaved_1f1b_plan):
    _f.__doc__ = (_f.__doc__ or "") + "\n" + _DOC_ARGS

#: Baseline name (as in the paper's table) -> builder ``(stage_layers, D, M, *, recompute)``.
BASELINE_BUILDERS: dict[str, Callable[..., ExecutionPlan]] = {
    "gpipe": build_gpipe_plan,
    "1f1b": build_1f1b_plan,
    "interleaved_1f1b": build_interleaved_1f1b_plan,
    "looped_bfs": build_looped_bfs_plan,
    "zb_h1": build_zb_h1_plan,
}

#: Baselines that put several chunks (virtual stages) on every device.
MULTI_CHUNK_BASELINES = frozenset({"interleaved_1f1b", "looped_bfs"})


def build_baseline_plan(
    name: str, stage_layers: Sequence[range], num_devices: int, num_microbatches: int, *, recompute: bool = False
) -> ExecutionPlan:
    """Build the baseline called ``name`` (a key of :data:`BASELINE_BUILDERS`).

    Raises:
        ValueError: for an unknown ``name`` (listing the known ones), or from the builder.
    """
    try:
        builder = BASELINE_BUILDERS[name]
    except KeyError:
        raise ValueError(f"Unknown baseline `{name}`; expected one of {sorted(BASELINE_BUILDERS)}.") from None
    return builder(stage_layers, num_devices, num_microbatches, recompute=recompute)
