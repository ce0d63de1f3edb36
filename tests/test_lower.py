"""Lowering compute plans to stream programs (``schedule.lower`` and ``schedule.program``).

In the style of ``torch.distributed.pipelining``'s schedule tests: the expected per-device,
per-stream op lists of small cases are written out by hand as string tables, from the rules of
``lower.py``'s module docstring (never computed by the code under test). Property tests then check
larger plans against the same rules: the stream contents, per-stream counts, the exact dependency
edges, and, with a reachability computed here (a plain walk over stream order and edges,
independent of ``StreamProgram``'s own walk and vector clocks), that every read follows its write
and that no device ever holds more than ``plan.max_resident_stages`` stages.
"""

from __future__ import annotations

import math
import random
import re

import pytest

from lightning_roundpipe.schedule.baselines import build_baseline_plan
from lightning_roundpipe.schedule.ir import ActionKind
from lightning_roundpipe.schedule.lower import lower, required_predecessors
from lightning_roundpipe.schedule.plan import ExecutionPlan, PlanValidationError
from lightning_roundpipe.schedule.program import STREAMS, Op, OpKind, StreamProgram
from lightning_roundpipe.schedule.roundpipe import build_roundpipe_plan, build_stages, default_stage_ranges


# ============================================================================================ helpers
def _dev(weights: str = "", h2d: str = "", compute: str = "", d2h: str = "") -> dict[str, list[str]]:
    """One device's row of a hand-written table: each stream as whitespace-separated op strings."""
    return {"weights": weights.split(), "h2d": h2d.split(), "compute": compute.split(), "d2h": d2h.split()}


def _plan_strings(plan: ExecutionPlan) -> list[list[str]]:
    return [[str(a) for a in acts] for acts in plan.actions]


def _all_edges(program: StreamProgram) -> dict[str, list[str]]:
    return {str(op): program.edges_of(op) for op in program.deps if program.deps[op]}


def _sorted_values(table: dict[str, list[str]]) -> dict[str, list[str]]:
    return {k: sorted(v) for k, v in table.items()}


def _reachability(program: StreamProgram, drop: tuple[Op, Op] | None = None):
    """``before(a, b)``: ``a`` finishes before ``b`` starts in every execution (stream order and
    edges, transitively), optionally without the edge ``drop = (consumer, producer)``.

    A Kahn walk with ancestor bitmasks, written here so that the checks do not rely on
    ``StreamProgram.topological_order`` or its vector clocks.
    """
    ops = [op for per in program.streams for s in STREAMS for op in per[s]]
    index = {op: i for i, op in enumerate(ops)}
    assert len(index) == len(ops), "an op appears twice"
    preds: dict[Op, list[Op]] = {op: [] for op in ops}
    for per in program.streams:
        for s in STREAMS:
            for a, b in zip(per[s], per[s][1:]):
                preds[b].append(a)
    for consumer, producers in program.deps.items():
        for producer in producers:
            if (consumer, producer) != drop:
                preds[consumer].append(producer)
    succ: dict[Op, list[Op]] = {op: [] for op in ops}
    indeg = {op: len(preds[op]) for op in ops}
    for consumer in ops:
        for producer in preds[consumer]:
            succ[producer].append(consumer)
    ready = [op for op in ops if indeg[op] == 0]
    anc: dict[Op, int] = {}
    while ready:
        op = ready.pop()
        mask = 0
        for p in preds[op]:
            mask |= anc[p] | (1 << index[p])
        anc[op] = mask
        for nxt in succ[op]:
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                ready.append(nxt)
    assert len(anc) == len(ops), "the program's edges form a cycle"

    def before(a: Op, b: Op) -> bool:
        return a != b and bool((anc[b] >> index[a]) & 1)

    return before


def _op(kind: OpKind, stage: int, mb: int | None = None, chunk: int | None = None, rnd: int = 0) -> Op:
    return Op(kind, stage, mb, chunk, rnd)


def _present(plan: ExecutionPlan) -> set[int]:
    return {a.stage_index for acts in plan.actions for a in acts if a.kind.is_compute}


def _input_stage(plan: ExecutionPlan, s: int) -> int | None:
    """The forward stage whose ``F`` downloads the activation at stage ``s``'s first layer boundary
    (``None``: the input comes from the host). A forward stage sends the output of its last layer;
    it also saves every boundary strictly inside or at the end of its layers for backward stages."""
    spec = plan.stages[s]
    x = spec.layers.start
    forward = [t for t in plan.stages if t.kind == "forward" and t.stage_index in _present(plan)]
    if spec.kind == "forward":
        hits = [t for t in forward if t.layers.stop == x]
    else:
        hits = [t for t in forward if t.layers.start < x <= t.layers.stop]
    return hits[0].stage_index if hits else None


def _gradient_stage(plan: ExecutionPlan, s: int) -> int | None:
    """The backward stage before ``s`` in plan order (it sends ``s`` its incoming gradient); for the
    first backward stage, the forward stage ending at the same layer when the program runs it (the
    host makes the loss gradient from that output), else ``None`` (host)."""
    backward = [t.stage_index for t in plan.stages if t.kind == "backward"]
    k = backward.index(s)
    if k == 0:
        stop = plan.stages[s].layers.stop
        ends = [t.stage_index for t in plan.stages if t.kind == "forward" and t.stage_index in _present(plan)
                and t.layers.stop == stop]
        return ends[0] if ends else None
    return backward[k - 1] if backward[k - 1] in _present(plan) else None


def _dispatches(plan: ExecutionPlan) -> list[dict]:
    """Each LOAD..DROP residency of the plan: device, stage, round, computes, list position, room."""
    out: list[dict] = []
    for d, acts in enumerate(plan.actions):
        last_drop = None
        mine: list[dict] = []
        for i, a in enumerate(acts):
            if a.kind is ActionKind.LOAD:
                computes = []
                for b in acts[i + 1:]:
                    if b.stage_index == a.stage_index:
                        if b.kind is ActionKind.DROP:
                            break
                        computes.append(b)
                mine.append(dict(device=d, stage=a.stage_index, computes=computes, pos=i, room=last_drop))
            elif a.kind is ActionKind.DROP:
                last_drop = next(x for x in reversed(mine) if x["stage"] == a.stage_index)
        out += mine
    for s in {x["stage"] for x in out}:
        ordered = sorted((x for x in out if x["stage"] == s), key=lambda x: min(a.microbatch_index for a in x["computes"]))
        for r, x in enumerate(ordered):
            x["round"] = r
    return out


def _first_kind(action, recompute: str) -> OpKind:
    if action.kind is ActionKind.B and recompute != "none":
        return OpKind.R
    return OpKind(action.kind.value)


def _expected_edges(plan: ExecutionPlan, recompute: str, n_chunks: dict[int, int]) -> dict[Op, set[Op]]:
    """The dependency edges, from the rules of lower.py's module docstring."""
    edges: dict[Op, set[Op]] = {}

    def edge(consumer: Op, producer: Op) -> None:
        edges.setdefault(consumer, set()).add(producer)

    for d, acts in enumerate(plan.actions):
        for a in acts:
            if not a.kind.is_compute or a.kind is ActionKind.W:
                continue
            s, m = a.stage_index, a.microbatch_index
            first = _op(_first_kind(a, recompute), s, m)
            upload = _op(OpKind.H2D, s, m)
            edge(first, upload)
            src = _input_stage(plan, s)
            if src is not None:
                edge(upload, _op(OpKind.D2H, src, m))
            if a.kind is ActionKind.B:
                grad = _op(OpKind.GH2D, s, m)
                edge(_op(OpKind.B, s, m), grad)
                if recompute == "late":
                    edge(first, grad)
                g = _gradient_stage(plan, s)
                if g is not None:
                    edge(grad, _op(OpKind.D2H, g, m))
            edge(_op(OpKind.D2H, s, m), _op(OpKind(a.kind.value), s, m))
    for x in _dispatches(plan):
        s, r, d = x["stage"], x["round"], x["device"]
        chunks = _chunk_ops(n_chunks, x)
        if x["room"] is not None:
            edge(chunks[0], _op(OpKind.DROP, x["room"]["stage"], rnd=x["room"]["round"]))
        first = x["computes"][0]
        edge(_op(_first_kind(first, recompute), s, first.microbatch_index), chunks[-1])
        last = x["computes"][-1]
        last_op = _op(OpKind(last.kind.value), s, last.microbatch_index)
        if plan.stages[s].kind == "backward":
            edge(_op(OpKind.WD2H, s, rnd=r), last_op)
        edge(_op(OpKind.DROP, s, rnd=r), last_op)
        # activations before weights: chunk i of a prefetch waits for the i-th upload the device
        # needs before the prefetched stage runs
        pending: list[Op] = []
        for a in plan.actions[d][x["pos"] + 1:]:
            if not a.kind.is_compute:
                continue
            if a.stage_index == s:
                break
            if a.kind is ActionKind.W:
                continue
            pending.append(_op(OpKind.H2D, a.stage_index, a.microbatch_index))
            if a.kind is ActionKind.B:
                pending.append(_op(OpKind.GH2D, a.stage_index, a.microbatch_index))
        for chunk, upload in zip(chunks, pending):
            edge(chunk, upload)
    return edges


def _chunk_ops(n_chunks: dict[int, int], dispatch: dict) -> list[Op]:
    n = n_chunks[dispatch["stage"]]
    return [_op(OpKind.LOAD, dispatch["stage"], chunk=c, rnd=dispatch["round"]) for c in range(n)]


def _check_program(program: StreamProgram, plan: ExecutionPlan, weight_bytes, grad_bytes, chunk_bytes: int,
                   recompute: str) -> None:
    """Every property of a lowered program that the rules fix."""
    assert program.plan is plan and program.recompute == recompute and program.chunk_bytes == chunk_bytes
    assert program.num_devices == plan.num_devices
    strings = program.as_strings()
    n_chunks = {s: max(1, -(-int(weight_bytes[s]) // chunk_bytes)) for s in range(len(plan.stages))}
    dispatches = _dispatches(plan)
    M = plan.num_microbatches

    # ---- stream contents, device by device
    for d, acts in enumerate(plan.actions):
        per = program.streams[d]
        assert set(per) == set(STREAMS)
        for s in STREAMS:
            assert all(op.stream == s for op in per[s])
        computes = [a for a in acts if a.kind.is_compute]
        want_compute, want_h2d, want_d2h = [], [], []
        for a in computes:
            s, m = a.stage_index, a.microbatch_index
            if a.kind is ActionKind.B and recompute != "none":
                want_compute.append(f"{s}R{m}")
            want_compute.append(str(a))
            if a.kind is not ActionKind.W:
                # exactly one H2D per compute op, in the order of the computes; GH2D before a B
                want_h2d.append(f"{s}H2D{m}")
                if a.kind is ActionKind.B:
                    want_h2d.append(f"{s}GH2D{m}")
                want_d2h.append(f"{s}D2H{m}")
        assert strings[d]["compute"] == want_compute
        assert strings[d]["h2d"] == want_h2d
        assert [x for x in strings[d]["d2h"] if "D2H" in x and "WD2H" not in x] == want_d2h
        mine = [x for x in dispatches if x["device"] == d]
        want_weights = []
        for x in mine:
            suffix = f"@{x['round']}" if x["round"] else ""
            want_weights += [f"{x['stage']}LOAD.c{c}{suffix}" for c in range(n_chunks[x["stage"]])]
        assert strings[d]["weights"] == want_weights
        # chunk sizes: all full but the last; together the stage's bytes
        for x in mine:
            got = [op for op in per["weights"] if op.stage_index == x["stage"] and op.round_index == x["round"]]
            sizes = [op.nbytes for op in got]
            assert len(sizes) == max(1, math.ceil(int(weight_bytes[x["stage"]]) / chunk_bytes))
            assert sum(sizes) == int(weight_bytes[x["stage"]])
            assert all(0 <= b <= chunk_bytes for b in sizes) and all(b == chunk_bytes for b in sizes[:-1])
        # d2h: after the download of a dispatch's last compute come its WD2H (backward) and DROP
        d2h = strings[d]["d2h"]
        for x in mine:
            s, r = x["stage"], x["round"]
            suffix = f"@{r}" if r else ""
            tail = ([f"{s}WD2H{suffix}"] if plan.stages[s].kind == "backward" else []) + [f"{s}DROP{suffix}"]
            last = [a for a in x["computes"] if a.kind is not ActionKind.W][-1]
            at = d2h.index(f"{s}D2H{last.microbatch_index}") + 1
            assert d2h[at:at + len(tail)] == tail
            if plan.stages[s].kind == "backward":
                wd2h = next(op for op in per["d2h"] if op.kind is OpKind.WD2H and op.stage_index == s and op.round_index == r)
                assert wd2h.nbytes == (int(grad_bytes[s]) if grad_bytes is not None else 0)
        n_computes = sum(a.kind is not ActionKind.W for a in computes)
        n_backward = sum(plan.stages[x["stage"]].kind == "backward" for x in mine)
        assert len(d2h) == n_computes + n_backward + len(mine)

    # ---- per-program counts
    present = _present(plan)
    n_b = sum(plan.stages[s].compute_kind is ActionKind.B for s in present)
    n_w = sum(a.kind is ActionKind.W for acts in plan.actions for a in acts)
    n_compute = sum(len(per["compute"]) for per in program.streams)
    assert n_compute == len(present) * M + (n_b * M if recompute != "none" else 0) + n_w
    assert sum(len(per["weights"]) for per in program.streams) == sum(n_chunks[x["stage"]] for x in dispatches)

    # ---- the edges, exactly as the rules say
    got = {op: set(deps) for op, deps in program.deps.items() if deps}
    assert got == _expected_edges(plan, recompute, n_chunks)

    # ---- the in-order walk respects stream order and every edge
    order = program.topological_order()
    where = {op: i for i, op in enumerate(order)}
    all_ops = [op for per in program.streams for s in STREAMS for op in per[s]]
    assert len(order) == len(all_ops) and set(order) == set(all_ops)
    for per in program.streams:
        for s in STREAMS:
            assert [where[op] for op in per[s]] == sorted(where[op] for op in per[s])
    for consumer, producers in program.deps.items():
        for producer in producers:
            assert where[producer] < where[consumer], (producer, consumer)

    # ---- reads after writes, by reachability computed here
    before = _reachability(program)
    for x in dispatches:
        s, r = x["stage"], x["round"]
        chunks = _chunk_ops(n_chunks, x)
        drop = _op(OpKind.DROP, s, rnd=r)
        for a in x["computes"]:
            m = a.microbatch_index
            compute = _op(OpKind(a.kind.value), s, m)
            first = _op(_first_kind(a, recompute), s, m)
            assert all(before(c, first) for c in chunks), (first, chunks)
            assert before(compute, drop)
            if plan.stages[s].kind == "backward":
                assert before(compute, _op(OpKind.WD2H, s, rnd=r))
            if a.kind is ActionKind.W:
                assert before(_op(OpKind.B, s, m), compute)
                continue
            upload = _op(OpKind.H2D, s, m)
            assert before(upload, first)
            src = _input_stage(plan, s)
            if src is not None:
                assert before(_op(OpKind.D2H, src, m), upload)
            if a.kind is ActionKind.B:
                grad = _op(OpKind.GH2D, s, m)
                assert before(grad, compute)
                if recompute != "none":
                    assert before(first, compute)
                if recompute == "late":
                    assert before(grad, first)
                g = _gradient_stage(plan, s)
                if g is not None:
                    assert before(_op(OpKind.D2H, g, m), grad)
            assert before(compute, _op(OpKind.D2H, s, m))

    # ---- residency: in every execution at most max_resident_stages stages per device
    for d in range(plan.num_devices):
        mine = sorted((x for x in dispatches if x["device"] == d), key=lambda x: x["pos"])
        for k, x in enumerate(mine):
            first_chunk = _chunk_ops(n_chunks, x)[0]
            held = [y for y in mine[:k] if not before(_op(OpKind.DROP, y["stage"], rnd=y["round"]), first_chunk)]
            assert len(held) + 1 <= plan.max_resident_stages, (d, first_chunk, held)
    # ... and replaying the weights and d2h streams in the walk's order
    resident = [set() for _ in range(plan.num_devices)]
    for op in order:
        d = program.location(op)[0]
        if op.kind is OpKind.LOAD and op.chunk_index == 0:
            resident[d].add((op.stage_index, op.round_index))
            assert len(resident[d]) <= plan.max_resident_stages
        elif op.kind is OpKind.DROP:
            resident[d].remove((op.stage_index, op.round_index))
    assert all(not r for r in resident), "a loaded stage is never released"


# ===================================================================== 1. hand-written tables
def _fused_stages():
    return build_stages([range(0, 2), range(2, 4)], [range(3, 4), range(1, 3), range(0, 1)], fused_tail=True)


def _main_plan() -> ExecutionPlan:
    return build_roundpipe_plan(_fused_stages(), 2, 3)


def _main_program(recompute: str | None = None, validate: bool = True) -> StreamProgram:
    return lower(_main_plan(), stage_weight_bytes=[100] * 5, stage_grad_bytes=[0, 0, 11, 12, 13], chunk_bytes=40,
                 recompute=recompute, validate=validate)


# 2 devices, 3 microbatches; stages 0F(0..1) 1F(2..3) 2X(3) 3B(1..2) 4B(0); 3 chunks per LOAD
MAIN_PLAN = [
    "0LOAD 2LOAD 0F0 0F1 0F2 0DROP 4LOAD 2X0 2X1 2X2 2DROP 4B0 4B1 4B2 4DROP".split(),
    "1LOAD 3LOAD 1F0 1F1 1F2 1DROP 3B0 3B1 3B2 3DROP".split(),
]
MAIN_TABLE = [
    _dev(weights="0LOAD.c0 0LOAD.c1 0LOAD.c2 2LOAD.c0 2LOAD.c1 2LOAD.c2 4LOAD.c0 4LOAD.c1 4LOAD.c2",
         h2d="0H2D0 0H2D1 0H2D2 2H2D0 2H2D1 2H2D2 4H2D0 4GH2D0 4H2D1 4GH2D1 4H2D2 4GH2D2",
         compute="0F0 0F1 0F2 2X0 2X1 2X2 4R0 4B0 4R1 4B1 4R2 4B2",
         d2h="0D2H0 0D2H1 0D2H2 0DROP 2D2H0 2D2H1 2D2H2 2WD2H 2DROP 4D2H0 4D2H1 4D2H2 4WD2H 4DROP"),
    _dev(weights="1LOAD.c0 1LOAD.c1 1LOAD.c2 3LOAD.c0 3LOAD.c1 3LOAD.c2",
         h2d="1H2D0 1H2D1 1H2D2 3H2D0 3GH2D0 3H2D1 3GH2D1 3H2D2 3GH2D2",
         compute="1F0 1F1 1F2 3R0 3B0 3R1 3B1 3R2 3B2",
         d2h="1D2H0 1D2H1 1D2H2 1DROP 3D2H0 3D2H1 3D2H2 3WD2H 3DROP"),
]
MAIN_EDGES = {
    # the first F waits for its input upload and the last chunk of its weights; later Fs only for
    # their upload (the chunks are before the first F on the stream)
    "0F0": ["0H2D0", "0LOAD.c2"],
    "0F2": ["0H2D2"],
    "0H2D0": [],  # the batch comes from the host
    # an F's H2D waits for the previous forward stage's D2H (host round trip, other device)
    "1H2D0": ["0D2H0"],
    "1H2D2": ["0D2H2"],
    "1F0": ["1H2D0", "1LOAD.c2"],
    "1F1": ["1H2D1"],
    # the fused tail (layer 3): input saved by forward stage 1 (layers 2..3)
    "2H2D0": ["1D2H0"],
    "2X0": ["2H2D0", "2LOAD.c2"],
    "2X1": ["2H2D1"],
    "2D2H1": ["2X1"],
    # early recompute: R waits only for its saved input (layer 1, saved by stage 0) and weights
    "3H2D0": ["0D2H0"],
    "3R0": ["3H2D0", "3LOAD.c2"],
    "3R1": ["3H2D1"],
    # B waits for its incoming gradient, uploaded after the previous backward stage's D2H
    "3B0": ["3GH2D0"],
    "3GH2D0": ["2D2H0"],
    "3GH2D2": ["2D2H2"],
    "3D2H2": ["3B2"],
    "4H2D1": [],  # layer 0's input: the batch, from the host
    "4R0": ["4H2D0", "4LOAD.c2"],
    "4GH2D2": ["3D2H2"],
    "4B2": ["4GH2D2"],
    # WD2H and DROP after the stage's last microbatch
    "0DROP": ["0F2"],
    "1DROP": ["1F2"],
    "2WD2H": ["2X2"],
    "2DROP": ["2X2"],
    "3WD2H": ["3B2"],
    "3DROP": ["3B2"],
    "4WD2H": ["4B2"],
    "4DROP": ["4B2"],
    # the first LOAD waits for nothing; prefetch chunk i waits for the current stage's i-th upload
    "0LOAD.c0": [],
    "0LOAD.c2": [],
    "2LOAD.c0": ["0H2D0"],
    "2LOAD.c1": ["0H2D1"],
    "2LOAD.c2": ["0H2D2"],
    "3LOAD.c1": ["1H2D1"],
    # a LOAD's first chunk also waits for the DROP two stages back on the device (its room)
    "4LOAD.c0": ["0DROP", "2H2D0"],
    "4LOAD.c1": ["2H2D1"],
    "4LOAD.c2": ["2H2D2"],
}


def test_main_case_table_and_edges():
    program = _main_program()
    assert _plan_strings(program.plan) == MAIN_PLAN
    assert program.recompute == "early"  # the default for RoundPipe plans
    assert program.as_strings() == MAIN_TABLE
    for op, edges in MAIN_EDGES.items():
        assert program.edges_of(op) == sorted(edges), op
        assert program.edges_of(Op.parse(op)) == sorted(edges)
    # bytes: 100 in chunks of at most 40; gradients as given
    assert [op.nbytes for op in program.streams[0]["weights"][:3]] == [40, 40, 20]
    wd2h = {str(op): op.nbytes for per in program.streams for op in per["d2h"] if op.kind is OpKind.WD2H}
    assert wd2h == {"2WD2H": 11, "3WD2H": 12, "4WD2H": 13}
    assert program.chunk_bytes == 40


def test_main_case_late_recompute_waits_for_gradient():
    program = _main_program(recompute="late")
    assert program.recompute == "late"
    assert program.as_strings() == MAIN_TABLE  # same streams, one more edge per R
    late = dict(MAIN_EDGES)
    late.update({"3R0": ["3GH2D0", "3H2D0", "3LOAD.c2"], "3R1": ["3GH2D1", "3H2D1"],
                 "4R0": ["4GH2D0", "4H2D0", "4LOAD.c2"], "4R2": ["4GH2D2", "4H2D2"]})
    for op, edges in late.items():
        assert program.edges_of(op) == sorted(edges), op
    assert program.edges_of("2X0") == ["2H2D0", "2LOAD.c2"]  # X is never recomputed


def test_main_case_no_recompute_structure():
    # recompute="none": no R; the B itself waits for input, gradient and weights
    program = _main_program(recompute="none", validate=False)
    table = [dict(MAIN_TABLE[0]), dict(MAIN_TABLE[1])]
    table[0]["compute"] = "0F0 0F1 0F2 2X0 2X1 2X2 4B0 4B1 4B2".split()
    table[1]["compute"] = "1F0 1F1 1F2 3B0 3B1 3B2".split()
    assert program.as_strings() == table
    assert program.edges_of("3B0") == ["3GH2D0", "3H2D0", "3LOAD.c2"]
    assert program.edges_of("3B1") == ["3GH2D1", "3H2D1"]
    assert program.edges_of("4B0") == ["4GH2D0", "4H2D0", "4LOAD.c2"]


def test_main_case_no_recompute_validates():
    # (at HEAD 418033c this raised: required_predecessors listed every B as its own predecessor)
    program = _main_program(recompute="none")
    assert program.validate() is program
    _check_program(program, program.plan, [100] * 5, [0, 0, 11, 12, 13], 40, "none")


def test_single_device_full_table():
    # one device, 2 microbatches; stages 0F(0..1) 1X(1) 2B(0); 100/50/30 bytes in 40-byte chunks
    stages = build_stages([range(0, 2)], [range(1, 2), range(0, 1)], fused_tail=True)
    plan = build_roundpipe_plan(stages, 1, 2)
    assert _plan_strings(plan) == ["0LOAD 1LOAD 0F0 0F1 0DROP 2LOAD 1X0 1X1 1DROP 2B0 2B1 2DROP".split()]
    program = lower(plan, stage_weight_bytes=[100, 50, 30], stage_grad_bytes=[0, 8, 9], chunk_bytes=40)
    assert program.as_strings() == [
        _dev(weights="0LOAD.c0 0LOAD.c1 0LOAD.c2 1LOAD.c0 1LOAD.c1 2LOAD.c0",
             h2d="0H2D0 0H2D1 1H2D0 1H2D1 2H2D0 2GH2D0 2H2D1 2GH2D1",
             compute="0F0 0F1 1X0 1X1 2R0 2B0 2R1 2B1",
             d2h="0D2H0 0D2H1 0DROP 1D2H0 1D2H1 1WD2H 1DROP 2D2H0 2D2H1 2WD2H 2DROP"),
    ]
    assert _all_edges(program) == _sorted_values({
        "0F0": ["0H2D0", "0LOAD.c2"], "0F1": ["0H2D1"],
        "0D2H0": ["0F0"], "0D2H1": ["0F1"], "0DROP": ["0F1"],
        "1LOAD.c0": ["0H2D0"], "1LOAD.c1": ["0H2D1"],
        "1H2D0": ["0D2H0"], "1H2D1": ["0D2H1"],
        "1X0": ["1H2D0", "1LOAD.c1"], "1X1": ["1H2D1"],
        "1D2H0": ["1X0"], "1D2H1": ["1X1"], "1WD2H": ["1X1"], "1DROP": ["1X1"],
        # one chunk: it waits for its room (0DROP) and the first upload of stage 1
        "2LOAD.c0": ["0DROP", "1H2D0"],
        "2R0": ["2H2D0", "2LOAD.c0"], "2R1": ["2H2D1"],
        "2GH2D0": ["1D2H0"], "2GH2D1": ["1D2H1"],
        "2B0": ["2GH2D0"], "2B1": ["2GH2D1"],
        "2D2H0": ["2B0"], "2D2H1": ["2B1"], "2WD2H": ["2B1"], "2DROP": ["2B1"],
    })
    assert [op.nbytes for op in program.streams[0]["weights"]] == [40, 40, 20, 40, 10, 30]


def _unfused_program() -> StreamProgram:
    stages = build_stages([range(0, 2), range(2, 4)], [range(2, 4), range(0, 2)], fused_tail=False)
    plan = build_roundpipe_plan(stages, 2, 2)
    return lower(plan, stage_weight_bytes=[80, 40, 41, 0], stage_grad_bytes=[0, 0, 41, 7], chunk_bytes=40)


def test_unfused_full_table_gradient_after_the_last_forward():
    # stages 0F(0..1) 1F(2..3) 2B(2..3) 3B(0..1); 80/40/41/0 bytes in 40-byte chunks: 2, 1, 2, 1
    program = _unfused_program()
    assert _plan_strings(program.plan) == ["0LOAD 2LOAD 0F0 0F1 0DROP 2B0 2B1 2DROP".split(),
                                           "1LOAD 3LOAD 1F0 1F1 1DROP 3B0 3B1 3DROP".split()]
    assert program.as_strings() == [
        _dev(weights="0LOAD.c0 0LOAD.c1 2LOAD.c0 2LOAD.c1",
             h2d="0H2D0 0H2D1 2H2D0 2GH2D0 2H2D1 2GH2D1",
             compute="0F0 0F1 2R0 2B0 2R1 2B1",
             d2h="0D2H0 0D2H1 0DROP 2D2H0 2D2H1 2WD2H 2DROP"),
        _dev(weights="1LOAD.c0 3LOAD.c0",
             h2d="1H2D0 1H2D1 3H2D0 3GH2D0 3H2D1 3GH2D1",
             compute="1F0 1F1 3R0 3B0 3R1 3B1",
             d2h="1D2H0 1D2H1 1DROP 3D2H0 3D2H1 3WD2H 3DROP"),
    ]
    assert _all_edges(program) == _sorted_values({
        "0F0": ["0H2D0", "0LOAD.c1"], "0F1": ["0H2D1"], "0D2H0": ["0F0"], "0D2H1": ["0F1"], "0DROP": ["0F1"],
        "2LOAD.c0": ["0H2D0"], "2LOAD.c1": ["0H2D1"],
        # stage 2 (layers 2..3) recomputes from layer 2's input: stage 0's output
        "2H2D0": ["0D2H0"], "2H2D1": ["0D2H1"],
        "2R0": ["2H2D0", "2LOAD.c1"], "2R1": ["2H2D1"],
        # the first backward stage (not fused): the host makes its gradient from the last forward
        # stage's output, so 2GH2D* waits for that download
        "2GH2D0": ["1D2H0"], "2GH2D1": ["1D2H1"],
        "2B0": ["2GH2D0"], "2B1": ["2GH2D1"],
        "2D2H0": ["2B0"], "2D2H1": ["2B1"], "2WD2H": ["2B1"], "2DROP": ["2B1"],
        "1H2D0": ["0D2H0"], "1H2D1": ["0D2H1"],
        "1F0": ["1H2D0", "1LOAD.c0"], "1F1": ["1H2D1"], "1D2H0": ["1F0"], "1D2H1": ["1F1"], "1DROP": ["1F1"],
        "3LOAD.c0": ["1H2D0"],
        "3R0": ["3H2D0", "3LOAD.c0"], "3R1": ["3H2D1"],
        "3GH2D0": ["2D2H0"], "3GH2D1": ["2D2H1"],
        "3B0": ["3GH2D0"], "3B1": ["3GH2D1"],
        "3D2H0": ["3B0"], "3D2H1": ["3B1"], "3WD2H": ["3B1"], "3DROP": ["3B1"],
    })
    assert program.edges_of("2GH2D0") == ["1D2H0"] and program.edges_of("2GH2D1") == ["1D2H1"]
    chunks = {str(op): op.nbytes for per in program.streams for op in per["weights"]}
    assert chunks == {"0LOAD.c0": 40, "0LOAD.c1": 40, "2LOAD.c0": 40, "2LOAD.c1": 1, "1LOAD.c0": 40, "3LOAD.c0": 0}
    wd2h = {str(op): op.nbytes for per in program.streams for op in per["d2h"] if op.kind is OpKind.WD2H}
    assert wd2h == {"2WD2H": 41, "3WD2H": 7}


def test_transparent_backward_phase_inputs_from_host():
    # plan.phase("backward") on its own: the saved inputs come from the host (no H2D edge); the
    # backward stage 4 is prefetched at once (stage 2 holds the other slot)
    phase = _main_plan().phase("backward")
    assert _plan_strings(phase) == ["2LOAD 4LOAD 2X0 2X1 2X2 2DROP 4B0 4B1 4B2 4DROP".split(),
                                    "3LOAD 3B0 3B1 3B2 3DROP".split()]
    program = lower(phase, stage_weight_bytes=[100] * 5, chunk_bytes=40)
    assert program.as_strings() == [
        _dev(weights="2LOAD.c0 2LOAD.c1 2LOAD.c2 4LOAD.c0 4LOAD.c1 4LOAD.c2",
             h2d="2H2D0 2H2D1 2H2D2 4H2D0 4GH2D0 4H2D1 4GH2D1 4H2D2 4GH2D2",
             compute="2X0 2X1 2X2 4R0 4B0 4R1 4B1 4R2 4B2",
             d2h="2D2H0 2D2H1 2D2H2 2WD2H 2DROP 4D2H0 4D2H1 4D2H2 4WD2H 4DROP"),
        _dev(weights="3LOAD.c0 3LOAD.c1 3LOAD.c2",
             h2d="3H2D0 3GH2D0 3H2D1 3GH2D1 3H2D2 3GH2D2",
             compute="3R0 3B0 3R1 3B1 3R2 3B2",
             d2h="3D2H0 3D2H1 3D2H2 3WD2H 3DROP"),
    ]
    for op in ("2H2D0", "2H2D2", "3H2D0", "3H2D1", "4H2D0"):
        assert program.edges_of(op) == [], op
    assert program.edges_of("2X0") == ["2H2D0", "2LOAD.c2"]
    assert program.edges_of("3R0") == ["3H2D0", "3LOAD.c2"]
    assert program.edges_of("3GH2D1") == ["2D2H1"]
    assert program.edges_of("4GH2D0") == ["3D2H0"]
    # no DROP before stage 4's LOAD on device 0: only the activation-priority edges
    assert [program.edges_of(f"4LOAD.c{c}") for c in range(3)] == [["2H2D0"], ["2H2D1"], ["2H2D2"]]
    assert [op.nbytes for op in program.streams[0]["d2h"] if op.kind is OpKind.WD2H] == [0, 0]


def test_rounds_table_round_suffixes():
    # rounds of 2 microbatches on 2 devices: round 1 continues the rotation (stage 0 on device 1)
    plan = build_roundpipe_plan(_fused_stages(), 2, 4, microbatches_per_round=2)
    assert _plan_strings(plan) == [
        "0LOAD 2LOAD 0F0 0F1 0DROP 4LOAD 2X0 2X1 2DROP 1LOAD 4B0 4B1 4DROP 3LOAD 1F2 1F3 1DROP 3B2 3B3 3DROP".split(),
        "1LOAD 3LOAD 1F0 1F1 1DROP 0LOAD 3B0 3B1 3DROP 2LOAD 0F2 0F3 0DROP 4LOAD 2X2 2X3 2DROP 4B2 4B3 4DROP".split(),
    ]
    program = lower(plan, stage_weight_bytes=[40, 40, 40, 40, 80], chunk_bytes=40)
    assert program.as_strings() == [
        _dev(weights="0LOAD.c0 2LOAD.c0 4LOAD.c0 4LOAD.c1 1LOAD.c0@1 3LOAD.c0@1",
             h2d="0H2D0 0H2D1 2H2D0 2H2D1 4H2D0 4GH2D0 4H2D1 4GH2D1 1H2D2 1H2D3 3H2D2 3GH2D2 3H2D3 3GH2D3",
             compute="0F0 0F1 2X0 2X1 4R0 4B0 4R1 4B1 1F2 1F3 3R2 3B2 3R3 3B3",
             d2h="0D2H0 0D2H1 0DROP 2D2H0 2D2H1 2WD2H 2DROP 4D2H0 4D2H1 4WD2H 4DROP"
                 " 1D2H2 1D2H3 1DROP@1 3D2H2 3D2H3 3WD2H@1 3DROP@1"),
        _dev(weights="1LOAD.c0 3LOAD.c0 0LOAD.c0@1 2LOAD.c0@1 4LOAD.c0@1 4LOAD.c1@1",
             h2d="1H2D0 1H2D1 3H2D0 3GH2D0 3H2D1 3GH2D1 0H2D2 0H2D3 2H2D2 2H2D3 4H2D2 4GH2D2 4H2D3 4GH2D3",
             compute="1F0 1F1 3R0 3B0 3R1 3B1 0F2 0F3 2X2 2X3 4R2 4B2 4R3 4B3",
             d2h="1D2H0 1D2H1 1DROP 3D2H0 3D2H1 3WD2H 3DROP 0D2H2 0D2H3 0DROP@1"
                 " 2D2H2 2D2H3 2WD2H@1 2DROP@1 4D2H2 4D2H3 4WD2H@1 4DROP@1"),
    ]
    edges = {
        # round 1 of stage 1 on device 0: room is 2DROP (released just before it in the plan); its
        # single chunk waits for the first upload of stage 4, which runs before it
        "1LOAD.c0@1": ["2DROP", "4H2D0"],
        "1F2": ["1H2D2", "1LOAD.c0@1"],
        "1H2D2": ["0D2H2"],
        "1DROP@1": ["1F3"],
        "3LOAD.c0@1": ["1H2D2", "4DROP"],
        "3R2": ["3H2D2", "3LOAD.c0@1"],
        "3WD2H@1": ["3B3"],
        "0LOAD.c0@1": ["1DROP", "3H2D0"],
        "0F2": ["0H2D2", "0LOAD.c0@1"],
        "4LOAD.c0@1": ["0DROP@1", "2H2D2"],
        "4LOAD.c1@1": ["2H2D3"],
        "4R2": ["4H2D2", "4LOAD.c1@1"],
        "4GH2D2": ["3D2H2"],
        "2H2D2": ["1D2H2"],
    }
    for op, want in edges.items():
        assert program.edges_of(op) == sorted(want), op
    rounds = {(op.stage_index, op.round_index) for per in program.streams for op in per["weights"]}
    assert rounds == {(s, r) for s in range(5) for r in range(2)}


# ============================================================================ 2. property tests
PROPERTY_CASES = [(D, M) for D in range(1, 5) for M in range(1, 2 * D + 2)]


def _bytes(rng: random.Random, plan: ExecutionPlan):
    weights = [rng.choice([0, rng.randint(1, 400), rng.randint(1, 40)]) for _ in plan.stages]
    grads = [rng.randint(0, 300) if s.kind == "backward" else 0 for s in plan.stages]
    return weights, grads, rng.randint(1, 90)


@pytest.mark.parametrize("rounds", [False, True], ids=["one_round", "rounds_of_D"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("D,M", PROPERTY_CASES)
def test_lowering_properties(D, M, fused, rounds):
    for L in (2, 4, 7):
        stages = build_stages(*default_stage_ranges(L), fused_tail=fused)
        for prefetch in ((True, False) if L == 4 else (True,)):
            for recompute in (("early", "late") if L == 7 else ("early",)):
                rng = random.Random(f"{D}-{M}-{L}-{fused}-{rounds}-{prefetch}-{recompute}")
                cursor = rng.randrange(D)
                plan = build_roundpipe_plan(stages, D, M, cursor=cursor, prefetch=prefetch,
                                            microbatches_per_round=D if rounds else None)
                assert plan.max_resident_stages == (2 if prefetch else 1)
                weights, grads, chunk = _bytes(rng, plan)
                program = lower(plan, stage_weight_bytes=weights, stage_grad_bytes=grads, chunk_bytes=chunk,
                                recompute=None if recompute == "early" else recompute)
                _check_program(program, plan, weights, grads, chunk, recompute)
                # round suffixes: per-stage ops of round r >= 1 carry "@r"; per-microbatch ops never
                n_rounds = math.ceil(M / D) if rounds else 1
                flat = [x for per in program.as_strings() for s in STREAMS for x in per[s]]
                suffixed = {x for x in flat if "@" in x}
                assert all(re.fullmatch(r"\d+(LOAD\.c\d+|WD2H|DROP)@[1-9]\d*", x) for x in suffixed)
                want = {f"{s.stage_index}DROP@{r}" for s in stages for r in range(1, n_rounds)}
                assert {x for x in suffixed if "DROP" in x and "WD2H" not in x} == want
                assert {x for x in suffixed if "LOAD.c0@" in x} == {w.replace("DROP", "LOAD.c0") for w in want}
                assert {x for x in flat if x.endswith("DROP")} == {f"{s.stage_index}DROP" for s in stages}


@pytest.mark.parametrize("D,M", [(1, 3), (2, 4), (3, 2)])
def test_transparent_phases_properties(D, M):
    plan = build_roundpipe_plan(build_stages(*default_stage_ranges(7), fused_tail=True), D, M, cursor=D - 1)
    for kind in ("forward", "backward"):
        phase = plan.phase(kind)
        weights = [100 + 7 * s for s in range(len(phase.stages))]
        grads = [13 * s for s in range(len(phase.stages))]
        program = lower(phase, stage_weight_bytes=weights, stage_grad_bytes=grads, chunk_bytes=64)
        _check_program(program, phase, weights, grads, 64, "early")
        if kind == "backward":
            # nothing forward runs in this program: every saved input comes from the host
            for per in program.streams:
                assert all(program.edges_of(op) == [] for op in per["h2d"] if op.kind is OpKind.H2D)


def test_default_bytes_one_empty_chunk_per_load():
    plan = build_roundpipe_plan(build_stages(*default_stage_ranges(4), fused_tail=True), 2, 3)
    program = lower(plan)
    _check_program(program, plan, [0] * len(plan.stages), None, program.chunk_bytes, "early")
    assert program.chunk_bytes == 64 * 2**20
    for per in program.streams:
        assert all(op.chunk_index == 0 and op.nbytes == 0 for op in per["weights"])
        assert all(op.nbytes == 0 for op in per["d2h"] if op.kind is OpKind.WD2H)


@pytest.mark.parametrize("L,D,M", [(2, 3, 4), (3, 4, 5), (1, 2, 3)])
def test_rounds_stage_count_divides_devices(L, D, M):
    """A device that gets the same stage in two consecutive rounds loads it again after the DROP
    (no prefetch of a stage that is still resident)."""
    stages = build_stages(*default_stage_ranges(L), fused_tail=True)
    assert D % len(stages) == 0
    plan = build_roundpipe_plan(stages, D, M, microbatches_per_round=D)
    program = lower(plan, stage_weight_bytes=[10] * len(stages), chunk_bytes=4)
    for acts in plan.actions:
        resident: set[int] = set()
        for a in acts:
            if a.kind is ActionKind.LOAD:
                assert a.stage_index not in resident
                resident.add(a.stage_index)
            elif a.kind is ActionKind.DROP:
                resident.discard(a.stage_index)
    assert program.topological_order()


# ================================================================== 3. removing required edges
def _small_programs():
    return {
        "main": _main_program(),
        "unfused": _unfused_program(),
        "rounds": lower(build_roundpipe_plan(_fused_stages(), 2, 4, microbatches_per_round=2),
                        stage_weight_bytes=[100, 40, 80, 40, 120], chunk_bytes=40),
        "no_prefetch": lower(build_roundpipe_plan(_fused_stages(), 2, 2, prefetch=False),
                             stage_weight_bytes=[100] * 5, chunk_bytes=40),
    }


# Required edges of the main program that other edges and stream order imply as well (so removing
# one alone is accepted): a DROP / WD2H sits on the d2h stream after the D2H of the stage's last
# microbatch, which waits for that compute; and device 1 uploads 1H2Dm (after 0D2Hm) before 3H2Dm.
MAIN_IMPLIED = {
    ("0DROP", "0F2"), ("1DROP", "1F2"), ("2WD2H", "2X2"), ("2DROP", "2X2"), ("3WD2H", "3B2"),
    ("3DROP", "3B2"), ("4WD2H", "4B2"), ("4DROP", "4B2"),
    ("3H2D0", "0D2H0"), ("3H2D1", "0D2H1"), ("3H2D2", "0D2H2"),
}


@pytest.mark.parametrize("name", ["main", "unfused", "rounds", "no_prefetch"])
def test_removing_a_required_edge_is_refused(name):
    program = _small_programs()[name]
    refused, implied, optional = 0, set(), 0
    for consumer, producers in program.deps.items():
        required = required_predecessors(program, consumer)
        for producer in producers:
            reduced = program.without_edge(consumer, producer)
            assert producer not in reduced.deps.get(consumer, ())
            if producer not in required:
                # only activation-priority edges (a chunk waiting for an activation upload) are optional
                assert consumer.kind is OpKind.LOAD and producer.kind in (OpKind.H2D, OpKind.GH2D)
                assert reduced.validate() is reduced
                optional += 1
                continue
            still = _reachability(program, drop=(consumer, producer))(producer, consumer)
            if still:
                assert reduced.validate() is reduced
                implied.add((str(consumer), str(producer)))
                continue
            with pytest.raises(PlanValidationError) as info:
                reduced.validate()
            message = str(info.value)
            assert f"missing edge `{producer}` -> `{consumer}`" in message
            assert f">{consumer}<" in message  # the grid marks the failing op
            assert "dev0/weights" in message and "dev1/d2h" in message
            refused += 1
    assert refused >= 25
    # without prefetch a LOAD comes right before its stage's computes: no priority edges
    assert (optional == 0) if name == "no_prefetch" else (optional >= 1)
    if name == "main":
        assert implied == MAIN_IMPLIED
        assert refused == 54 and optional == 9


def test_priority_edges_are_optional_all_at_once():
    program = _main_program()
    deps = {op: tuple(p for p in ps if not (op.kind is OpKind.LOAD and p.kind in (OpKind.H2D, OpKind.GH2D)))
            for op, ps in program.deps.items()}
    stripped = StreamProgram(program.plan, program.streams, deps, program.chunk_bytes, program.recompute)
    assert stripped.validate() is stripped
    assert stripped.edges_of("4LOAD.c0") == ["0DROP"] and stripped.edges_of("2LOAD.c1") == []


def test_missing_edge_message_names_it():
    program = _main_program()
    with pytest.raises(PlanValidationError, match=r"`3R0` may start before `3H2D0` finishes") as info:
        program.without_edge("3R0", "3H2D0").validate()
    assert ">3R0<" in str(info.value)
    with pytest.raises(PlanValidationError, match=r"missing edge `0DROP` -> `4LOAD\.c0`"):
        program.without_edge("4LOAD.c0", "0DROP").validate()
    with pytest.raises(KeyError, match="no edge"):
        program.without_edge("3R0", "0F0")


# ========================================================================== 4. bad input
@pytest.mark.parametrize("chunk_bytes", [0, -1, 1.5, True, "64"])
def test_bad_chunk_bytes(chunk_bytes):
    with pytest.raises(ValueError, match="chunk_bytes"):
        lower(_main_plan(), chunk_bytes=chunk_bytes)


def test_bad_recompute_and_byte_lists():
    plan = _main_plan()
    with pytest.raises(ValueError, match="recompute"):
        lower(plan, recompute="sometimes")
    with pytest.raises(ValueError, match="stage_weight_bytes"):
        lower(plan, stage_weight_bytes=[1, 2, 3])
    with pytest.raises(ValueError, match="stage_grad_bytes"):
        lower(plan, stage_grad_bytes=[1] * 6)


def test_op_parse_round_trips_every_op():
    for program in _small_programs().values():
        for _, _, _, op in program.ops():
            text = str(op)
            assert Op.parse(text) == op and str(Op.parse(text)) == text
    assert Op.parse("0LOAD.c2@3") == Op(OpKind.LOAD, 0, None, 2, 3)
    assert Op.parse(" 12GH2D10 ") == Op(OpKind.GH2D, 12, 10)
    assert str(Op(OpKind.DROP, 5, round_index=1)) == "5DROP@1"


@pytest.mark.parametrize("text", ["", "F1", "3Q1", "3f1", "3F", "3H2D", "0LOAD", "0LOAD.c", "3DROP5", "3WD2H1",
                                  "3F1.c2", "3 F1", "3F-1", "-3F1", "x3F1", "0LOAD.c1.c2", "3DROP@"])
def test_op_parse_rejects_garbage(text):
    with pytest.raises(ValueError):
        Op.parse(text)


def test_op_parse_rejects_round_on_microbatch_op():
    with pytest.raises(ValueError):
        Op.parse("3F1@1")


def _replace(program: StreamProgram, streams=None, deps=None) -> StreamProgram:
    return StreamProgram(program.plan, program.streams if streams is None else streams,
                         program.deps if deps is None else deps, program.chunk_bytes, program.recompute)


def test_validate_refuses_edge_to_unknown_op():
    program = _main_program()
    deps = dict(program.deps)
    deps[Op.parse("1F1")] = deps[Op.parse("1F1")] + (Op.parse("0F7"),)
    with pytest.raises(PlanValidationError, match=r"`1F1` waits for `0F7`, which no stream runs") as info:
        _replace(program, deps=deps).validate()
    assert ">1F1<" in str(info.value)


def test_validate_refuses_op_on_wrong_stream():
    program = _main_program()
    streams = [dict(per) for per in program.streams]
    moved = Op.parse("0H2D1")
    streams[0]["h2d"] = tuple(op for op in streams[0]["h2d"] if op != moved)
    streams[0]["weights"] = streams[0]["weights"] + (moved,)
    with pytest.raises(PlanValidationError, match=r"`0H2D1` sits on stream `weights`, its kind runs on `h2d`") as info:
        _replace(program, streams=tuple(streams)).validate()
    assert ">0H2D1<" in str(info.value)


def test_validate_refuses_duplicate_op():
    program = _main_program()
    streams = [dict(per) for per in program.streams]
    streams[1]["compute"] = streams[1]["compute"] + (Op.parse("1F0"),)
    with pytest.raises(PlanValidationError, match="`1F0` appears twice"):
        _replace(program, streams=tuple(streams)).validate()


def test_validate_refuses_deadlock():
    program = _main_program()
    deps = dict(program.deps)
    # 0F0 waits for 0D2H2, which waits for 0F2, which comes after 0F0 on the compute stream
    deps[Op.parse("0F0")] = deps[Op.parse("0F0")] + (Op.parse("0D2H2"),)
    bad = _replace(program, deps=deps)
    with pytest.raises(PlanValidationError, match="deadlock") as info:
        bad.validate()
    message = str(info.value)
    assert "dev0/compute: `0F0` waits for ['0D2H2']" in message
    marked = re.search(r">(\d+[A-Za-z0-9.@]+)<", message)  # a blocked stream head marked in the grid
    assert marked and f"`{marked.group(1)}` waits for" in message
    with pytest.raises(PlanValidationError, match="deadlock"):
        _replace(program, deps=deps).topological_order()


def test_validate_returns_program_and_lower_validate_flag():
    unchecked = _main_program(validate=False)
    assert unchecked.validate() is unchecked
    assert unchecked.as_strings() == MAIN_TABLE


# ============================================================================= 5. baselines
BASELINE_CASES = [(name, D, M) for name in ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "looped_bfs")
                  for D in (1, 2, 3) for M in (1, 2, 3, 4, 6)
                  if not (name == "interleaved_1f1b" and M % max(1, M // D))]


def _baseline(name: str, D: int, M: int, recompute: bool) -> ExecutionPlan:
    chunks = 2 if name in ("interleaved_1f1b", "looped_bfs") else 1
    return build_baseline_plan(name, [range(i, i + 1) for i in range(D * chunks)], D, M, recompute=recompute)


@pytest.mark.parametrize("name,D,M", BASELINE_CASES)
def test_baselines_lower_late_recompute(name, D, M):
    plan = _baseline(name, D, M, recompute=True)
    rng = random.Random(f"{name}-{D}-{M}")
    weights, grads, chunk = _bytes(rng, plan)
    program = lower(plan, stage_weight_bytes=weights, stage_grad_bytes=grads, chunk_bytes=chunk)
    assert program.recompute == "late"  # bound baselines with _meta["recompute"] default to "late"
    _check_program(program, plan, weights, grads, chunk, "late")
    for per in program.streams:
        compute = per["compute"]
        for i, op in enumerate(compute):
            if op.kind is OpKind.B:
                assert compute[i - 1] == Op(OpKind.R, op.stage_index, op.microbatch_index)
            if op.kind is OpKind.R:
                assert Op(OpKind.GH2D, op.stage_index, op.microbatch_index) in program.deps[op]
    n_w = sum(op.kind is OpKind.W for per in program.streams for op in per["compute"])
    assert n_w == (len(plan.stages) // 2 * M if name == "zb_h1" else 0)


@pytest.mark.parametrize("name,D,M", [c for c in BASELINE_CASES if c[1] == 2])
def test_baselines_without_recompute_structure(name, D, M):
    plan = _baseline(name, D, M, recompute=False)
    weights = [30 + s for s in range(len(plan.stages))]
    program = lower(plan, stage_weight_bytes=weights, chunk_bytes=16)
    assert program.recompute == "none"  # _meta["recompute"] False -> no R ops
    _check_program(program, plan, weights, None, 16, "none")
    assert not any(op.kind is OpKind.R for per in program.streams for op in per["compute"])
    for per in program.streams:
        for op in per["compute"]:
            if op.kind is OpKind.B:
                deps = set(program.deps[op])
                assert {Op(OpKind.H2D, op.stage_index, op.microbatch_index),
                        Op(OpKind.GH2D, op.stage_index, op.microbatch_index)} <= deps


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "looped_bfs"])
def test_baselines_without_recompute_validate(name):
    # (at HEAD 418033c this raised: required_predecessors listed every B as its own predecessor)
    program = lower(_baseline(name, 2, 4, recompute=False))
    assert program.recompute == "none" and program.validate() is program
