"""What each op of a stream program reads and writes: the checking mode's view of the executor.

For every op the executor issues, :func:`op_access` names the buffers its handler touches
(:class:`~lightning_roundpipe.runtime.backends.checker.Access`), from the op's meaning and the plan,
never from the program's edges (so a missing edge shows):

- the device transfer pool, ``("xfer", device_index, slot)``: an ``H2D``/``GH2D`` refills it with its
  content (tag ``("in" | "gin", stage_index, microbatch_index)``,
  :mod:`~lightning_roundpipe.schedule.buffers`) after the readers of the slot's previous
  content; the compute op reads it holding that tag, so do an ``F``'s ``D2H`` (outputs may pass
  input tensors through) and the ``B`` after an ``R`` (its graph keeps the input);
- device results, keyed ``("out" | "graph", stage_index, microbatch_index)``: what a compute op leaves
  for its ``D2H``, the autograd graph an ``R`` leaves for its ``B`` (the compute stream's own memory);
- host buffers, keyed ``("act", layer_index, microbatch_index)`` (a boundary activation a ``D2H`` wrote)
  and ``("grad", layer_index, microbatch_index)`` (an input gradient a ``D2H`` wrote); declared only
  when their producer is in the same program (earlier programs have completed); those read only
  inside the program live in the host staging slots ``("host", slot)``, which the ``D2H`` refills and
  the uploads read with the content's tag;
- the stage weight pool, ``("weights", device_index, slot)``: ``LOAD`` chunks fill it (tag
  ``(stage_index, round_index, chunk_index)``), compute ops read it complete (tag of the last chunk),
  the ``DROP`` releases it; the fp32 gradient accumulator of the same slot ``("accum", device_index,
  slot)``: filled by ``X``/``B`` (tag ``(stage_index, round_index, microbatch_index)``), read by
  ``WD2H``, released by the ``DROP``.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_roundpipe.runtime.backends.checker import Access
from lightning_roundpipe.runtime.backends.pool import pool_slots
from lightning_roundpipe.schedule.buffers import device_slots, download_contents, host_slots
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
    slot = pool_slots(plan)[(device_index, s, r)]
    weights, accum = ("weights", device_index, slot), ("accum", device_index, slot)
    complete = (s, r, _last_chunks(program)[(s, r)])
    transfers = device_slots(program)[device_index]
    hosted, _ = host_slots(program, num_layers, keep)

    def xfer(content: tuple) -> tuple:
        return (("xfer", device_index, transfers.slots[content]), content)

    def host_read(content: tuple) -> tuple:
        return ((("host", hosted.slots[content]), content),) if content in hosted.slots else ()

    def refill(content: tuple) -> tuple:
        return xfer(content) + (transfers.previous[content], tuple(map(str, transfers.readers_before(content))))

    if kind is OpKind.LOAD:
        return Access(fills=((weights, (s, r, op.chunk_index)),))
    if kind is OpKind.H2D:
        producer = input_producer(plan, s)
        reads = ()
        if spec.layers.start > 0 and producer is not None and _present(program, Op(OpKind.D2H, producer, m)):
            reads = ((("act", spec.layers.start, m), None),) + host_read(("act", spec.layers.start, m))
        return Access(reads=reads, refills=(refill(("in", s, m)),))
    if kind is OpKind.GH2D:
        source = gradient_producer(plan, s)
        reads = ()
        if (spec.layers.stop < num_layers and source is not None and plan.stages[source].kind != "forward"
                and _present(program, Op(OpKind.D2H, source, m))):
            reads = ((("grad", spec.layers.stop, m), None),) + host_read(("grad", spec.layers.stop, m))
        return Access(reads=reads, refills=(refill(("gin", s, m)),))
    if kind is OpKind.F:
        return Access(reads=(xfer(("in", s, m)), (weights, complete)), writes=((("out", s, m), None),))
    if kind is OpKind.X:
        return Access(reads=(xfer(("in", s, m)), (weights, complete)), writes=((("out", s, m), None),),
                      fills=((accum, (s, r, m)),))
    if kind is OpKind.R:
        return Access(reads=(xfer(("in", s, m)), (weights, complete)), writes=((("graph", s, m), None),))
    if kind is OpKind.B:
        inputs = (xfer(("in", s, m)),) if ("in", s, m) in transfers.slots else ()
        return Access(reads=((("graph", s, m), None), xfer(("gin", s, m)), (weights, complete)) + inputs,
                      writes=((("out", s, m), None),), fills=((accum, (s, r, m)),))
    if kind is OpKind.D2H:
        refills = tuple((("host", hosted.slots[c]), c, hosted.previous[c], tuple(map(str, hosted.readers_before(c))))
                        for c in download_contents(program, op, num_layers, keep) if c in hosted.slots)
        if spec.kind == "forward" and not spec.fused:
            saved = tuple((("act", li, m), None) for li in spec.layers if li != spec.layers.start and li in keep)
            out = ("final", m) if spec.layers.stop == num_layers else ("act", spec.layers.stop, m)
            return Access(reads=((("out", s, m), None), xfer(("in", s, m))), writes=saved + ((out, None),),
                          refills=refills)
        return Access(reads=((("out", s, m), None),), writes=((("grad", spec.layers.start, m), None),),
                      refills=refills)
    computes = _dispatch_computes(program)[(device_index, s, r)]
    if kind is OpKind.WD2H:
        return Access(reads=((accum, (s, r, computes[-1].microbatch_index)),))
    if kind is OpKind.DROP:
        wd2h = Op(OpKind.WD2H, s, None, None, r)
        has_grads = spec.kind == "backward" and _present(program, wd2h)
        readers = tuple(str(_first_op(program, action)) for action in computes)
        return Access(releases=((weights, readers),) + (((accum, (str(wd2h),)),) if has_grads else ()))
    return Access()


def in_bank(access: Access, bank: int) -> Access:
    """``access`` with every buffer key of pool bank ``bank > 0`` prefixed ``"bank{bank}"``: a program
    issued while the previous one drains uses the other bank's pools
    (:mod:`~lightning_roundpipe.runtime.execution.overlap`), and its per-program keys (``("out", stage,
    microbatch)``...) are its own. Bank 0 keeps the keys as they are."""
    if bank == 0:
        return access
    prefix = f"bank{bank}"
    return replace(access, reads=tuple(((prefix, k), t) for k, t in access.reads),
                   writes=tuple(((prefix, k), t) for k, t in access.writes),
                   fills=tuple(((prefix, k), t) for k, t in access.fills),
                   releases=tuple(((prefix, k), r) for k, r in access.releases),
                   refills=tuple(((prefix, k), t, p, r) for k, t, p, r in access.refills))
