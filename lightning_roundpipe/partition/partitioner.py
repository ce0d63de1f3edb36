"""The automatic partitioner (paper section 4.4, "automated layer partitioning"; DESIGN.md section 6).

Problem. The layer sequence ``0..L-1`` is cut twice: into *forward stages* and into *backward
stages*. The last layers plus the loss form the **fused tail**, the first backward stage: it runs
forward, loss and backward of its layers in one stage and is never recomputed. Per microbatch:

- a forward stage over layers ``[s, t)`` costs ``sum(forward_s)``;
- a backward stage costs ``sum(forward_s + backward_s)`` (full recomputation, then backward);
- the fused tail costs the same sum (one forward, no recomputation, one backward).

RoundPipe's round robin runs every stage once per step on some device, forward stages then the
tail then the backward stages, so the number of stages is ``S = F + B``: the forward stages *other
than the tail* (``F``) plus the backward stages *including the tail* (``B``). With ``D`` devices and
largest stage cost ``W`` the steady-state step time per microbatch is about ``max(S, D) * W / D``,
hence the objective (seconds per microbatch x devices)::

    objective_s = max(S, D) * W

subject to every stage fitting the per-stage memory budget (half the device memory, since the next
stage's weights are prefetched while the current one computes).

Memory of a stage for one microbatch (bytes), with ``out(i)`` = the input of layer ``i + 1``
(0 after the last layer):

- forward stage: ``sum(param_bytes) + max_i(activation_bytes[i] + out(i))`` (no autograd state);
- backward stage and fused tail: ``sum(param_bytes) + sum(grad_bytes) + max(sum(saved[i])
  + max_i(activation_bytes[i] + out(i)), max_i(grad_bytes[i]))``, where ``saved[i]`` is what autograd keeps inside layer
  ``i`` during the recompute (``saved_activation_bytes``; defaults to ``activation_bytes[i]``, a lower
  bound; the cost model gives the full figure), the gradients accumulate on the device until the
  stage's weights are dropped; ``max_i(grad_bytes[i])`` is the fresh gradient of one layer that autograd
  holds before adding it into the accumulated one (the second microbatch on), measured on CPU
  virtual devices to come after the layer's activations are freed (an embedding's or LM head's
  weight gradient), hence the ``max``.

Both are monotone: a stage that grows never needs less, so greedy packing is count-optimal.

Methods. ``"optimal"`` is the exact minimum of the objective (every contiguous stage sum as a
candidate ``W``, a min-count dynamic program per candidate, any tail length). ``"paper"`` is the
paper's search (section 4.4): candidate ``W`` from the heaviest single layer cost up to
:data:`PAPER_UPPER_THRESHOLD` times it, the tail grown from the last layer while it fits ``W``, the
fewest forward and backward stages within ``W`` (greedy packing), and then each direction **re-cut
to the most even split with the same stage count** (:func:`balanced_stage_layers`: the smallest
largest stage cost, then the smallest sum of squares). The re-cut matters because greedy packing
fills every stage to ``W`` and leaves the remainder in the first stage, which is then light and the
others heavy: the round robin's fill (and drain) takes about ``D - 1`` stage costs, so uneven stages
lengthen it while the even split keeps every stage near the mean. A candidate is scored by its
re-cut stages, ``max(S, D) x`` their largest cost (ties: fewer stages, then the smaller ``W``). With
a memory budget, a direction whose even re-cut puts a stage over the budget keeps its packed cut
(which fits by construction). Without one, ``"paper"`` gives the partition of the paper's bubble
simulation (:func:`lightning_roundpipe.simulate.table.build_schedule_plan`).

Result. A :class:`PartitionPlan` whose ``backward_stages[0]`` is the fused tail and whose
``forward_stages[-1]`` is **the same range** (the tail is the last stage to run forward), so that
both directions tile ``0..L-1`` exactly once; :func:`schedule_ranges` gives the ranges for
``build_stages(..., fused_tail=True)`` (forward stages without the tail).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from lightning_roundpipe.partition.profile import LayerProfile, SharedWeight
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.partition.units import format_bytes
from lightning_roundpipe.schedule.baselines import balanced_stage_layers

#: Valid values of ``auto_partition(method=...)``.
METHODS = ("optimal", "paper")
#: Paper's search range of stage budgets: heaviest single layer cost up to this factor times it.
PAPER_UPPER_THRESHOLD = 1.1
_REL_TOL = 1e-9
_CHUNK = 2048  # candidates evaluated at once (bounds the DP table to (L + 1) x _CHUNK)

StageKind = Literal["forward", "fused", "backward"]


@dataclass(frozen=True, kw_only=True)
class StageSummary:
    """One stage of a partition, for tables and memory checks."""

    stage_index: int
    """Position in round-robin order: forward stages, then the fused tail, then backward stages."""
    kind: StageKind
    """``forward``, ``fused`` (the tail) or ``backward``."""
    layers: range
    """Layers of the stage (ascending)."""
    cost_s: float
    """Compute seconds per microbatch (forward; or recompute + backward; or the tail's forward + backward)."""
    param_bytes: int
    """Weights uploaded for the stage, bytes."""
    grad_bytes: int
    """Gradients sent back after the stage, bytes (0 for forward stages)."""
    memory_bytes: int
    """Device memory of the stage for one microbatch, bytes (see the module docstring)."""


class _Tables:
    """Prefix sums and range maxima over the profiles (shared by both methods)."""

    def __init__(self, profiles: Sequence[LayerProfile], saved: Sequence[int] | None) -> None:
        L = len(profiles)
        self.L = L
        self.f = np.array([p.forward_s for p in profiles], dtype=np.float64)
        self.b = np.array([p.forward_s + p.backward_s for p in profiles], dtype=np.float64)
        self.Pf = np.concatenate([[0.0], np.cumsum(self.f)])
        self.Pb = np.concatenate([[0.0], np.cumsum(self.b)])
        self.param = [int(p.param_bytes) for p in profiles]
        self.grad = [int(p.grad_bytes) for p in profiles]
        self.saved = [int(x) for x in (saved if saved is not None else [p.activation_bytes for p in profiles])]
        act = [int(p.activation_bytes) for p in profiles]
        self.io = [act[i] + (act[i + 1] if i + 1 < L else 0) for i in range(L)]
        self.Pparam = _cumsum_int(self.param)
        self.Pweights = _cumsum_int([self.param[i] + self.grad[i] for i in range(L)])
        self.Psaved = _cumsum_int(self.saved)

    def mem(self, s: int, t: int, backward: bool) -> int:
        """Memory of a stage over ``[s, t)``, bytes."""
        io = max(self.io[s:t])
        if backward:  # activations, or one layer's fresh gradient before autograd adds it into the accumulated one
            return self.Pweights[t] - self.Pweights[s] + max(self.Psaved[t] - self.Psaved[s] + io, max(self.grad[s:t]))
        return self.Pparam[t] - self.Pparam[s] + io

    def cost(self, s: int, t: int, backward: bool) -> float:
        P = self.Pb if backward else self.Pf
        return float(P[t] - P[s])


def _cumsum_int(xs: Sequence[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def stage_memory(
    profiles: Sequence[LayerProfile],
    layers: range,
    kind: StageKind,
    saved_activation_bytes: Sequence[int] | None = None,
) -> int:
    """Device memory of one stage for one microbatch, bytes (the model in the module docstring).

    Args:
        profiles: the layer sequence.
        layers: the stage's layers.
        kind: ``forward``, or ``backward`` / ``fused`` (same memory model).
        saved_activation_bytes: per layer, bytes autograd keeps inside it during recomputation.
    """
    return _Tables(profiles, saved_activation_bytes).mem(layers.start, layers.stop, kind != "forward")


def min_stage_memory_bytes(profiles: Sequence[LayerProfile], saved_activation_bytes: Sequence[int] | None = None) -> int:
    """The smallest per-stage budget that admits a partition: the largest memory of a single layer in
    a backward stage, bytes (a one-layer forward stage never needs more)."""
    tab = _Tables(list(profiles), saved_activation_bytes)
    return max(tab.mem(i, i + 1, backward=True) for i in range(tab.L))


def stage_cost_s(profiles: Sequence[LayerProfile], layers: range, kind: StageKind) -> float:
    """Compute seconds of one stage for one microbatch (forward: sum of ``forward_s``; backward and
    fused tail: sum of ``forward_s + backward_s``)."""
    if kind == "forward":
        return sum(profiles[i].forward_s for i in layers)
    return sum(profiles[i].recompute_backward_s for i in layers)


def auto_partition(
    profiles: Sequence[LayerProfile],
    num_devices: int,
    stage_memory_bytes: int | None = None,
    method: str = "optimal",
    *,
    saved_activation_bytes: Sequence[int] | None = None,
) -> PartitionPlan:
    """Cut the layer sequence into forward stages, a fused tail and backward stages.

    Minimises ``max(S, D) * W`` (``S`` stages, ``D = num_devices``, ``W`` the largest stage cost;
    see the module docstring) with every stage within ``stage_memory_bytes``.

    Args:
        profiles: one :class:`LayerProfile` per layer of the layer sequence (``L >= 1``).
        num_devices: devices ``D`` of the round robin (>= 1).
        stage_memory_bytes: per-stage memory budget, bytes: half of a device's memory (the next
            stage is prefetched); ``None`` for no limit.
        method: ``"optimal"``, the exact minimum (every contiguous stage sum as a candidate ``W``,
            a min-count dynamic program per candidate, any tail length); or ``"paper"``, the paper's
            search (paper section 4.4: candidate ``W`` between the heaviest layer cost and 1.1x it,
            tail grown from the last layer while it fits, the fewest stages by greedy packing, then
            each direction re-cut to the most even split with that stage count unless the re-cut
            breaks the memory budget; objective ``max(S, D) x`` the largest re-cut stage cost). See
            the module docstring. ``"optimal"`` is never worse than ``"paper"``.
        saved_activation_bytes: per layer, bytes autograd keeps inside it in a backward stage
            (``ModelledProfiles.saved_activation_bytes``); defaults to each layer's ``activation_bytes``.

    Returns:
        A validated :class:`PartitionPlan`; ``objective_s`` is ``max(S, D) x`` the largest stage cost
        of the returned plan, seconds.

    Raises:
        ValueError: an unknown ``method`` (the valid ones are listed), an empty ``profiles``, a bad
            ``num_devices`` / ``stage_memory_bytes``, or a single layer over the memory budget (the
            layer and the numbers are named).
    """
    if method not in METHODS:
        raise ValueError(f"Unknown partition `method` {method!r}; valid options: {list(METHODS)}.")
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
        raise ValueError(f"`num_devices` must be a positive int, got {num_devices!r}.")
    profiles = list(profiles)
    if not profiles:
        raise ValueError("`profiles` is empty: the partitioner needs at least one layer.")
    if saved_activation_bytes is not None and len(saved_activation_bytes) != len(profiles):
        raise ValueError(
            f"`saved_activation_bytes` has {len(saved_activation_bytes)} entries but there are {len(profiles)} layers."
        )
    if stage_memory_bytes is not None and not stage_memory_bytes > 0:
        raise ValueError(
            f"`stage_memory_bytes` must be > 0 or None, got {stage_memory_bytes!r}."
            " HINT: pass half the device memory in bytes, e.g. 12 * 2**30 for a 24 GiB GPU."
        )
    budget = math.inf if stage_memory_bytes is None else stage_memory_bytes
    tab = _Tables(profiles, saved_activation_bytes)
    _check_single_layers(tab, profiles, budget)

    L, D = tab.L, num_devices
    heaviest = float(tab.b.max())
    if method == "paper":
        fwd, bwd, t = _paper_search(tab, D, budget, heaviest)
    else:
        cands = _contiguous_sums(tab, lo=heaviest, hi=math.inf)
        n_stages, tail_start, _ = _stage_counts(tab, cands, budget, maximal_tail=False)
        obj = np.maximum(n_stages, D) * cands
        best = float(obj.min())
        # ties: fewer stages (fewer uploads), then the smaller budget
        tie = np.flatnonzero(obj <= best * (1 + _REL_TOL))
        k = int(tie[np.lexsort((cands[tie], n_stages[tie]))[0]])
        W, t = float(cands[k]), int(tail_start[k])
        fwd = _pack(tab, 0, t, W, budget, backward=False)
        bwd = _pack(tab, 0, t, W, budget, backward=True)
    tail = range(t, L)
    largest = max([tab.cost(r.start, r.stop, False) for r in fwd] + [tab.cost(r.start, r.stop, True) for r in bwd + [tail]])
    S = len(fwd) + len(bwd) + 1
    plan = PartitionPlan(
        forward_stages=tuple(fwd) + (tail,),
        backward_stages=(tail,) + tuple(reversed(bwd)),
        objective_s=max(S, D) * largest,
    )
    return plan.validate(L)


def _check_single_layers(tab: _Tables, profiles: Sequence[LayerProfile], budget: float) -> None:
    if budget == math.inf:
        return
    for i in range(tab.L):
        need = tab.mem(i, i + 1, backward=True)  # every layer sits in a backward stage (or the tail)
        if need > budget:
            size = format_bytes
            raise ValueError(
                f"Layer {i} (`{profiles[i].name or i}`) alone needs {size(need, exact=True)} in a backward stage"
                f" (weights {size(tab.param[i])} + gradients {size(tab.grad[i])} + the larger of saved"
                f" activations {size(tab.saved[i])} + input/output {size(tab.io[i])} and one fresh"
                f" gradient {size(tab.grad[i])}), over the per-stage memory"
                f" budget `stage_memory_bytes` = {size(budget, exact=True)} (half the device memory: the next stage is"
                " prefetched). HINT: lower the microbatch size or the sequence length, train LoRA adapters only,"
                " or use devices with more memory."
            )


def _contiguous_sums(tab: _Tables, lo: float, hi: float) -> np.ndarray:
    """Distinct sums of contiguous runs of forward and of backward costs within ``[lo, hi]``, ascending."""
    vals = []
    for P in (tab.Pf, tab.Pb):
        diff = P[None, :] - P[:, None]  # diff[s, t] = sum over [s, t)
        iu = np.triu_indices(len(P), k=1)
        v = diff[iu]
        vals.append(v[(v >= lo * (1 - _REL_TOL)) & (v <= hi * (1 + _REL_TOL))])
    out = np.unique(np.concatenate(vals + [np.array([lo])]))
    return out[out >= lo * (1 - _REL_TOL)]


def _mem_reach(tab: _Tables, budget: float, backward: bool) -> np.ndarray:
    """``lo[t]``: the smallest ``s`` with ``[s, t)`` within the memory budget (``lo[0] = 0``)."""
    lo = np.zeros(tab.L + 1, dtype=np.int64)
    s = 0
    for t in range(1, tab.L + 1):
        while s < t - 1 and tab.mem(s, t, backward) > budget:
            s += 1
        lo[t] = s
    return lo


def _min_counts(tab: _Tables, W: np.ndarray, budget: float, backward: bool) -> np.ndarray:
    """``g[t, c]``: fewest stages covering ``[0, t)`` with cost <= ``W[c]`` and memory within the budget."""
    P = tab.Pb if backward else tab.Pf
    mem_lo = _mem_reach(tab, budget, backward)
    C = len(W)
    g = np.zeros((tab.L + 1, C), dtype=np.int64)
    cols = np.arange(C)
    Wt = W * (1 + _REL_TOL)
    for t in range(1, tab.L + 1):
        # smallest s with P[t] - P[s] <= W (P ascending)
        s_cost = np.searchsorted(P[: t + 1], P[t] - Wt, side="left")
        s = np.maximum(np.minimum(s_cost, t - 1), mem_lo[t])
        g[t] = 1 + g[s, cols]
    return g


def _stage_counts(
    tab: _Tables, W: np.ndarray, budget: float, maximal_tail: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate ``W``: the stages ``S``, the tail start used and the forward stages among ``S``
    (the others are the tail and the backward stages). The tail is the paper's maximal one (grown
    from the last layer while it fits) or the one giving the fewest stages (ties: the longest)."""
    S = np.empty(len(W), dtype=np.int64)
    tail = np.empty(len(W), dtype=np.int64)
    forward = np.empty(len(W), dtype=np.int64)
    for lo in range(0, len(W), _CHUNK):
        part = slice(lo, lo + _CHUNK)
        S[part], tail[part], forward[part] = _stage_counts_chunk(tab, W[part], budget, maximal_tail)
    return S, tail, forward


def _stage_counts_chunk(
    tab: _Tables, W: np.ndarray, budget: float, maximal_tail: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    L = tab.L
    gF = _min_counts(tab, W, budget, backward=False)
    gB = _min_counts(tab, W, budget, backward=True)
    Wt = W * (1 + _REL_TOL)
    best = np.full(len(W), np.iinfo(np.int64).max, dtype=np.int64)
    tail = np.full(len(W), L - 1, dtype=np.int64)
    forward = np.zeros(len(W), dtype=np.int64)
    for t in range(L - 1, -1, -1):  # tail [t, L), growing; fits for a prefix of this loop
        ok = (tab.Pb[L] - tab.Pb[t] <= Wt) & (tab.mem(t, L, True) <= budget)
        if not ok.any():
            break
        total = 1 + gF[t] + gB[t]
        better = ok if maximal_tail else ok & (total <= best)
        best = np.where(better, total, best)
        tail = np.where(better, t, tail)
        forward = np.where(better, gF[t], forward)
    return best, tail, forward


def _paper_search(
    tab: _Tables, num_devices: int, budget: float, heaviest: float
) -> tuple[list[range], list[range], int]:
    """The paper's search (paper section 4.4) with the even re-cut; see the module docstring.

    Every candidate ``W`` in ``[heaviest, PAPER_UPPER_THRESHOLD x heaviest]`` (seconds) fixes a
    maximal tail and the fewest forward and backward stages; candidates with the same shape (tail
    start and stage counts) re-cut alike, so each shape is scored once, at its smallest ``W``.

    Returns:
        ``(forward, backward, tail_start)``: the ascending forward and backward stages of layers
        ``[0, tail_start)``; the tail is ``[tail_start, L)``.
    """
    cands = _contiguous_sums(tab, lo=heaviest, hi=heaviest * PAPER_UPPER_THRESHOLD)
    n_stages, tail_start, n_forward = _stage_counts(tab, cands, budget, maximal_tail=True)
    best: tuple[float, int, float] | None = None
    chosen: tuple[list[range], list[range], int] = ([], [], tab.L - 1)
    seen: set[tuple[int, int, int]] = set()
    for k in range(len(cands)):  # ascending W: ties keep the smaller budget
        shape = (int(tail_start[k]), int(n_forward[k]), int(n_stages[k]))
        if shape in seen:
            continue
        seen.add(shape)
        start, forward_count, stage_count = shape
        budget_s = float(cands[k])
        fwd = _even_cut(tab, start, forward_count, budget_s, budget, backward=False)
        bwd = _even_cut(tab, start, stage_count - 1 - forward_count, budget_s, budget, backward=True)
        largest = max(
            [tab.cost(start, tab.L, True)]
            + [tab.cost(r.start, r.stop, False) for r in fwd]
            + [tab.cost(r.start, r.stop, True) for r in bwd]
        )
        key = (max(stage_count, num_devices) * largest, stage_count, largest)
        if best is None or _key_less(key, best):
            best, chosen = key, (fwd, bwd, start)
    return chosen


def _key_less(key: tuple[float, int, float], other: tuple[float, int, float]) -> bool:
    """``(objective_s, stages, largest_s)`` lexicographically smaller, seconds compared within ``_REL_TOL``."""
    for mine, theirs in zip(key, other):
        if abs(mine - theirs) > _REL_TOL * max(abs(mine), abs(theirs)):
            return mine < theirs
    return False


def _even_cut(tab: _Tables, stop: int, count: int, W: float, budget: float, backward: bool) -> list[range]:
    """Layers ``[0, stop)`` in ``count`` stages (the fewest within ``W``), re-cut as evenly as possible
    (:func:`balanced_stage_layers`: its largest stage cost is ``<= W``); the greedy packing within
    ``W`` if a re-cut stage exceeds the memory budget. Returns ascending ranges."""
    return _cut_exactly(tab, stop, count, W, budget, backward)  # the same cut at the fewest count


def _cut_exactly(tab: _Tables, stop: int, count: int, W: float, budget: float, backward: bool) -> list[range]:
    """Layers ``[0, stop)`` in exactly ``count`` stages (``count`` at least the fewest within ``W``):
    the most even cut, or, where it breaks the memory budget, the packed cut with its largest stages
    halved until there are ``count``. Ascending ranges."""
    if count == 0:
        return []
    costs = (tab.b if backward else tab.f)[:stop].tolist()
    even = list(balanced_stage_layers(costs, count))
    if all(tab.mem(r.start, r.stop, backward) <= budget for r in even):
        return even
    cut = _pack(tab, 0, stop, W, budget, backward)
    while len(cut) < count:
        i = max((k for k in range(len(cut)) if len(cut[k]) > 1), key=lambda k: tab.cost(cut[k].start, cut[k].stop, backward))
        r = cut[i]
        split = balanced_stage_layers(costs[r.start:r.stop], 2)
        cut[i:i + 1] = [range(r.start + x.start, r.start + x.stop) for x in split]
    return cut


def _pack(tab: _Tables, start: int, stop: int, W: float, budget: float, backward: bool) -> list[range]:
    """Greedy packing of ``[start, stop)`` from the end: each stage grows towards layer ``start`` while
    its cost stays within ``W`` and its memory within the budget. Returns ascending ranges."""
    out: list[range] = []
    Wt = W * (1 + _REL_TOL)
    t = stop
    while t > start:
        s = t - 1
        while s > start and tab.cost(s - 1, t, backward) <= Wt and tab.mem(s - 1, t, backward) <= budget:
            s -= 1
        out.append(range(s, t))
        t = s
    return out[::-1]


# ---------------------------------------------------------------------- helpers for consumers
def schedule_ranges(plan: PartitionPlan) -> tuple[tuple[range, ...], tuple[range, ...]]:
    """Ranges for ``build_stages(forward, backward, fused_tail=True)``: the forward stages without the
    fused tail (which runs as the first backward stage), and the backward stages, tail first.

    Raises:
        ValueError: ``plan`` does not end its forward stages with its tail (not from :func:`auto_partition`).
    """
    fwd, bwd = plan.forward_stages, plan.backward_stages
    if not fwd or not bwd or fwd[-1] != bwd[0]:
        raise ValueError(
            "`plan.forward_stages[-1]` must equal the fused tail `plan.backward_stages[0]`; got"
            f" {fwd[-1:]!r} and {bwd[:1]!r}. HINT: build the plan with `auto_partition`."
        )
    return tuple(fwd[:-1]), tuple(bwd)


def describe_stages(
    plan: PartitionPlan,
    profiles: Sequence[LayerProfile],
    saved_activation_bytes: Sequence[int] | None = None,
    shared_weights: Sequence[SharedWeight] = (),
) -> list[StageSummary]:
    """Every stage of ``plan`` in round-robin order (forward, fused tail, backward) with its cost and memory.

    ``shared_weights``: weights several layers use (a tied embedding / LM head), which the layers'
    profiles each count; a stage holding several of those layers counts them once, as it uploads
    them once. A weight in two stages counts in both (both upload it), so a sum over stages is not
    the model's size.
    """
    tab = _Tables(list(profiles), saved_activation_bytes)
    fwd, bwd = schedule_ranges(plan)
    out: list[StageSummary] = []
    for kind, ranges in (("forward", fwd), ("fused", bwd[:1]), ("backward", bwd[1:])):
        for r in ranges:
            backward = kind != "forward"
            extra_param = sum(w.excess(r) * w.param_bytes for w in shared_weights)
            extra_grad = sum(w.excess(r) * w.grad_bytes for w in shared_weights) if backward else 0
            out.append(StageSummary(
                stage_index=len(out), kind=kind, layers=r, cost_s=tab.cost(r.start, r.stop, backward),
                param_bytes=tab.Pparam[r.stop] - tab.Pparam[r.start] - extra_param,
                grad_bytes=sum(tab.grad[i] for i in r) - extra_grad if backward else 0,
                memory_bytes=tab.mem(r.start, r.stop, backward) - extra_param - extra_grad,
            ))
    return out


def plan_objective_s(plan: PartitionPlan, profiles: Sequence[LayerProfile], num_devices: int) -> float:
    """``max(S, D) x`` largest stage cost of any plan in :func:`auto_partition`'s form, seconds."""
    stages = describe_stages(plan, profiles)
    return max(len(stages), num_devices) * max(s.cost_s for s in stages)
