"""The stream program: what every device's streams do, in order, and the events between them.

A compute plan (:class:`~lightning_roundpipe.schedule.plan.ExecutionPlan`) says which device runs
which stage's ``F``/``X``/``B`` for which microbatch. :func:`~lightning_roundpipe.schedule.lower.lower`
turns it into a :class:`StreamProgram` (DESIGN.md section 9): per device, ordered op lists for four
streams, plus explicit dependency edges (the events a consumer waits on). The runtime's backends walk
each stream's list in order and never reorder; the simulator times the same lists. Pure data.

Streams (paper section 3.3):

- ``weights``: ``LOAD`` chunks (weight H2D, at most ``chunk_bytes`` each) of the device's stages;
- ``h2d``: ``H2D`` (a compute op's input from the host: a stage-boundary activation, or the saved
  boundary input a backward stage recomputes from) and ``GH2D`` (the incoming gradient of a ``B``);
- ``compute``: ``F`` (forward), ``X`` (fused tail: forward, loss and backward), ``R`` (recompute: a
  backward stage's forward with autograd, from its saved input), ``B`` (backward with the incoming
  gradient), ``W`` (weight-gradient backward, zero-bubble baselines only);
- ``d2h``: ``D2H`` (a compute op's results bound for the host: ``F``'s boundary activations, ``X``'s
  loss and input gradient, ``B``'s input gradient), ``WD2H`` (the stage's weight gradients, after its
  last microbatch) and ``DROP`` (release of the stage's weights and gradient buffers).

String form (as ``torch.distributed.pipelining`` prints actions): ``"3F1"`` (stage 3, microbatch 1),
``"3H2D1"``, ``"5GH2D0"``, ``"0LOAD.c2"`` (chunk 2 of stage 0's weights), ``"5WD2H"``, ``"5DROP"``;
per-stage ops of a later microbatch round carry ``@r`` (``"0LOAD.c0@1"``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

from lightning_roundpipe.schedule.ir import ActionKind
from lightning_roundpipe.schedule.plan import (ExecutionPlan, PlanValidationError, gradient_producer, input_producer,
                                               plan_dispatches)

STREAMS: tuple[str, ...] = ("weights", "h2d", "compute", "d2h")


class OpKind(str, enum.Enum):
    """What one stream op does (see the module docstring)."""

    LOAD = "LOAD"
    H2D = "H2D"
    GH2D = "GH2D"
    F = "F"
    X = "X"
    R = "R"
    B = "B"
    W = "W"
    D2H = "D2H"
    WD2H = "WD2H"
    DROP = "DROP"

    @property
    def stream(self) -> str:
        """The stream this kind runs on."""
        return _STREAM_OF[self]

    @property
    def is_compute(self) -> bool:
        return _STREAM_OF[self] == "compute"

    @property
    def per_microbatch(self) -> bool:
        return self not in _PER_STAGE


_STREAM_OF = {
    OpKind.LOAD: "weights", OpKind.H2D: "h2d", OpKind.GH2D: "h2d",
    OpKind.F: "compute", OpKind.X: "compute", OpKind.R: "compute", OpKind.B: "compute", OpKind.W: "compute",
    OpKind.D2H: "d2h", OpKind.WD2H: "d2h", OpKind.DROP: "d2h",
}
_PER_STAGE = frozenset((OpKind.LOAD, OpKind.WD2H, OpKind.DROP))
_OP_RE = re.compile(r"^(\d+)(LOAD|GH2D|H2D|WD2H|D2H|DROP|F|X|R|B|W)(\d*)(?:\.c(\d+))?(?:@(\d+))?$")


@dataclass(frozen=True, order=True)
class Op:
    """One op of one stream.

    Attributes:
        kind: the :class:`OpKind` (it fixes the stream).
        stage_index: the stage (index into the plan's ``stages``).
        microbatch_index: the microbatch, for per-microbatch kinds; ``None`` for ``LOAD``, ``WD2H``, ``DROP``.
        chunk_index: for ``LOAD``: which chunk of the stage's weights (0-based); else ``None``.
        round_index: for per-stage kinds: which dispatch of the stage (microbatch round, 0-based).
        nbytes: bytes the op moves when the lowering knows them (``LOAD`` chunks, ``WD2H``); ``None``
            when the consumer derives them (activations). Not part of the op's identity.
    """

    kind: OpKind
    stage_index: int
    microbatch_index: int | None = None
    chunk_index: int | None = None
    round_index: int = 0
    nbytes: int | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        kind = self.kind
        if kind.__class__ is not OpKind:  # (the lowering passes OpKind members: no enum lookup then)
            kind = OpKind(kind)
            object.__setattr__(self, "kind", kind)
        if (kind not in _PER_STAGE) != (self.microbatch_index is not None):
            raise ValueError(f"`{kind.value}` ops {'need' if kind.per_microbatch else 'take no'} `microbatch_index`.")
        if (kind is OpKind.LOAD) != (self.chunk_index is not None):
            raise ValueError("`chunk_index` is given exactly for `LOAD` ops.")

    @property
    def stream(self) -> str:
        return self.kind.stream

    def __str__(self) -> str:
        text = f"{self.stage_index}{self.kind.value}"
        if self.microbatch_index is not None:
            text += str(self.microbatch_index)
        if self.chunk_index is not None:
            text += f".c{self.chunk_index}"
        if not self.kind.per_microbatch and self.round_index:
            text += f"@{self.round_index}"
        return text

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> "Op":
        """Parse the string form (``"3F1"``, ``"0LOAD.c2"``, ``"5DROP@1"``).

        Raises:
            ValueError: when ``text`` is not of that form.
        """
        match = _OP_RE.match(text.strip())
        if match is None:
            raise ValueError(f"Cannot parse stream op {text!r}: expected e.g. '3F1', '3H2D1', '0LOAD.c2' or '5DROP'.")
        stage, kind, mb, chunk, rnd = match.groups()
        if rnd is not None and OpKind(kind).per_microbatch:
            raise ValueError(f"Cannot parse stream op {text!r}: only per-stage ops (LOAD, WD2H, DROP) take a round suffix `@r`.")
        return cls(OpKind(kind), int(stage), int(mb) if mb else None, int(chunk) if chunk else None, int(rnd or 0))


@dataclass(frozen=True)
class StreamProgram:
    """Per-device, per-stream op lists and the dependency edges between ops.

    Attributes:
        plan: the compute plan this program was lowered from (stages, microbatches, devices).
        streams: ``streams[device_index][stream]`` is that stream's ordered op tuple (every stream
            of :data:`STREAMS` present, possibly empty).
        deps: ``deps[op]``: the ops (on any device and stream) that must finish before ``op`` starts,
            besides its predecessor on its own stream (stream order is implicit).
        chunk_bytes: largest ``LOAD`` chunk, bytes.
        recompute: ``"early"`` (a backward stage recomputes as soon as its saved input is there;
            only the backward waits for the incoming gradient) or ``"late"`` (the recompute waits for
            the gradient too, as autograd checkpointing does).
    """

    plan: ExecutionPlan
    streams: tuple[Mapping[str, tuple[Op, ...]], ...]
    deps: Mapping[Op, tuple[Op, ...]]
    chunk_bytes: int
    recompute: str = "early"
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_devices(self) -> int:
        return len(self.streams)

    def ops(self) -> Iterator[tuple[int, str, int, Op]]:
        """Every op as ``(device_index, stream, position, op)``."""
        for device_index, per_stream in enumerate(self.streams):
            for stream in STREAMS:
                for position, op in enumerate(per_stream[stream]):
                    yield device_index, stream, position, op

    def location(self, op: Op) -> tuple[int, str, int]:
        """``(device_index, stream, position)`` of ``op``.

        Raises:
            KeyError: ``op`` is not in the program.
        """
        where = self._cache.get("where")
        if where is None:
            where = self._cache["where"] = {op: (d, s, p) for d, s, p, op in self.ops()}
        return where[op]

    def predecessors(self, op: Op) -> tuple[Op, ...]:
        """Everything ``op`` waits for: its stream predecessor, then its dependency edges."""
        device_index, stream, position = self.location(op)
        before = (self.streams[device_index][stream][position - 1],) if position else ()
        return before + tuple(self.deps.get(op, ()))

    def as_strings(self) -> list[dict[str, list[str]]]:
        """``[{stream: ["0LOAD.c0", ...]}]`` per device: the form the lowering tests compare."""
        return [{s: [str(op) for op in per_stream[s]] for s in STREAMS} for per_stream in self.streams]

    def edges_of(self, op: Op | str) -> list[str]:
        """The dependency edges of ``op`` as strings (sorted)."""
        op = Op.parse(op) if isinstance(op, str) else op
        return sorted(str(dep) for dep in self.deps.get(op, ()))

    def without_edge(self, consumer: Op | str, producer: Op | str) -> "StreamProgram":
        """A copy with one dependency edge removed (for tests of :meth:`validate` and of the runtime)."""
        consumer = Op.parse(consumer) if isinstance(consumer, str) else consumer
        producer = Op.parse(producer) if isinstance(producer, str) else producer
        if producer not in self.deps.get(consumer, ()):
            raise KeyError(f"`{consumer}` has no edge from `{producer}`; its edges: {self.edges_of(consumer)}.")
        deps = dict(self.deps)
        deps[consumer] = tuple(d for d in deps[consumer] if d != producer)
        return StreamProgram(self.plan, self.streams, deps, self.chunk_bytes, self.recompute)

    # ------------------------------------------------------------------ validation
    def validate(self) -> "StreamProgram":
        """Check the program; return it unchanged when valid.

        Checks that every edge names an op of the program; that the walk of every stream in order
        finishes (no deadlock); and, from what each op reads and writes, that every read follows the
        write it depends on (through edges and stream order, transitively): compute ops after their
        inputs' uploads and after all their weight chunks, uploads after the downloads that produce
        their data, downloads after the compute that produces it, ``WD2H``/``DROP`` after the stage's
        last compute of the round, a ``LOAD`` after the ``DROP`` that frees its room (at most
        ``plan.max_resident_stages`` stages resident); and that every loaded stage is released.

        Raises:
            PlanValidationError: naming each problem, with the per-stream grid and the failing op
                marked.
        """
        problems: list[str] = []
        marked: Op | None = None
        seen: set[Op] = set()
        for d, stream, _, op in self.ops():
            if op in seen:
                problems.append(f"`{op}` appears twice")
                marked = marked or op
            seen.add(op)
            if op.stream != stream:
                problems.append(f"device {d}: `{op}` sits on stream `{stream}`, its kind runs on `{op.stream}`")
                marked = marked or op
        for op, deps in self.deps.items():
            for dep in deps:
                if dep not in seen:
                    problems.append(f"`{op}` waits for `{dep}`, which no stream runs")
                    marked = marked or op
        if not problems:
            try:
                order = self.topological_order()
            except PlanValidationError as error:
                problems.append(str(error))
                marked = self._cache.get("blocked")
            else:
                clocks = self._vector_clocks(order)
                for op in order:
                    for need in required_predecessors(self, op):
                        if need not in seen:
                            problems.append(f"`{op}` needs `{need}`, which no stream runs")
                            marked = marked or op
                        elif not self._happens_before(need, op, clocks):
                            problems.append(f"`{op}` may start before `{need}` finishes (missing edge `{need}` -> `{op}`)")
                            marked = marked or op
                    if len(problems) > 20:
                        break
        if problems:
            raise PlanValidationError("Invalid stream program:\n  - " + "\n  - ".join(problems[:20]) + "\n"
                                      + self.format_grid(mark=marked))
        return self

    def topological_order(self) -> list[Op]:
        """Ops in the order of an in-order walk of every stream (each op after its predecessors).

        Raises:
            PlanValidationError: when the walk stalls (deadlock), naming the blocked stream heads.
        """
        cached = self._cache.get("order")
        if cached is not None:
            return cached
        heads = {(d, s): 0 for d in range(self.num_devices) for s in STREAMS}
        done: set[Op] = set()
        order: list[Op] = []
        total = sum(len(per_stream[s]) for per_stream in self.streams for s in STREAMS)
        while len(order) < total:
            progressed = False
            for (d, s), pos in heads.items():
                ops = self.streams[d][s]
                while pos < len(ops) and all(dep in done for dep in self.deps.get(ops[pos], ())):
                    done.add(ops[pos])
                    order.append(ops[pos])
                    pos += 1
                    progressed = True
                heads[(d, s)] = pos
            if not progressed:
                blocked = [(d, s, self.streams[d][s][pos]) for (d, s), pos in heads.items() if pos < len(self.streams[d][s])]
                self._cache["blocked"] = blocked[0][2]
                raise PlanValidationError("deadlock: no stream can make progress; " + "; ".join(
                    f"dev{d}/{s}: `{op}` waits for {[str(x) for x in self.deps.get(op, ()) if x not in done]}"
                    for d, s, op in blocked[:8]))
        self._cache["order"] = order
        return order

    def _vector_clocks(self, order: list[Op]) -> dict[Op, list[int]]:
        """Per op, for every (device, stream), how many of its ops are known to finish before it."""
        index = {(d, s): d * len(STREAMS) + k for d in range(self.num_devices) for k, s in enumerate(STREAMS)}
        clocks: dict[Op, list[int]] = {}
        for op in order:
            d, s, pos = self.location(op)
            clock = [0] * len(index)
            for pred in self.predecessors(op):
                other = clocks[pred]
                clock = [a if a >= b else b for a, b in zip(clock, other)]
            clock[index[(d, s)]] = pos + 1
            clocks[op] = clock
        self._cache["clock_index"] = index
        return clocks

    def _happens_before(self, first: Op, then: Op, clocks: dict[Op, list[int]]) -> bool:
        d, s, pos = self.location(first)
        return clocks[then][self._cache["clock_index"][(d, s)]] > pos and first != then

    # ------------------------------------------------------------------ printing
    def format_grid(self, mark: Op | None = None, devices: Iterable[int] | None = None) -> str:
        """The program as a grid: one column per (device, stream), one row per list position.

        Args:
            mark: an op to mark with ``>`` ``<`` (the failing op of a validation error).
            devices: which devices to show (default: all).
        """
        devices = list(range(self.num_devices)) if devices is None else list(devices)
        cols = [(d, s) for d in devices for s in STREAMS]
        cells = [[(f">{op}<" if op == mark else str(op)) for op in self.streams[d][s]] for d, s in cols]
        headers = [f"dev{d}/{s}" for d, s in cols]
        widths = [max([len(h)] + [len(c) for c in col]) for h, col in zip(headers, cells)]
        rows = max((len(c) for c in cells), default=0)
        lines = ["   # | " + " ".join(h.ljust(w) for h, w in zip(headers, widths))]
        lines.append("-" * len(lines[0]))
        for r in range(rows):
            lines.append(f"{r:4d} | " + " ".join((col[r] if r < len(col) else "").ljust(w) for col, w in zip(cells, widths)))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_grid()


def required_predecessors(program: StreamProgram, op: Op) -> list[Op]:
    """What ``op`` reads or frees, as the ops that must finish first (derived from the plan and the
    ops' meaning, never from the program's edges; :meth:`StreamProgram.validate` checks each one is
    implied by the edges and stream order)."""
    table = program._cache.get("required")
    if table is None:
        table = program._cache["required"] = _required_table(program)
    return table.get(op, [])


def _required_table(program: StreamProgram) -> dict[Op, list[Op]]:
    plan = program.plan
    need: dict[Op, list[Op]] = {}
    present = {op for _, _, _, op in program.ops()}
    chunks: dict[tuple[int, int], list[Op]] = {}
    for op in present:
        if op.kind is OpKind.LOAD:
            chunks.setdefault((op.stage_index, op.round_index), []).append(op)
    for dispatch in plan_dispatches(plan):
        s, r = dispatch.stage_index, dispatch.round_index
        mine = chunks.get((s, r), [])
        if not mine:
            raise PlanValidationError(f"stage {s} (round {r}) is loaded by the plan but has no `LOAD` chunk in the program")
        first_chunk = min(mine, key=lambda c: c.chunk_index)
        if dispatch.room is not None:
            need.setdefault(first_chunk, []).append(Op(OpKind.DROP, dispatch.room[0], None, None, dispatch.room[1]))
        released = Op(OpKind.DROP, s, None, None, r)
        if released not in present:
            raise PlanValidationError(f"stage {s} (round {r}) is loaded but never released (no `{released}`)")
        for action in dispatch.computes:
            m = action.microbatch_index
            compute = Op(OpKind(action.kind.value), s, m)
            first = Op(OpKind.R, s, m) if (action.kind is ActionKind.B and program.recompute != "none") else compute
            need.setdefault(first, []).extend(mine)
            need.setdefault(released, []).append(compute)
            if action.kind is ActionKind.W:
                need.setdefault(compute, []).append(Op(OpKind.B, s, m))
                continue
            upload = Op(OpKind.H2D, s, m)
            need.setdefault(first, []).append(upload)
            producer = input_producer(plan, s)
            if producer is not None:
                need.setdefault(upload, []).append(Op(OpKind.D2H, producer, m))
            if action.kind is ActionKind.B:
                grad = Op(OpKind.GH2D, s, m)
                need.setdefault(compute, []).extend([grad] if first == compute else [first, grad])
                if program.recompute == "late":
                    need.setdefault(first, []).append(grad)
                source = gradient_producer(plan, s)
                if source is not None:
                    need.setdefault(grad, []).append(Op(OpKind.D2H, source, m))
            need.setdefault(Op(OpKind.D2H, s, m), []).append(compute)
            if plan.stages[s].kind == "backward":
                need.setdefault(Op(OpKind.WD2H, s, None, None, r), []).append(compute)
        if plan.stages[s].kind == "backward":
            need.setdefault(released, []).append(Op(OpKind.WD2H, s, None, None, r))
    return need
