"""Which pooled buffer every transfer of a stream program uses (pure: program in, slots out).

DESIGN.md section 4: activation and gradient buffers are pooled and reused through the program's
edges. Two kinds of transfer content are pooled by slot:

- **device uploads**, per device: what an ``H2D`` writes (``("in", stage_index, microbatch_index)``,
  the input of an ``F``/``X``/``R``) and what a ``GH2D`` writes (``("gin", stage_index,
  microbatch_index)``, the incoming gradient of a ``B``). Readers: the compute op, and the ``D2H`` of
  an ``F`` (a stage's output may pass input tensors through: the mask, the positions), and the ``B``
  of an ``R`` (the autograd graph keeps the input);
- **host downloads** read only inside the program: a boundary activation the next stage uploads,
  an input gradient the next backward stage uploads (``("act", layer_index, microbatch_index)``,
  ``("grad", layer_index, microbatch_index)``). Readers: those uploads. Host contents that outlive
  the program (the outputs, boundaries saved for a later backward program, the batch's input
  gradients) are *exported*: they get keyed blocks instead
  (:meth:`~lightning_roundpipe.runtime.backends.pool.HostStagingPool.keyed`).

A content may take a slot only when every reader of the slot's previous content *happens before*
the op that writes it, by the program's edges and stream order (the same vector clocks
:meth:`~lightning_roundpipe.schedule.program.StreamProgram.validate` uses); otherwise it takes
another slot, or a new one. So the pool needs no ``record_stream``, no host wait, and as many slots
as the program's own run-ahead can fill, whatever the timing. The checking mode verifies every
refill against the waits really made (:mod:`~lightning_roundpipe.runtime.execution.access`).

Device-slot assignments depend only on the device's own stream order, host-slot assignments on a
label-free order (depth in the program, then stage and microbatch), so a plan rotated to another
cursor (the same program with devices relabelled) uses the same slots: sizing every device's slot
``k`` to the largest content any device put there makes every later step fit. The planner's
peak-memory model counts the device pool from the same assignment
(:func:`~lightning_roundpipe.partition.seqlen.transfer_pool_bytes`). Pure: no torch, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from lightning_roundpipe.schedule.program import Op, OpKind, StreamProgram

Content = tuple


@dataclass(frozen=True)
class SlotPlan:
    """Slots of one pool for one program.

    Attributes:
        slots: content -> slot index.
        previous: content -> the content that held its slot before it in this program (``None``: the
            slot's first use in the program).
        readers: content -> the ops of the program that read it.
        producers: content -> the op that writes it.
        num_slots: slots the program needs.
    """

    slots: dict[Content, int]
    previous: dict[Content, Content | None]
    readers: dict[Content, tuple[Op, ...]]
    producers: dict[Content, Op]
    num_slots: int

    def readers_before(self, content: Content) -> tuple[Op, ...]:
        """The readers of what ``content``'s slot held before it (they must finish first)."""
        previous = self.previous.get(content)
        return () if previous is None else self.readers[previous]


def _ops(program: StreamProgram) -> set[Op]:
    present = program._cache.get("present_ops")
    if present is None:
        present = program._cache["present_ops"] = {op for _, _, _, op in program.ops()}
    return present


def _before(program: StreamProgram, first: Op, then: Op) -> bool:
    clocks = program._cache.get("clocks")
    if clocks is None:
        clocks = program._cache["clocks"] = program._vector_clocks(program.topological_order())
    return program._happens_before(first, then, clocks)


def upload_content(op: Op) -> Content:
    """The device content an ``H2D``/``GH2D`` op writes."""
    return ("gin" if op.kind is OpKind.GH2D else "in", op.stage_index, op.microbatch_index)


def upload_readers(program: StreamProgram, op: Op) -> tuple[Op, ...]:
    """The ops that read what ``op`` (an ``H2D``/``GH2D``) uploads."""
    s, m = op.stage_index, op.microbatch_index
    present = _ops(program)
    if op.kind is OpKind.GH2D:
        candidates = (Op(OpKind.B, s, m),)
    elif Op(OpKind.F, s, m) in present:
        candidates = (Op(OpKind.F, s, m), Op(OpKind.D2H, s, m))
    elif Op(OpKind.X, s, m) in present:
        candidates = (Op(OpKind.X, s, m),)
    elif Op(OpKind.R, s, m) in present:
        candidates = (Op(OpKind.R, s, m), Op(OpKind.B, s, m))
    else:
        candidates = (Op(OpKind.B, s, m),)
    return tuple(c for c in candidates if c in present)


def _assign(program: StreamProgram, order: list[tuple[Op, Content]], readers: dict[Content, tuple[Op, ...]]) -> SlotPlan:
    """Greedy: each content takes the lowest slot whose previous content's readers (and producer)
    all happen before its producer."""
    occupant: list[Content] = []
    slots: dict[Content, int] = {}
    previous: dict[Content, Content | None] = {}
    producers: dict[Content, Op] = {}
    for producer, content in order:
        chosen = None
        for k, held in enumerate(occupant):
            if _before(program, producers[held], producer) and all(_before(program, r, producer) for r in readers[held]):
                chosen = k
                break
        if chosen is None:
            chosen = len(occupant)
            occupant.append(content)
            previous[content] = None
        else:
            previous[content] = occupant[chosen]
            occupant[chosen] = content
        slots[content] = chosen
        producers[content] = producer
    return SlotPlan(slots, previous, readers, producers, len(occupant))


def device_slots(program: StreamProgram) -> list[SlotPlan]:
    """Per device, the transfer slot of every upload content (cached on the program)."""
    cached = program._cache.get("transfer_slots")
    if cached is not None:
        return cached
    plans = []
    for per_stream in program.streams:
        order = [(op, upload_content(op)) for op in per_stream["h2d"]]
        readers = {content: upload_readers(program, op) for op, content in order}
        plans.append(_assign(program, order, readers))
    program._cache["transfer_slots"] = plans
    return plans


def download_contents(program: StreamProgram, op: Op, num_layers: int, keep: frozenset) -> list[Content]:
    """The host contents a ``D2H`` op writes: an ``F``'s output (``("act", stop, m)``, or
    ``("final", m)`` after the last layer) and the boundaries it saves for the backward
    (``("act", layer, m)`` for the stage's inner layers in ``keep``); an ``X``/``B``'s input gradient
    (``("grad", start, m)``) and an ``X``'s loss (``("final", m)``)."""
    spec = program.plan.stages[op.stage_index]
    m = op.microbatch_index
    if Op(OpKind.F, op.stage_index, m) in _ops(program):
        out = [("final", m) if spec.layers.stop == num_layers else ("act", spec.layers.stop, m)]
        return out + [("act", li, m) for li in spec.layers if li != spec.layers.start and li in keep]
    out = [("grad", spec.layers.start, m)]
    if Op(OpKind.X, op.stage_index, m) in _ops(program):
        out.append(("final", m))
    return out


def _download_readers(program: StreamProgram, content: Content) -> tuple[Op, ...]:
    index = program._cache.get("upload_index")
    if index is None:
        index = {}
        for op in _ops(program):
            if op.kind in (OpKind.H2D, OpKind.GH2D):
                spec = program.plan.stages[op.stage_index]
                key = ("act", spec.layers.start, op.microbatch_index) if op.kind is OpKind.H2D else (
                    "grad", spec.layers.stop, op.microbatch_index)
                index.setdefault(key, []).append(op)
        index = program._cache["upload_index"] = {k: tuple(sorted(v, key=str)) for k, v in index.items()}
    return index.get(content, ()) if content[0] in ("act", "grad") else ()


def host_slots(program: StreamProgram, num_layers: int, keep: frozenset) -> tuple[SlotPlan, frozenset]:
    """The host staging slot of every download content read only inside the program, and the
    exported contents (cached on the program per ``(num_layers, keep)``)."""
    key = ("host_slots", num_layers, keep)
    cached = program._cache.get(key)
    if cached is not None:
        return cached
    plan = program.plan
    has_backward = any(plan.stages[op.stage_index].kind == "backward" for op in _ops(program))
    depth: dict[Op, int] = {}
    for op in program.topological_order():
        depth[op] = 1 + max((depth[p] for p in program.predecessors(op)), default=0)
    downloads = sorted((op for op in _ops(program) if op.kind is OpKind.D2H),
                       key=lambda op: (depth[op], op.stage_index, op.microbatch_index))
    order, readers, exported = [], {}, set()
    for op in downloads:
        for content in sorted(download_contents(program, op, num_layers, keep), key=str):
            found = _download_readers(program, content)
            outlives = content[0] == "final" or not found or (
                content[0] == "act" and not has_backward and content[1] in keep)
            if outlives:
                exported.add(content)
                continue
            readers[content] = found
            order.append((op, content))
    result = (_assign(program, order, readers), frozenset(exported))
    program._cache[key] = result
    return result


def slot_sizes(plans: list[SlotPlan], nbytes: dict[Hashable, int]) -> list[int]:
    """Per slot index, the most bytes any plan's content in that slot took (``nbytes``: measured
    bytes per content; unknown contents count 0)."""
    sizes = [0] * max((p.num_slots for p in plans), default=0)
    for plan in plans:
        for content, slot in plan.slots.items():
            sizes[slot] = max(sizes[slot], nbytes.get(content, 0))
    return sizes
