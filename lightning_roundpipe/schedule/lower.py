"""Pure lowering passes: compute plan -> :class:`~lightning_roundpipe.schedule.program.StreamProgram`.

In the style of ``torch.distributed.pipelining``'s ``_add_unshard_reshard`` / ``_add_send_recv``
passes, each pass adds one concern to a draft of per-device stream lists and edges
(DESIGN.md section 9; RoundPipe paper, arXiv 2604.27085, section 3.3):

1. :func:`_add_compute`: the ``compute`` stream, in the plan's order; a ``B`` becomes ``R`` (the
   recompute from the saved stage input) then ``B`` (the backward).
2. :func:`_add_activation_transfers`: before each ``F``/``X``/``R`` an ``H2D`` of its input, before
   each ``B`` a ``GH2D`` of its incoming gradient, after each ``F``/``X``/``B`` a ``D2H`` of what
   it sends to the host; an upload waits for the download that produced its data (on any device:
   activations go GPU -> host -> GPU). With ``recompute="early"`` the ``R`` waits only for the
   saved input, the ``B`` for the gradient (a backward stage recomputes before its gradient
   arrives); ``"late"`` makes the ``R`` wait for the gradient too (autograd checkpointing).
3. :func:`_add_weight_transfers`: each ``LOAD`` of the plan becomes ``ceil(bytes / chunk_bytes)``
   chunks on the ``weights`` stream; a stage's first compute waits for its last chunk; the stage's
   ``WD2H`` (gradients, after its last microbatch) and ``DROP`` follow on the ``d2h`` stream; the
   first chunk of a ``LOAD`` waits for the ``DROP`` listed before it in the plan, so at most
   ``plan.max_resident_stages`` stages are resident (two: the next stage is prefetched while the
   current one computes).
4. :func:`_add_activation_priority`: activations before weights: chunk ``i`` of a prefetch waits
   for the ``i``-th activation upload the device will need before the prefetched stage runs.

Pure: no torch, no devices.
"""

from __future__ import annotations

import math
from typing import Sequence

from lightning_roundpipe.schedule.ir import Action, ActionKind
# `Dispatch`, `plan_dispatches` and the producers live in plan.py, `required_predecessors` in program.py (which
# validates with it); they are re-exported here, their import path before program.py stopped importing lower.py
from lightning_roundpipe.schedule.plan import (Dispatch, ExecutionPlan, PlanValidationError, gradient_producer,  # noqa: F401
                                               input_producer, plan_dispatches)
from lightning_roundpipe.schedule.program import STREAMS, Op, OpKind, StreamProgram, required_predecessors  # noqa: F401

#: Default largest weight chunk, bytes (64 MiB).
DEFAULT_CHUNK_BYTES = 64 * 2**20
RECOMPUTE_MODES = ("early", "late", "none")

__all__ = ["DEFAULT_CHUNK_BYTES", "RECOMPUTE_MODES", "Dispatch", "input_producer", "gradient_producer", "lower",
           "plan_dispatches", "required_predecessors"]


class _Draft:
    """Mutable per-device stream lists and edges that the passes fill."""

    def __init__(self, plan: ExecutionPlan, recompute: str) -> None:
        self.plan = plan
        self.recompute = recompute
        self.streams: list[dict[str, list[Op]]] = [{s: [] for s in STREAMS} for _ in plan.actions]
        self.deps: dict[Op, list[Op]] = {}
        self.after: dict[tuple[int, Op | None], list[Op]] = {}
        self.chunks: dict[tuple[int, int], list[Op]] = {}  # d2h ops to insert after an op (None: at the end)

    def edge(self, consumer: Op, producer: Op) -> None:
        self.deps.setdefault(consumer, []).append(producer)

    def freeze(self, chunk_bytes: int) -> StreamProgram:
        if self.after:
            for d, per in enumerate(self.streams):
                merged: list[Op] = []
                for op in per["d2h"]:
                    merged.append(op)
                    merged.extend(self.after.pop((d, op), ()))
                merged.extend(self.after.pop((d, None), ()))
                per["d2h"] = merged
            for (d, anchor), ops in self.after.items():  # an anchor that is not on the stream: at the end
                self.streams[d]["d2h"].extend(ops)
            self.after = {}
        streams = tuple({s: tuple(ops) for s, ops in per.items()} for per in self.streams)
        deps = {op: tuple(dict.fromkeys(ds)) for op, ds in self.deps.items() if ds}
        return StreamProgram(self.plan, streams, deps, chunk_bytes, self.recompute)


def _first_compute(action: Action, draft: _Draft) -> Op:
    kind = OpKind.R if action.kind is ActionKind.B and draft.recompute != "none" else OpKind(action.kind.value)
    return Op(kind, action.stage_index, action.microbatch_index)


def _add_compute(draft: _Draft) -> _Draft:
    for device_index, actions in enumerate(draft.plan.actions):
        ops = draft.streams[device_index]["compute"]
        for action in actions:
            if not action.kind.is_compute:
                continue
            if action.kind is ActionKind.B and draft.recompute != "none":
                ops.append(Op(OpKind.R, action.stage_index, action.microbatch_index))
            ops.append(Op(OpKind(action.kind.value), action.stage_index, action.microbatch_index))
    return draft


def _add_activation_transfers(draft: _Draft) -> _Draft:
    plan = draft.plan
    for device_index, actions in enumerate(plan.actions):
        h2d, d2h = draft.streams[device_index]["h2d"], draft.streams[device_index]["d2h"]
        for action in actions:
            if not action.kind.is_compute or action.kind is ActionKind.W:
                continue
            s, m = action.stage_index, action.microbatch_index
            upload = Op(OpKind.H2D, s, m)
            h2d.append(upload)
            producer = input_producer(plan, s)
            if producer is not None:
                draft.edge(upload, Op(OpKind.D2H, producer, m))
            draft.edge(_first_compute(action, draft), upload)
            if action.kind is ActionKind.B:
                grad = Op(OpKind.GH2D, s, m)
                h2d.append(grad)
                source = gradient_producer(plan, s)
                if source is not None:
                    draft.edge(grad, Op(OpKind.D2H, source, m))
                draft.edge(Op(OpKind.B, s, m), grad)
                if draft.recompute == "late":
                    draft.edge(Op(OpKind.R, s, m), grad)
            download = Op(OpKind.D2H, s, m)
            d2h.append(download)
            draft.edge(download, Op(OpKind(action.kind.value), s, m))
    return draft


def _add_weight_transfers(draft: _Draft, stage_weight_bytes: Sequence[int] | None,
                          stage_grad_bytes: Sequence[int] | None, chunk_bytes: int) -> _Draft:
    plan = draft.plan
    for dispatch in plan_dispatches(plan):
        s, r, d = dispatch.stage_index, dispatch.round_index, dispatch.device_index
        total = int(stage_weight_bytes[s]) if stage_weight_bytes is not None else 0
        n_chunks = max(1, math.ceil(total / chunk_bytes))
        chunks = [Op(OpKind.LOAD, s, None, c, r, nbytes=min(chunk_bytes, total - c * chunk_bytes) if total else 0)
                  for c in range(n_chunks)]
        draft.streams[d]["weights"].extend(chunks)
        draft.chunks[(s, r)] = chunks
        if dispatch.room is not None:
            draft.edge(chunks[0], Op(OpKind.DROP, dispatch.room[0], None, None, dispatch.room[1]))
        if not dispatch.computes:
            continue
        draft.edge(_first_compute(dispatch.computes[0], draft), chunks[-1])
        last = dispatch.computes[-1]
        last_op = Op(OpKind(last.kind.value), s, last.microbatch_index)
        tail: list[Op] = []
        if plan.stages[s].kind == "backward":
            grad_bytes = int(stage_grad_bytes[s]) if stage_grad_bytes is not None else 0
            tail.append(Op(OpKind.WD2H, s, None, None, r, nbytes=grad_bytes))
        tail.append(Op(OpKind.DROP, s, None, None, r))
        for op in tail:
            draft.edge(op, last_op)
        # on the d2h stream right after the download of the dispatch's last compute that has one
        with_download = [a for a in dispatch.computes if a.kind is not ActionKind.W]
        anchor = Op(OpKind.D2H, s, with_download[-1].microbatch_index) if with_download else None
        draft.after.setdefault((d, anchor), []).extend(tail)
    return draft


def _add_activation_priority(draft: _Draft) -> _Draft:
    plan = draft.plan
    for dispatch in plan_dispatches(plan):
        actions = plan.actions[dispatch.device_index]
        pending: list[Op] = []
        for action in actions[dispatch.load_position + 1:]:
            if not action.kind.is_compute:
                continue
            if action.stage_index == dispatch.stage_index:
                break
            if action.kind is ActionKind.W:
                continue
            pending.append(Op(OpKind.H2D, action.stage_index, action.microbatch_index))
            if action.kind is ActionKind.B:
                pending.append(Op(OpKind.GH2D, action.stage_index, action.microbatch_index))
        chunks = draft.chunks[(dispatch.stage_index, dispatch.round_index)]
        for chunk, upload in zip(chunks, pending):
            draft.edge(chunk, upload)
    return draft


def lower(
    plan: ExecutionPlan,
    *,
    stage_weight_bytes: Sequence[int] | None = None,
    stage_grad_bytes: Sequence[int] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    recompute: str | None = None,
    validate: bool = True,
) -> StreamProgram:
    """Lower a compute plan to its stream program.

    Args:
        plan: a valid :class:`ExecutionPlan` (RoundPipe or a baseline).
        stage_weight_bytes: per stage (by ``stage_index``), bytes one ``LOAD`` moves (weights in the
            compute dtype plus buffers); ``None``: 0 (one empty chunk per ``LOAD``).
        stage_grad_bytes: per stage, bytes of its weight gradients (``WD2H``); ``None``: 0.
        chunk_bytes: largest ``LOAD`` chunk, bytes (> 0; default 64 MiB).
        recompute: ``"early"`` (RoundPipe: ``R`` waits only for the saved input), ``"late"`` (``R``
            waits for the gradient too: activation checkpointing), ``"none"`` (no ``R`` op; ``B``
            backpropagates through kept activations). Default: ``"early"`` for RoundPipe plans,
            ``"late"``/``"none"`` for bound baselines by their ``_meta["recompute"]``.
        validate: run :meth:`StreamProgram.validate` on the result.

    Returns:
        The :class:`StreamProgram`.

    Raises:
        ValueError: a bad ``chunk_bytes`` or ``recompute``, or byte lists of the wrong length.
        PlanValidationError: the lowered program is invalid (with its grid).
    """
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
        raise ValueError(f"`chunk_bytes` must be a positive int (bytes), got {chunk_bytes!r}. HINT: the default is 64 MiB.")
    if recompute is None:
        bound = plan._meta.get("weight_binding", False)
        recompute = ("late" if plan._meta.get("recompute", True) else "none") if bound else "early"
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"`recompute` must be one of {list(RECOMPUTE_MODES)}, got {recompute!r}.")
    for name, values in (("stage_weight_bytes", stage_weight_bytes), ("stage_grad_bytes", stage_grad_bytes)):
        if values is None:
            continue
        if len(values) != len(plan.stages):
            raise ValueError(f"`{name}` has {len(values)} entries; the plan has {len(plan.stages)} stages (one per stage).")
        bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v < 0]
        if bad:
            raise ValueError(f"`{name}` must hold ints >= 0 (bytes), got {bad[:3]}.")
    draft = _Draft(plan, recompute)
    draft = _add_compute(draft)
    draft = _add_activation_transfers(draft)
    draft = _add_weight_transfers(draft, stage_weight_bytes, stage_grad_bytes, chunk_bytes)
    draft = _add_activation_priority(draft)
    program = draft.freeze(chunk_bytes)
    return program.validate() if validate else program
