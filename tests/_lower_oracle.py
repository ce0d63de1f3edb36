"""The lowering tests' oracle (``test_lower.py``, ``test_lower_properties.py``): expected edges, reachability
and residency computed here from the rules of ``schedule/lower.py``'s module docstring, independently of
``StreamProgram``'s own walk and vector clocks (never by the code under test)."""
from __future__ import annotations

import math

from lightning_roundpipe.schedule.ir import ActionKind
from lightning_roundpipe.schedule.plan import ExecutionPlan
from lightning_roundpipe.schedule.program import STREAMS, Op, OpKind, StreamProgram


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
