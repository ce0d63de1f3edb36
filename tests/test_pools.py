"""Per-device buffer pools allocated once (DESIGN.md section 4, issue 18 item 2).

Oracles: the default Lightning strategy (parity), the design's residency rule (at most two stage
weight buffers per device), the pools' own allocation counters (constant once the sizes are known,
whatever the host runs ahead), a timing-free physical bound for slot reuse (in every schedule that
respects the program's edges, a slot is refilled only after the readers of its previous content
ended: checked on random durations, not with the vector clocks the assignment uses), and the
checking mode, which must refuse a pool that reuses a buffer the program does not order.
"""

from __future__ import annotations

import random
import threading

import lightning as L
import pytest
import torch

import lightning_roundpipe
from lightning_roundpipe.runtime.backends import StreamCheckError
from lightning_roundpipe.runtime.backends.pool import HostStagingPool
from lightning_roundpipe.runtime.execution import engine as engine_module
from lightning_roundpipe.schedule.buffers import device_slots, host_slots
from lightning_roundpipe.schedule import PlanValidationError
from lightning_roundpipe.schedule.lower import lower
from lightning_roundpipe.schedule.program import Op, OpKind, StreamProgram
from lightning_roundpipe.schedule.roundpipe import build_roundpipe_plan, build_stages, default_stage_ranges
from _helpers import (CausalLMModule, MLPModule, TokenData, VectorData, fit_params, hold_devices_until_issued, max_diff,
                      params, tiny_hf)

DEVICE_POOLS = ("stage weights", "transfers", "accumulators")


class _HoldOneStep(L.Callback):
    """Records every pool's allocation counter before each batch and at the end. At step 1 it holds
    every device before each program of the step (the transparent path runs two: the forward, then
    the backward from Lightning's ``loss.backward()``) until the host has issued the whole program,
    and records the stage buffers and the counters then."""

    def __init__(self, programs_per_step: int) -> None:
        self.programs_per_step = programs_per_step
        self.counters: list[dict[str, int]] = []
        self.held: list[dict] = []
        self._watchers: list[tuple[threading.Thread, threading.Event]] = []

    def _hold_next_program(self, executor) -> None:
        def record(run) -> None:
            self.held.append({"ops": len(run.issued), "buffers": [len(b.pool.buffers) for b in executor.backends],
                              "counters": executor.pool_allocations()})

        self._watchers.append(hold_devices_until_issued(executor, record))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        executor = trainer.strategy.engine.executor
        self.counters.append(executor.pool_allocations())
        self._batch_idx = batch_idx
        if batch_idx == 1:
            self._hold_next_program(executor)

    def on_before_backward(self, trainer, pl_module, loss):
        if self._batch_idx == 1 and self.programs_per_step == 2:
            self._watchers[-1][0].join()  # the forward program was issued and has run
            self._hold_next_program(trainer.strategy.engine.executor)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for watcher, done in self._watchers:
            done.set()
            watcher.join()
        self._watchers = []

    def on_train_end(self, trainer, pl_module):
        self.counters.append(trainer.strategy.engine.executor.pool_allocations())


CASES = {
    # the fused path (HF causal LM with labels), the autograd-transparent path (nn.Sequential), and
    # the fused path under bf16-mixed, whose backward stages sum into the pooled fp32 accumulators
    "fused": (lambda: CausalLMModule(tiny_hf("llama", layers=6)), TokenData, "32-true", 1),
    "transparent": (lambda: MLPModule(scheduler=False), VectorData, "32-true", 2),
    "fused-bf16": (lambda: CausalLMModule(tiny_hf("llama", layers=6)), TokenData, "bf16-mixed", 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_whole_step_issued_ahead_allocates_nothing_after_the_first_steps(case):
    make, data, precision, programs = CASES[case]
    hold = _HoldOneStep(programs)
    ref = fit_params(make, data(), max_steps=5, precision=precision)
    got = fit_params(make, data(), devices=2, max_steps=5, precision=precision, callbacks=[hold],
                     strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default"))
    assert len(hold.held) == programs, "the host never issued a whole program while the devices were held"
    assert sum(h["ops"] for h in hold.held) > 40  # loads, uploads, compute, downloads, drops of a whole step
    assert all(1 <= n <= 2 for h in hold.held for n in h["buffers"])  # never a third stage weight buffer
    first, second, last = hold.counters[1], hold.counters[2], hold.counters[-1]
    # device pools: sized by the first (profiled) step; the held, run-ahead step allocates nothing
    assert all(first[name] > 0 for name in ("stage weights", "transfers"))
    for seen in [h["counters"] for h in hold.held] + [last]:
        assert {k: first[k] for k in DEVICE_POOLS} == {k: seen[k] for k in DEVICE_POOLS}
    # every pool, host staging included, unchanged from the end of step 0: Lightning zeroes gradients after
    # `training_step`, so step 0's `.grad` is still alive while step 1's gradients come down, but `.grad` is
    # never a view of a staging block (tests/test_pinned_staging.py), so step 1 reuses step 0's blocks
    assert first["host staging"] > 0 and first == second == last
    if precision == "bf16-mixed":
        assert first["accumulators"] > 0
        # bf16 rounding of the uploaded weights, relative to how far the weights moved
        moved = max_diff(ref, params(make()))
        assert max_diff(ref, got) <= 3 * 2**-8 * moved
    else:
        assert first["accumulators"] == 0  # fp32 views: autograd sums in .grad, nothing to pool
        assert max_diff(ref, got) <= 1e-5


# ---------------------------------------------------------------------- slot assignment
def _program(devices: int, microbatches: int, rounds: int | None = None, layers: int = 11) -> StreamProgram:
    plan = build_roundpipe_plan(build_stages(*default_stage_ranges(layers), fused_tail=True), devices, microbatches,
                                microbatches_per_round=rounds)
    return lower(plan, stage_weight_bytes=[64] * len(plan.stages), chunk_bytes=32)


def _random_schedule(program: StreamProgram, seed: int) -> dict[Op, tuple[float, float]]:
    """``op -> (start, end)`` of one execution with random durations that respects stream order and edges."""
    rng = random.Random(seed)
    times: dict[Op, tuple[float, float]] = {}
    for op in program.topological_order():
        start = max((times[p][1] for p in program.predecessors(op)), default=0.0)
        times[op] = (start, start + rng.choice((0.01, 1.0, 7.0, 50.0)) * rng.random())
    return times


@pytest.mark.parametrize("devices,microbatches,rounds", [(1, 2, None), (2, 3, None), (3, 5, 2), (4, 9, 4)])
def test_a_pooled_slot_is_refilled_only_after_every_reader_of_its_previous_content_ended(devices, microbatches, rounds):
    program = _program(devices, microbatches, rounds)
    keep = frozenset(s.layers.start for s in program.plan.backward_stages)
    plans = device_slots(program) + [host_slots(program, 11, keep)[0]]
    reused = 0
    for seed in range(25):
        times = _random_schedule(program, seed)
        for plan in plans:
            for content, previous in plan.previous.items():
                if previous is None:
                    continue
                reused += 1
                refill = times[plan.producers[content]][0]
                assert all(times[reader][1] <= refill for reader in plan.readers[previous]), (content, previous)
    assert reused  # the pools do reuse slots: fewer buffers than transfers
    for plan in device_slots(program):
        assert plan.num_slots < len(plan.slots)


def test_a_rotated_plan_needs_the_same_slots():
    """The next call's plan starts at another device (the cursor): the same slots, devices relabelled,
    so pools sized once for one cursor fit every cursor."""
    stages = build_stages(*default_stage_ranges(11), fused_tail=True)
    shapes = []
    for cursor in range(3):
        program = lower(build_roundpipe_plan(stages, 3, 5, cursor=cursor))
        keep = frozenset(s.layers.start for s in program.plan.backward_stages)
        per_device = sorted(sorted(p.slots.items()) for p in device_slots(program))
        shapes.append((per_device, sorted(host_slots(program, 11, keep)[0].slots.items())))
    assert shapes[0] == shapes[1] == shapes[2]


# ---------------------------------------------------------------------- the checking mode
def _misplaced_refill(program: StreamProgram, kinds: tuple[OpKind, ...], pool: str) -> tuple[StreamProgram, Op] | None:
    """The program without one edge into a ``kinds`` op whose slot reuse relies on it, carrying the
    complete program's slot assignment: a pool that reuses a buffer the program no longer orders."""
    keep = frozenset(s.layers.start for s in program.plan.backward_stages)  # what a training call saves
    num_layers = max(s.layers.stop for s in program.plan.stages)
    key = "transfer_slots" if pool == "xfer" else ("host_slots", num_layers, keep)
    assignment = device_slots(program) if pool == "xfer" else host_slots(program, num_layers, keep)
    plans = assignment if pool == "xfer" else [assignment[0]]
    for op in program.topological_order():
        if op.kind not in kinds:
            continue
        for dep in program.deps.get(op, ()):
            candidate = program.without_edge(op, dep)
            try:
                clocks = candidate._vector_clocks(candidate.topological_order())
            except PlanValidationError:  # deadlocked: it could not run at all
                continue
            for plan in plans:
                for content, producer in plan.producers.items():
                    previous = plan.previous[content]
                    if producer == op and previous is not None and not all(
                            candidate._happens_before(reader, op, clocks) for reader in plan.readers[previous]):
                        candidate._cache[key] = assignment
                        return candidate, op
    return None


@pytest.mark.parametrize("pool,kinds", [("xfer", (OpKind.H2D, OpKind.GH2D)), ("host", (OpKind.D2H,))])
def test_the_checking_mode_refuses_a_pooled_buffer_refilled_before_its_readers(pool, kinds, monkeypatch):
    real_lower = engine_module.lower
    found: list[Op] = []

    def lower_with_misplaced_refill(plan, **kw):
        program = real_lower(plan, **kw)
        hit = _misplaced_refill(program, kinds, pool)
        if hit is None:
            return program
        found.append(hit[1])
        return hit[0]

    monkeypatch.setattr(engine_module, "lower", lower_with_misplaced_refill)
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default", check_streams=True)
    with pytest.raises(StreamCheckError) as info:
        fit_params(lambda: CausalLMModule(tiny_hf("llama", layers=6)), TokenData(), strategy=strategy, devices=2,
                   max_steps=1)
    assert found, "no refill relied on a removable edge: the test would prove nothing"
    first = str(info.value).splitlines()[0]
    assert f"`{found[0]}` refills pooled `{pool}:" in first, first
    assert f">{found[0]}<" in str(info.value)  # the grid marks it


# ---------------------------------------------------------------------- host staging blocks
def test_a_keyed_host_block_is_reused_only_once_nothing_references_it():
    sizes: list[int] = []
    pool = HostStagingPool(lambda n: sizes.append(n) or torch.empty(n, dtype=torch.uint8))
    first = pool.keyed(("act", 1, 0), 100)
    first[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    held = first[:4].view(torch.int32)  # e.g. a saved boundary the backward program still reads
    del first
    second = pool.keyed(("act", 1, 0), 100)  # the first block is referenced: a second one
    assert pool.allocations == 2 and held.item() == int.from_bytes(bytes([1, 2, 3, 4]), "little")
    del held, second
    pool.keyed(("act", 1, 0), 100)  # both free now: no allocation
    pool.keyed(("act", 1, 0), 64)
    assert pool.allocations == 2
    pool.keyed(("act", 1, 0), 300)  # larger than any block: the free block is replaced (exact size)
    assert pool.allocations == 3 and sizes == [100, 100, 300]
