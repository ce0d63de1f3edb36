"""The steady-state stream program: K iterations and the host's optimizer steps (DESIGN.md section 11).

A plan from :func:`~lightning_roundpipe.schedule.roundpipe.build_steady_state_plan` lowers like any
other plan (:func:`~lightning_roundpipe.schedule.lower.lower`: the device streams, their edges and
their validation are unchanged). This pass adds what couples the iterations through the optimizer,
the rules of the run's mode (:class:`~lightning_roundpipe.schedule.roundpipe.SteadyState`):

- one host ``OPT`` op per optimizer step, on a single host queue in step order; ``OPT w`` waits
  for every weight-gradient download (``WD2H``) of the iterations of window ``w``;
- ``async`` (paper section 4, one-step-stale weights): every weight upload (``LOAD`` chunk) of an
  iteration of window ``w`` waits for ``OPT w - 2``; nothing else waits, so window ``w + 1``'s
  forward stages run while window ``w`` drains and ``OPT w`` runs on the host;
- ``sync`` (Lightning's exact semantics): every upload (``LOAD`` chunk, ``H2D``, ``GH2D``) of an
  iteration of window ``w`` waits for ``OPT w - 1``, so nothing of the window starts before the
  previous optimizer step ends; inside a window (``accumulate_grad_batches > 1``) the weights do not
  change and iteration ``i + 1``'s forward stages run during iteration ``i``'s backward;
- both modes, the host's issue order: Lightning calls the next ``training_step`` once the fused
  forward has returned this one's loss, so the first op of iteration ``i + 1`` on every device
  stream waits for every fused-tail op (``X``) of iteration ``i`` (a plan whose fused tail ends
  its iteration, such as the whole model as one stage, gets no overlap from the steady state).

The runtime runs the device streams as it runs any program and the optimizer step where the host
queue puts it; the simulator (:mod:`lightning_roundpipe.simulate.steady`) times both.

Pure: no torch, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from lightning_roundpipe.schedule.lower import DEFAULT_CHUNK_BYTES, lower, plan_dispatches
from lightning_roundpipe.schedule.plan import ExecutionPlan, PlanValidationError
from lightning_roundpipe.schedule.program import Op, OpKind, StreamProgram
from lightning_roundpipe.schedule.roundpipe import SteadyState

__all__ = ["OptimizerOp", "SteadyStateProgram", "lower_steady_state", "op_iteration"]

_SYNC_WAITS = (OpKind.LOAD, OpKind.H2D, OpKind.GH2D)
_ASYNC_WAITS = (OpKind.LOAD,)


@dataclass(frozen=True, order=True)
class OptimizerOp:
    """The host's optimizer step ``step_index`` (``"OPT3"``): clipping, ``optimizer.step()`` and the
    refresh of the compute-dtype weight copies, over every trainable parameter."""

    step_index: int

    def __str__(self) -> str:
        return f"OPT{self.step_index}"

    __repr__ = __str__


def op_iteration(program: StreamProgram, op: Op, steady_state: SteadyState) -> int:
    """The iteration ``op`` belongs to: its microbatch's, or, for a per-stage op (``LOAD``,
    ``WD2H``, ``DROP``), that of the first microbatch of its dispatch.

    Raises:
        KeyError: a per-stage op of a dispatch the plan does not have.
    """
    if op.microbatch_index is not None:
        return steady_state.iteration_of(op.microbatch_index)
    first = program._cache.get("dispatch_first")
    if first is None:
        first = program._cache["dispatch_first"] = {
            (d.stage_index, d.round_index): min(a.microbatch_index for a in d.computes)
            for d in plan_dispatches(program.plan) if d.computes}
    return steady_state.iteration_of(first[(op.stage_index, op.round_index)])


@dataclass(frozen=True)
class SteadyStateProgram:
    """The device streams of ``K`` iterations plus the host queue of optimizer steps.

    Attributes:
        program: the device streams (:func:`~lightning_roundpipe.schedule.lower.lower` of the plan).
        steady_state: the iterations' relation (mode, ``M``, accumulation).
        optimizer_ops: the host queue, in step order (one op per complete window).
        optimizer_deps: per optimizer op, the ``WD2H`` ops it waits for (its window's gradients).
        optimizer_waits: per device op that waits for an optimizer step, that step's op.
    """

    program: StreamProgram
    steady_state: SteadyState
    optimizer_ops: tuple[OptimizerOp, ...]
    optimizer_deps: Mapping[OptimizerOp, tuple[Op, ...]]
    optimizer_waits: Mapping[Op, OptimizerOp]
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def plan(self) -> ExecutionPlan:
        return self.program.plan

    def iteration_of(self, op: Op) -> int:
        """The iteration of a device op (:func:`op_iteration`)."""
        return op_iteration(self.program, op, self.steady_state)

    def required_optimizer_step(self, op: Op) -> int | None:
        """The optimizer step that must end before ``op`` starts, by the mode's rule (derived from
        the op and :class:`SteadyState`, never from the stored edges), or ``None``."""
        waits = _SYNC_WAITS if self.steady_state.optimizer == "sync" else _ASYNC_WAITS
        if op.kind not in waits:
            return None
        step = self.steady_state.weights_after_step(self.iteration_of(op))
        return step if step is not None and step < len(self.optimizer_ops) else None

    def gradient_downloads(self, step_index: int) -> tuple[Op, ...]:
        """Every ``WD2H`` of the iterations of optimizer step ``step_index`` (derived from the plan)."""
        window = self.steady_state.iterations_of_step(step_index)
        return tuple(op for _, _, _, op in self.program.ops()
                     if op.kind is OpKind.WD2H and self.iteration_of(op) in window)

    def validate(self) -> "SteadyStateProgram":
        """Check the optimizer coupling; return the program unchanged when it holds.

        Checks: the host queue holds ``OPT 0 .. num_steps - 1`` in order; each ``OPT w`` waits for
        exactly the ``WD2H`` ops of its window; every device op that the mode's rule
        (:meth:`required_optimizer_step`) makes wait for ``OPT j`` starts after it, through its own
        edge or its stream predecessors and dependency edges (transitively); no op waits for an
        optimizer step that is not in the queue; and the device streams and host queue together
        can run to the end (no deadlock). The device streams themselves are checked by
        :meth:`StreamProgram.validate` (``lower_steady_state(validate=True)`` runs both).

        Raises:
            PlanValidationError: naming each problem, with the device streams' grid.
        """
        problems: list[str] = []
        expected = tuple(OptimizerOp(i) for i in range(self.steady_state.num_steps))
        if self.optimizer_ops != expected:
            problems.append(f"host queue is {list(map(str, self.optimizer_ops))}, expected {list(map(str, expected))}")
        for op in self.optimizer_ops:
            need = set(self.gradient_downloads(op.step_index))
            got = set(self.optimizer_deps.get(op, ()))
            if need != got:
                missing = sorted(map(str, need - got))[:5]
                extra = sorted(map(str, got - need))[:5]
                problems.append(f"`{op}` must wait for exactly its window's gradient downloads;"
                                f" missing {missing}, extra {extra}")
        for op, step in self.optimizer_waits.items():
            if step not in self.optimizer_ops:
                problems.append(f"`{op}` waits for `{step}`, which the host queue does not run")
        if not problems:
            try:
                finished = self._optimizer_clock()
            except PlanValidationError as error:
                problems.append(str(error))
            else:
                for _, _, _, op in self.program.ops():
                    need = self.required_optimizer_step(op)
                    if need is not None and finished[op] < need:
                        problems.append(f"`{op}` (iteration {self.iteration_of(op)}) may start before `OPT{need}` ends"
                                        f" ({self.steady_state.optimizer} optimizer)")
                    if len(problems) > 20:
                        break
        if problems:
            raise PlanValidationError("Invalid steady-state program:\n  - " + "\n  - ".join(problems[:20]) + "\n"
                                      + self.program.format_grid())
        return self

    def _optimizer_clock(self) -> dict[Op, int]:
        """Per device op, the last optimizer step known to end before it starts (-1: none), from an
        in-order walk of the device streams and the host queue.

        Raises:
            PlanValidationError: the walk stalls (deadlock), naming the blocked heads.
        """
        program = self.program
        queues = [(d, s, ops) for d, per in enumerate(program.streams) for s, ops in per.items()]
        heads = [0] * len(queues)
        host = 0
        clock: dict[Op, int] = {}
        done_steps = -1
        done: set[Op] = set()
        total = sum(len(ops) for _, _, ops in queues)
        while len(done) < total or host < len(self.optimizer_ops):
            progressed = False
            for q, (_, _, ops) in enumerate(queues):
                while heads[q] < len(ops):
                    op = ops[heads[q]]
                    deps = program.deps.get(op, ())
                    step = self.optimizer_waits.get(op)
                    if any(dep not in done for dep in deps) or (step is not None and step.step_index > done_steps):
                        break
                    known = [clock[dep] for dep in deps]
                    if heads[q]:
                        known.append(clock[ops[heads[q] - 1]])
                    if step is not None:
                        known.append(step.step_index)
                    clock[op] = max(known, default=-1)
                    done.add(op)
                    heads[q] += 1
                    progressed = True
            while host < len(self.optimizer_ops) and all(
                    dep in done for dep in self.optimizer_deps.get(self.optimizer_ops[host], ())):
                done_steps = self.optimizer_ops[host].step_index
                host += 1
                progressed = True
            if not progressed:
                blocked = [f"dev{d}/{s}: `{ops[heads[q]]}`" for q, (d, s, ops) in enumerate(queues) if heads[q] < len(ops)]
                if host < len(self.optimizer_ops):
                    blocked.append(f"host: `{self.optimizer_ops[host]}`")
                raise PlanValidationError("deadlock: no stream can make progress; blocked heads: " + "; ".join(blocked[:8]))
        return clock


def lower_steady_state(
    plan: ExecutionPlan,
    *,
    stage_weight_bytes: Sequence[int] | None = None,
    stage_grad_bytes: Sequence[int] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    recompute: str | None = None,
    validate: bool = True,
) -> SteadyStateProgram:
    """Lower a steady-state plan: its device streams (:func:`~lightning_roundpipe.schedule.lower.lower`,
    unchanged) plus the host's optimizer steps and the mode's edges (see the module docstring).

    Args:
        plan: from :func:`~lightning_roundpipe.schedule.roundpipe.build_steady_state_plan`.
        stage_weight_bytes, stage_grad_bytes, chunk_bytes, recompute: as :func:`lower`.
        validate: validate the device streams and the optimizer coupling.

    Returns:
        The :class:`SteadyStateProgram`.

    Raises:
        ValueError: ``plan`` has no ``_meta["steady_state"]`` (not a steady-state plan), or as :func:`lower`.
        PlanValidationError: the result is invalid (with the grid).
    """
    spec = plan._meta.get("steady_state")
    if not isinstance(spec, SteadyState):
        raise ValueError("`plan` is not a steady-state plan (no `_meta['steady_state']`). HINT: build it with"
                         " `build_steady_state_plan(stages, num_devices, num_microbatches, num_iterations, optimizer=...)`.")
    program = _with_issue_edges(lower(plan, stage_weight_bytes=stage_weight_bytes, stage_grad_bytes=stage_grad_bytes,
                                      chunk_bytes=chunk_bytes, recompute=recompute, validate=validate), spec)
    steps = tuple(OptimizerOp(i) for i in range(spec.num_steps))
    deps: dict[OptimizerOp, list[Op]] = {op: [] for op in steps}
    draft = SteadyStateProgram(program, spec, steps, {}, {})
    waits: dict[Op, OptimizerOp] = {}
    watched = _SYNC_WAITS if spec.optimizer == "sync" else _ASYNC_WAITS
    for _, _, _, op in program.ops():
        if op.kind is OpKind.WD2H:
            step = spec.step_of(draft.iteration_of(op))
            if step < len(steps):
                deps[steps[step]].append(op)
        elif op.kind in watched:
            step = draft.required_optimizer_step(op)
            if step is not None:
                waits[op] = steps[step]
    result = SteadyStateProgram(program, spec, steps, {op: tuple(ds) for op, ds in deps.items()}, waits)
    return result.validate() if validate else result


def _with_issue_edges(program: StreamProgram, spec: SteadyState) -> StreamProgram:
    """``program`` with the host's issue order (module docstring): on every device stream, the first
    op of a newer iteration waits for every ``X`` op of the iteration before it."""
    tails: dict[int, list[Op]] = {}
    for _, _, _, op in program.ops():
        if op.kind is OpKind.X:
            tails.setdefault(spec.iteration_of(op.microbatch_index), []).append(op)
    if not tails:
        return program
    deps = dict(program.deps)
    for per_stream in program.streams:
        for ops in per_stream.values():
            newest = 0
            for op in ops:
                iteration = op_iteration(program, op, spec)
                if iteration > newest:
                    newest = iteration
                    deps[op] = tuple(deps.get(op, ())) + tuple(tails.get(iteration - 1, ()))
    return StreamProgram(program.plan, program.streams, deps, program.chunk_bytes, program.recompute)
