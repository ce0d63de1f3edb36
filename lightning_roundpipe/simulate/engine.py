"""Discrete-event simulator: an :class:`ExecutionPlan` timed with a cost model.

The same plan the runtime executes is driven here by per-action costs (RoundPipe paper, arXiv
2604.27085, section 5.4 "simulation"; DESIGN.md section 3 "one plan, two consumers"):

- **Devices** walk their action lists strictly in order (never reordering), one compute at a time.
  ``LOAD``/``DROP`` are issued when the list reaches them (right after the previous compute ends), so
  a ``LOAD`` listed before the current stage's computes is a prefetch (double buffering).
- **Compute** costs come from :class:`LayerProfile` s: ``F`` = sum of ``forward_s``; ``X`` (fused
  tail) = sum of ``forward_s + backward_s`` (never recomputed); ``B`` = sum of ``backward_s``, plus
  the recomputation (sum of ``forward_s``) when the plan recomputes (RoundPipe always; baselines
  when built with ``recompute=True``). The LM head (the sequence's last layer) is never recomputed.
  A RoundPipe ``B`` recomputes from its saved stage input as soon as the device is free; only its
  backward part waits for the incoming gradient. A bound baseline recomputes after the gradient
  arrives (autograd checkpointing). With ``W`` actions (ZB-H1) a stage's backward splits into
  ``B`` = ``(1 - weight_grad_fraction) x backward_s`` and ``W`` = ``weight_grad_fraction x backward_s``.
- **Links**: every device has an H2D and a D2H link (PCIe one way each). An activation hop between
  devices is a D2H on the producer's link, then an H2D on the consumer's link (GPU -> CPU -> GPU).
  Weight uploads (``LOAD``: sum of ``param_bytes`` / H2D) and gradient downloads (``DROP`` of a
  backward stage: sum of ``grad_bytes`` / D2H) share those links at lower priority: activation
  copies preempt them (weights move in chunks), as in the paper's priority-aware transfers.
  Bound baselines keep their weights resident (``LOAD``/``DROP`` cost nothing).

Pure Python: no torch, no Lightning, no devices.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

from lightning_roundpipe.metrics.timeline import Interval, Timeline
from lightning_roundpipe.partition.profile import HardwareModel, LayerProfile
from lightning_roundpipe.schedule.ir import Action, ActionKind
from lightning_roundpipe.schedule.plan import ExecutionPlan, StageSpec
from lightning_roundpipe.simulate.iterations import _concatenate, _iteration_plans, roundpipe_rounds

__all__ = ["SimulationResult", "roundpipe_rounds", "simulate"]

_ACT, _BULK = 0, 1  # link priorities: activation copies first, then weights and gradients
_Node = tuple[int, Action]  # (iteration, action)


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` returns.

    Attributes:
        timeline: per-device busy intervals (compute ``F``/``X``/``B``/``W``, transfers ``H2D``/``D2H``)
            in seconds from the measured window's start; ``timeline.wall_s`` is the window length.
        iteration_s: wall time of one iteration (training step), seconds. In steady state, the
            mean period between the starts of consecutive iterations.
        idle_pct: per device, percent (0..100) of the measured window it did not compute (bubble).
        mean_idle_pct: mean of ``idle_pct`` over devices (total idle / (devices x window)).
        compute_s: per device, seconds of computation inside the measured window.
        num_iterations: iterations inside the measured window (1 unless ``steady_state``).
    """

    timeline: Timeline
    iteration_s: float
    idle_pct: tuple[float, ...]
    mean_idle_pct: float
    compute_s: tuple[float, ...] = ()
    num_iterations: int = 1


@dataclass
class _Transfer:
    remaining_s: float  # at the link's nominal rate
    priority: int
    kind: str  # "H2D" | "D2H"
    stage_index: int
    microbatch_index: int | None
    nbytes: int
    total_s: float
    on_done: Callable[[float], None]
    seq: int = 0


class _Link:
    """One direction of one device's host link: a server with preemptive priorities."""

    def __init__(self, sim: "_Sim", device: int, kind: str, preempt: bool) -> None:
        self.sim, self.device, self.kind, self.preempt = sim, device, kind, preempt
        self.queue: list[tuple[int, int, _Transfer]] = []
        self.cur: _Transfer | None = None
        self.seg_start = 0.0
        self.speed = 1.0
        self.token = 0

    @property
    def busy(self) -> bool:
        return self.cur is not None

    def submit(self, xfer: _Transfer) -> None:
        now = self.sim.now
        if xfer.remaining_s <= 0.0:
            xfer.on_done(now)
            return
        xfer.seq = next(self.sim.seq)
        heapq.heappush(self.queue, (xfer.priority, xfer.seq, xfer))
        if self.cur is not None and self.preempt and xfer.priority < self.cur.priority:
            self._stop(now)
            heapq.heappush(self.queue, (self.cur.priority, self.cur.seq, self.cur))
            self.cur = None
        if self.cur is None:
            self._start_next(now)

    def _stop(self, now: float) -> None:
        cur = self.cur
        served = (now - self.seg_start) * self.speed
        self._record(cur, self.seg_start, now, served)
        cur.remaining_s = max(0.0, cur.remaining_s - served)
        self.token += 1  # invalidate the pending completion event

    def _record(self, x: _Transfer, start: float, end: float, served_s: float) -> None:
        if end > start:
            share = served_s / x.total_s if x.total_s > 0 else 1.0
            self.sim.intervals.append(
                Interval(self.device, x.kind, x.stage_index, x.microbatch_index, start, end, int(round(x.nbytes * share)))
            )

    def _start_next(self, now: float) -> None:
        if not self.queue:
            return
        _, _, x = heapq.heappop(self.queue)
        self.cur, self.seg_start = x, now
        self.speed = self.sim.h2d_speed(self.device) if self.kind == "H2D" else 1.0
        self.token += 1
        token = self.token
        self.sim.at(now + x.remaining_s / self.speed, lambda t: self._finish(token, t))

    def _finish(self, token: int, now: float) -> None:
        if token != self.token or self.cur is None:
            return
        x, self.cur = self.cur, None
        self._record(x, self.seg_start, now, x.remaining_s)
        x.remaining_s = 0.0
        self._start_next(now)
        x.on_done(now)


@dataclass
class _Dev:
    actions: list[_Node]
    pos: int = 0
    busy: bool = False
    phase: int = 0  # 0: before the recompute part, 1: before the main part


class _Sim:
    """The event loop over one or more iterations of a plan."""

    def __init__(self, plans: list[ExecutionPlan], lists: list[list[_Node]], profiles: Sequence[LayerProfile],
                 hardware: HardwareModel | None, comm_s_per_hop: float | None, recompute: bool,
                 activation_priority: bool, weight_grad_fraction: float) -> None:
        self.plans, self.profiles, self.hw, self.comm = plans, profiles, hardware, comm_s_per_hop
        self.recompute, self.wfrac = recompute, weight_grad_fraction
        self.bound = bool(plans[0]._meta.get("weight_binding", False))
        self.num_layers = len(profiles)
        self.now = 0.0
        self.seq = itertools.count()
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.intervals: list[Interval] = []
        n_dev = len(lists)
        self.devs = [_Dev(list(acts)) for acts in lists]
        self.h2d = [_Link(self, d, "H2D", activation_priority) for d in range(n_dev)]
        self.d2h = [_Link(self, d, "D2H", activation_priority) for d in range(n_dev)]
        self.act_prio = _ACT
        self.bulk_prio = _BULK if activation_priority else _ACT
        self.on_dev: dict[tuple[_Node, int], float] = {}  # (producer node, device) -> arrival time
        self.loaded: set[tuple[int, int, int]] = set()  # (iteration, stage, device)
        self.saved_on: set[tuple[_Node, int]] = set()  # (B node, device): saved stage input uploaded
        self.saved_requested: set[_Node] = set()
        self.cpu_ready: set[_Node] = set()
        self.waiting_cpu: dict[_Node, list[Callable[[], None]]] = {}
        self.first_start: dict[int, float] = {}
        self.done = 0
        self.dirty: set[int] = set()
        self._phase_cache: dict[tuple[int, int, ActionKind], tuple[float, float]] = {}
        self.total = sum(1 for acts in lists for _, a in acts if a.kind.is_compute)
        self._index(lists)

    # ------------------------------------------------------------------ setup
    def _index(self, lists: list[list[_Node]]) -> None:
        self.device_of: dict[_Node, int] = {}
        by_key: dict[tuple[int, int, ActionKind, int | None], _Node] = {}
        for d, acts in enumerate(lists):
            for node in acts:
                it, a = node
                if a.kind.is_compute:
                    self.device_of[node] = d
                    by_key[(it, a.stage_index, a.kind, a.microbatch_index)] = node
        self.deps: dict[_Node, tuple[_Node, ...]] = {}
        self.consumers: dict[_Node, set[int]] = {}
        self.saved_src: dict[_Node, _Node] = {}
        self.saved_at: dict[_Node, list[int]] = {}  # F node -> boundaries (layer index) it saves
        self.w_stages = [{a.stage_index for acts in p.actions for a in acts if a.kind is ActionKind.W} for p in self.plans]
        templates: dict[tuple[int, int, ActionKind], tuple[tuple[int, ActionKind], ...] | None] = {}
        for node, d in self.device_of.items():
            it, a = node
            plan = self.plans[it]
            m = a.microbatch_index
            key = (id(plan), a.stage_index, a.kind)
            if key not in templates:  # dependencies keep the microbatch: one template per stage and kind
                got = plan.dependencies(a)
                templates[key] = (tuple((x.stage_index, x.kind) for x in got)
                                  if all(x.microbatch_index == m for x in got) else None)
            tpl = templates[key]
            keys = ([(it, x.stage_index, x.kind, x.microbatch_index) for x in plan.dependencies(a)] if tpl is None
                    else [(it, si, k, m) for si, k in tpl])
            for key_ in keys:
                if key_ not in by_key:
                    raise ValueError(f"Plan action `{a}` depends on `{Action(*key_[1:])}`, which no device runs."
                                     " HINT: run `plan.validate()`.")
            deps = tuple(by_key[key_] for key_ in keys)
            self.deps[node] = deps
            for dep in deps:
                if self.device_of[dep] != d:
                    self.consumers.setdefault(dep, set()).add(d)
            spec = plan.stages[a.stage_index]
            if a.kind is ActionKind.B and self._early_recompute() and spec.layers.start > 0:
                src = _forward_stage_of(plan, spec.layers.start - 1)
                if src is not None:
                    fnode = (it, Action(src.stage_index, ActionKind.F, a.microbatch_index))
                    if fnode in self.device_of:
                        self.saved_src[node] = fnode
                        self.saved_at.setdefault(fnode, []).append(spec.layers.start)

    def _early_recompute(self) -> bool:
        return self.recompute and not self.bound

    # ------------------------------------------------------------------ costs
    def _act_bytes(self, boundary: int) -> int:
        return self.profiles[min(boundary, self.num_layers - 1)].activation_bytes

    def _act_s(self, nbytes: int, kind: str) -> float:
        if self.comm is not None:
            return self.comm / 2.0
        if self.hw is None:
            return 0.0
        return nbytes / (self.hw.h2d_bytes_per_s if kind == "H2D" else self.hw.d2h_bytes_per_s)

    def h2d_speed(self, device: int) -> float:
        if self.hw is None or not self.d2h[device].busy:
            return 1.0
        return self.hw.duplex_h2d_bytes_per_s / self.hw.h2d_bytes_per_s

    def _phases(self, node: _Node) -> tuple[float, float]:
        """(recompute part that needs only the saved input, part that needs the dependencies), s."""
        it, a = node
        key = (id(self.plans[it]), a.stage_index, a.kind)
        got = self._phase_cache.get(key)
        if got is None:
            got = self._phase_cache[key] = self._phases_uncached(node)
        return got

    def _phases_uncached(self, node: _Node) -> tuple[float, float]:
        it, a = node
        spec = self.plans[it].stages[a.stage_index]
        layers = [self.profiles[i] for i in spec.layers]
        fwd = sum(p.forward_s for p in layers)
        bwd = sum(p.backward_s for p in layers)
        if a.kind is ActionKind.F:
            return 0.0, fwd
        if a.kind is ActionKind.X:
            return 0.0, fwd + bwd
        split = spec.stage_index in self.w_stages[it]
        if a.kind is ActionKind.W:
            return 0.0, bwd * self.wfrac
        main = bwd * (1.0 - self.wfrac) if split else bwd
        rec = 0.0
        if self.recompute:
            rec = sum(self.profiles[i].forward_s for i in spec.layers if i != self.num_layers - 1)
        return (rec, main) if self._early_recompute() else (0.0, rec + main)

    # ------------------------------------------------------------------ events
    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def run(self) -> None:
        self.dirty.update(range(len(self.devs)))
        while True:
            while self.dirty:  # wake the devices whose inputs changed, in a fixed order
                for d in sorted(self.dirty):
                    self.dirty.discard(d)
                    self._advance(d)
            if not self.events:
                break
            t, _, fn = heapq.heappop(self.events)
            self.now = t
            fn(t)
        if self.done != self.total:
            blocked = []
            for d, dev in enumerate(self.devs):
                if dev.pos < len(dev.actions):
                    it, a = dev.actions[dev.pos]
                    blocked.append(f"dev{d}: `{a}` (iteration {it}) waits for {[str(x[1]) for x in self.deps.get((it, a), ())]}")
            raise ValueError("Simulation deadlocked: " + "; ".join(blocked) + ". HINT: run `plan.validate()`.")

    def _advance(self, d: int) -> None:
        dev = self.devs[d]
        while not dev.busy and dev.pos < len(dev.actions):
            node = dev.actions[dev.pos]
            it, a = node
            if not a.kind.is_compute:
                self._issue_transfer_action(d, node)
                dev.pos += 1
                continue
            if dev.phase == 0:
                self._request_saved(d, node)
                if (it, a.stage_index, d) not in self.loaded or (node in self.saved_src and (node, d) not in self.saved_on):
                    return
                pre, _ = self._phases(node)
                dev.phase = 1
                if pre > 0:
                    self._start_compute(d, node, pre, lambda t: self._pre_done(d))
                    self._prefetch_next_saved(d)
                    return
            if any(dep != node and (dep, d) not in self.on_dev for dep in self.deps[node]):
                return
            _, main = self._phases(node)
            self._start_compute(d, node, main, lambda t, n=node: self._main_done(d, n))
            self._prefetch_next_saved(d)
            return

    def _start_compute(self, d: int, node: _Node, dur: float, then: Callable[[float], None]) -> None:
        it, a = node
        self.devs[d].busy = True
        self.first_start.setdefault(it, self.now)
        self.first_start[it] = min(self.first_start[it], self.now)
        self.intervals.append(Interval(d, a.kind.value, a.stage_index, a.microbatch_index, self.now, self.now + dur))
        self.at(self.now + dur, then)

    def _pre_done(self, d: int) -> None:
        self.devs[d].busy = False
        self.dirty.add(d)

    def _main_done(self, d: int, node: _Node) -> None:
        dev = self.devs[d]
        dev.busy, dev.phase = False, 0
        dev.pos += 1
        self.done += 1
        self.on_dev[(node, d)] = self.now
        self.dirty.add(d)
        cons = self.consumers.get(node, set())
        saves = self.saved_at.get(node, [])
        if not cons and not saves:
            return
        it, a = node
        spec = self.plans[it].stages[a.stage_index]
        # What leaves the device: first the output (forward) or the input gradient (backward), on the
        # critical path; then any other stage-boundary activations saved for a later backward stage's
        # recomputation (same priority, so FIFO behind the output).
        out_boundary = spec.layers.stop if a.kind is ActionKind.F else spec.layers.start
        saved_only = sorted(b for b in saves if not (cons and b == out_boundary))

        def on_cpu() -> None:
            self.cpu_ready.add(node)
            for fn in self.waiting_cpu.pop(node, []):
                fn()

        def hops(t: float) -> None:
            hb = self._act_bytes(out_boundary)
            dur = self._act_s(hb, "H2D")
            for c in sorted(cons):
                self.h2d[c].submit(_Transfer(dur, self.act_prio, "H2D", a.stage_index, a.microbatch_index, hb, dur,
                                             lambda t2, c=c: self._arrive(node, c, t2)))
            if not saved_only:
                on_cpu()

        if cons:
            ob = self._act_bytes(out_boundary)
            dur = self._act_s(ob, "D2H")
            self.d2h[d].submit(_Transfer(dur, self.act_prio, "D2H", a.stage_index, a.microbatch_index, ob, dur, hops))
        if saved_only:
            sb = sum(self._act_bytes(b) for b in saved_only)
            dur = sum(self._act_s(self._act_bytes(b), "D2H") for b in saved_only)
            self.d2h[d].submit(_Transfer(dur, self.act_prio, "D2H", a.stage_index, a.microbatch_index, sb, dur,
                                         lambda t: on_cpu()))

    def _arrive(self, node: _Node, d: int, t: float) -> None:
        self.on_dev[(node, d)] = t
        self.dirty.add(d)

    def _mark(self, key: object, store: set, d: int) -> None:
        store.add(key)
        self.dirty.add(d)

    # ------------------------------------------------------------------ saved inputs (RoundPipe B)
    def _prefetch_next_saved(self, d: int) -> None:
        if not self.saved_src:
            return
        dev = self.devs[d]
        for k in range(dev.pos + 1, len(dev.actions)):
            if dev.actions[k][1].kind.is_compute:
                self._request_saved(d, dev.actions[k])
                return

    def _request_saved(self, d: int, node: _Node) -> None:
        src = self.saved_src.get(node)
        if src is None or node in self.saved_requested:
            return
        self.saved_requested.add(node)
        it, a = node
        nbytes = self._act_bytes(self.plans[it].stages[a.stage_index].layers.start)
        dur = self._act_s(nbytes, "H2D")

        def upload() -> None:
            self.h2d[d].submit(_Transfer(dur, self.act_prio, "H2D", a.stage_index, a.microbatch_index, nbytes, dur,
                                         lambda t: self._mark((node, d), self.saved_on, d)))

        if src in self.cpu_ready:
            upload()
        else:
            self.waiting_cpu.setdefault(src, []).append(upload)

    # ------------------------------------------------------------------ LOAD / DROP
    def _issue_transfer_action(self, d: int, node: _Node) -> None:
        it, a = node
        spec = self.plans[it].stages[a.stage_index]
        key = (it, a.stage_index, d)
        if a.kind is ActionKind.LOAD:
            nbytes = 0 if self.bound else sum(self.profiles[i].param_bytes for i in spec.layers)
            dur = nbytes / self.hw.h2d_bytes_per_s if (self.hw is not None and nbytes) else 0.0
            self.h2d[d].submit(_Transfer(dur, self.bulk_prio, "H2D", a.stage_index, None, nbytes, dur,
                                         lambda t: self._mark(key, self.loaded, d)))
        elif a.kind is ActionKind.DROP and spec.kind == "backward" and not self.bound and self.hw is not None:
            nbytes = sum(self.profiles[i].grad_bytes for i in spec.layers)
            dur = nbytes / self.hw.d2h_bytes_per_s
            self.d2h[d].submit(_Transfer(dur, self.bulk_prio, "D2H", a.stage_index, None, nbytes, dur, lambda t: None))


def _forward_stage_of(plan: ExecutionPlan, layer: int) -> StageSpec | None:
    for s in plan.forward_stages:
        if layer in s.layers:
            return s
    return None


# ---------------------------------------------------------------------------------------- public
def simulate(
    plan: ExecutionPlan | Sequence[ExecutionPlan],
    profiles: Sequence[LayerProfile],
    hardware: HardwareModel | None = None,
    *,
    steady_state: bool = False,
    comm_s_per_hop: float | None = None,
    recompute: bool | None = None,
    activation_priority: bool = True,
    weight_grad_fraction: float = 0.5,
    steady_iterations: int = 4,
) -> SimulationResult:
    """Time one training iteration of ``plan`` with per-layer costs; return its timeline and bubbles.

    Source: RoundPipe paper (arXiv 2604.27085) sections 3 (round-robin dispatch, asymmetric
    partition, fused tail, priority-aware transfers) and 5.4 (bubble simulation). Stage layers
    come from ``plan.stages[i].layers``, which index ``profiles``.

    Args:
        plan: a valid plan (RoundPipe, a baseline from :mod:`lightning_roundpipe.schedule.baselines`,
            or any plan that passes ``validate()``); or the plans of one iteration's consecutive
            microbatch rounds (RoundPipe dispatches at most ``D`` microbatches per round, each round
            continuing the rotation: see :func:`roundpipe_rounds`), run back to back on the devices.
        profiles: one :class:`LayerProfile` per layer of the layer sequence (seconds and bytes for
            one microbatch); the last one is the LM head (+ loss), which is never recomputed.
        hardware: link bandwidths (bytes/s) for weight uploads, gradient downloads and activation
            hops; ``None``: weights and gradients move for free, and activation hops cost
            ``comm_s_per_hop`` (or nothing).
        steady_state: simulate ``steady_iterations`` back-to-back iterations (a RoundPipe plan's
            cursor carried over, so the rotation continues; the next iteration starts as soon as
            its first stage's device and inputs allow, as with the paper's asynchronous optimizer)
            and measure from the start of the second iteration to the start of the last: fill and
            drain are hidden by the neighbouring iterations.
        comm_s_per_hop: seconds for one activation hop GPU -> CPU -> GPU (half D2H on the producer's
            link, half H2D on the consumer's); overrides the bytes-based hop time.
        recompute: whether ``B`` re-runs its layers' forward; ``None``: ``plan._meta["recompute"]``
            when set (baselines), else ``True`` (RoundPipe: full recomputation).
        activation_priority: activation copies preempt weight/gradient transfers on a link;
            ``False``: one FIFO queue per link (for comparison).
        weight_grad_fraction: share of ``backward_s`` that is the weight gradient (``W``), for
            stages whose backward is split (ZB-H1); 0..1.
        steady_iterations: iterations simulated in steady state (>= 3).

    Returns:
        A :class:`SimulationResult`; times in seconds, idle in percent.

    Raises:
        ValueError: ``profiles`` does not cover the plan's layers, plans of different device counts,
            a bad argument value, or a plan whose dependencies deadlock.
        TypeError: ``plan`` is not an :class:`ExecutionPlan` (or a sequence of them).
    """
    rounds = [plan] if isinstance(plan, ExecutionPlan) else list(plan)
    if not rounds or not all(isinstance(p, ExecutionPlan) for p in rounds):
        raise TypeError(f"`plan` must be an ExecutionPlan or a non-empty sequence of them, got {plan!r}.")
    if len({p.num_devices for p in rounds}) != 1:
        raise ValueError("All plans of one iteration must have the same number of devices.")
    profiles = list(profiles)
    if not all(isinstance(p, LayerProfile) for p in profiles):
        raise TypeError("`profiles` must be a sequence of LayerProfile.")
    need = max((s.layers.stop for p in rounds for s in p.stages), default=0)
    if len(profiles) < need:
        raise ValueError(
            f"`profiles` has {len(profiles)} layers but the plan's stages reach layer {need - 1}."
            " HINT: pass one LayerProfile per layer of the layer sequence (LM head last)."
        )
    if comm_s_per_hop is not None and comm_s_per_hop < 0:
        raise ValueError(f"`comm_s_per_hop` must be >= 0, got {comm_s_per_hop!r}.")
    if not 0.0 <= weight_grad_fraction <= 1.0:
        raise ValueError(f"`weight_grad_fraction` must be in 0..1, got {weight_grad_fraction!r}.")
    if steady_state and steady_iterations < 3:
        raise ValueError(f"`steady_iterations` must be >= 3 in steady state, got {steady_iterations!r}.")
    if recompute is None:
        recompute = bool(rounds[0]._meta.get("recompute", True))
    n_iter = steady_iterations if steady_state else 1
    plans = _iteration_plans(rounds, n_iter)
    sim = _Sim(plans, _concatenate(plans), profiles, hardware, comm_s_per_hop, recompute, activation_priority,
               weight_grad_fraction)
    sim.run()
    n_dev = rounds[0].num_devices
    if not steady_state:
        wall = max((i.end_s for i in sim.intervals), default=0.0)
        tl = Timeline(n_dev, sorted(sim.intervals, key=lambda i: (i.start_s, i.device_index)), wall_s=wall)
        return _result(tl, wall, 1)
    r = len(rounds)
    t0, t1 = sim.first_start[r], sim.first_start[r * (n_iter - 1)]
    clipped = []
    for i in sim.intervals:
        s, e = max(i.start_s, t0), min(i.end_s, t1)
        if e > s:
            share = (e - s) / i.duration_s
            clipped.append(Interval(i.device_index, i.kind, i.stage_index, i.microbatch_index, s - t0, e - t0,
                                    int(round(i.nbytes * share))))
    tl = Timeline(n_dev, sorted(clipped, key=lambda i: (i.start_s, i.device_index)), wall_s=t1 - t0)
    return _result(tl, (t1 - t0) / (n_iter - 2), n_iter - 2)


def _result(tl: Timeline, iteration_s: float, n: int) -> SimulationResult:
    idle = tuple(tl.bubble_pct(d) for d in range(tl.num_devices))
    return SimulationResult(
        timeline=tl,
        iteration_s=iteration_s,
        idle_pct=idle,
        mean_idle_pct=sum(idle) / len(idle) if idle else 0.0,
        compute_s=tuple(tl.compute_s(d) for d in range(tl.num_devices)),
        num_iterations=n,
    )
