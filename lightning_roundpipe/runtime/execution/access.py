"""What each op of a stream program reads and writes: the checking mode's view of the executor.

For every op the executor issues, :func:`op_access` names the buffers its handler touches
(:class:`~lightning_roundpipe.runtime.backends.checker.Access`), from the op's meaning and the plan,
never from the program's edges (so a missing edge shows):

- device slots, keyed ``("in" | "gin" | "out" | "graph", stage_index, microbatch_index)``: the input
  an ``H2D`` uploads for ``F``/``X``/``R``, the gradient a ``GH2D`` uploads for ``B``, what a compute op
  leaves for its ``D2H``, the autograd graph an ``R`` leaves for its ``B``;
- host buffers, keyed ``("act", layer_index, microbatch_index)`` (a boundary activation a ``D2H`` wrote)
  and ``("grad", layer_index, microbatch_index)`` (an input gradient a ``D2H`` wrote); declared only
  when their producer is in the same program (earlier programs have completed);
- the stage weight pool, ``("weights", device_index, slot)``: ``LOAD`` chunks fill it (tag
  ``(stage_index, round_index, chunk_index)``), compute ops read it complete (tag of the last chunk),
  the ``DROP`` releases it; the stage's gradient accumulator ``("accum", stage_index, round_index)``:
  written by ``X``/``B``, read by ``WD2H``, released by the ``DROP``.
"""

from __future__ import annotations

from lightning_roundpipe.runtime.backends.checker import Access
from lightning_roundpipe.runtime.backends.pool import pool_slots
from lightning_roundpipe.schedule.lower import gradient_producer, input_producer, plan_dispatches
from lightning_roundpipe.schedule.program import Op, OpKind, StreamProgram


def round_of(program: StreamProgram) -> dict[tuple[int, int], int]:
    """``(stage_index, microbatch_index) -> round_index`` of the dispatch that computes it (cached)."""
    rounds = program._cache.get("round_of")
    if rounds is None:
        rounds = program._cache["round_of"] = {
            (d.stage_index, a.microbatch_index): d.round_index for d in plan_dispatches(program.plan) for a in d.computes}
    return rounds


def _last_chunks(program: StreamProgram) -> dict[tuple[int, int], int]:
    table = program._cache.get("last_chunk")
    if table is None:
        table = {}
        for _, _, _, op in program.ops():
            if op.kind is OpKind.LOAD:
                key = (op.stage_index, op.round_index)
                table[key] = max(table.get(key, 0), op.chunk_index)
        program._cache["last_chunk"] = table
    return table


def _present(program: StreamProgram, op: Op) -> bool:
    try:
        program.location(op)
    except KeyError:
        return False
    return True


def _dispatch_computes(program: StreamProgram) -> dict[tuple[int, int, int], list]:
    table = program._cache.get("dispatch_computes")
    if table is None:
        table = program._cache["dispatch_computes"] = {
            (d.device_index, d.stage_index, d.round_index): d.computes for d in plan_dispatches(program.plan)}
    return table


def _first_op(program: StreamProgram, action) -> Op:
    """The compute op that reads the stage's weights for one plan action (a ``B`` also reads them
    in its ``R``; the ``B`` comes later on the same stream, so the ``B`` stands for both)."""
    return Op(OpKind(action.kind.value), action.stage_index, action.microbatch_index)


def op_access(program: StreamProgram, op: Op, device_index: int, num_layers: int, keep: frozenset) -> Access:
    """The buffers ``op`` (run on ``device_index``) reads, writes, fills and releases.

    Args:
        program: the stream program being run.
        op: one of its ops.
        device_index: the device whose stream runs ``op``.
        num_layers: layers of the model (the last stage's output is the model's output).
        keep: layer indices whose inputs the backward needs (saved boundaries a forward ``D2H`` writes).
    """
    plan = program.plan
    spec = plan.stages[op.stage_index]
    s, m, kind = op.stage_index, op.microbatch_index, op.kind
    r = op.round_index if not kind.per_microbatch else round_of(program)[(s, m)]
    weights = ("weights", device_index, pool_slots(plan)[(device_index, s, r)])
    complete = (s, r, _last_chunks(program)[(s, r)])
    if kind is OpKind.LOAD:
        return Access(fills=((weights, (s, r, op.chunk_index)),))
    if kind is OpKind.H2D:
        producer = input_producer(plan, s)
        reads = ()
        if spec.layers.start > 0 and producer is not None and _present(program, Op(OpKind.D2H, producer, m)):
            reads = ((("act", spec.layers.start, m), None),)
        return Access(reads=reads, writes=((("in", s, m), None),))
    if kind is OpKind.GH2D:
        source = gradient_producer(plan, s)
        reads = ()
        if (spec.layers.stop < num_layers and source is not None and plan.stages[source].kind != "forward"
                and _present(program, Op(OpKind.D2H, source, m))):
            reads = ((("grad", spec.layers.stop, m), None),)
        return Access(reads=reads, writes=((("gin", s, m), None),))
    if kind is OpKind.F:
        return Access(reads=((("in", s, m), None), (weights, complete)), writes=((("out", s, m), None),))
    if kind is OpKind.X:
        return Access(reads=((("in", s, m), None), (weights, complete)),
                      writes=((("out", s, m), None), (("accum", s, r), (s, r, m))))
    if kind is OpKind.R:
        return Access(reads=((("in", s, m), None), (weights, complete)), writes=((("graph", s, m), None),))
    if kind is OpKind.B:
        return Access(reads=((("graph", s, m), None), (("gin", s, m), None), (weights, complete)),
                      writes=((("out", s, m), None), (("accum", s, r), (s, r, m))))
    if kind is OpKind.D2H:
        if spec.kind == "forward" and not spec.fused:
            saved = tuple((("act", li, m), None) for li in spec.layers if li != spec.layers.start and li in keep)
            out = ("final", m) if spec.layers.stop == num_layers else ("act", spec.layers.stop, m)
            return Access(reads=((("out", s, m), None),), writes=saved + ((out, None),))
        return Access(reads=((("out", s, m), None),), writes=((("grad", spec.layers.start, m), None),))
    computes = _dispatch_computes(program)[(device_index, s, r)]
    if kind is OpKind.WD2H:
        return Access(reads=((("accum", s, r), (s, r, computes[-1].microbatch_index)),))
    if kind is OpKind.DROP:
        wd2h = Op(OpKind.WD2H, s, None, None, r)
        has_grads = spec.kind == "backward" and _present(program, wd2h)
        readers = tuple(str(_first_op(program, action)) for action in computes)
        return Access(releases=((weights, readers),) + (((("accum", s, r), (str(wd2h),)),) if has_grads else ()))
    return Access()
