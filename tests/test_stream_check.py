"""The asynchronous CPU driver and its checking mode: the logic a GPU runs, tested without one.

Oracles: the stream program's own validation (`StreamProgram.validate`, a pure pass that derives what
each op needs from the plan) says which removed edge makes a race; the checking mode must then refuse
that program at run time, naming the op, with no artificial delay. The run-ahead test's oracle is
the residency rule of the design (at most two stage weight buffers per device) and the pool's
allocation counter (constant after the first step).
"""

from __future__ import annotations

import threading

import lightning as L
import pytest

import lightning_roundpipe
from lightning_roundpipe.runtime.execution import engine as engine_module
from lightning_roundpipe.runtime.backends import StreamChecker, StreamCheckError
from lightning_roundpipe.runtime.backends.checker import Access
from lightning_roundpipe.schedule import PlanValidationError
from lightning_roundpipe.schedule.program import Op, OpKind, StreamProgram
from _helpers import CausalLMModule, TokenData, fit_params, hold_devices_until_issued, max_diff, params, tiny_hf


# ---------------------------------------------------------------------- the checker alone
def test_a_read_after_waiting_for_the_writer_passes_and_without_waiting_raises():
    checker = StreamChecker()
    producer, consumer, stranger = (0, "compute"), (0, "d2h"), (1, "h2d")
    checker.issue(producer, "0F0", Access(writes=((("out", 0, 0), None),)))
    event = checker.record(producer)
    checker.wait(consumer, event)
    checker.issue(consumer, "0D2H0", Access(reads=((("out", 0, 0), None),)))
    with pytest.raises(StreamCheckError, match="`1H2D0` reads `out:0:0` written by `0F0` without waiting"):
        checker.issue(stranger, "1H2D0", Access(reads=((("out", 0, 0), None),)))


def test_overwriting_a_buffer_still_being_read_raises():
    checker = StreamChecker()
    checker.issue((0, "h2d"), "0H2D0", Access(writes=((("in", 0, 0), None),)))
    checker.wait((0, "compute"), checker.record((0, "h2d")))
    checker.issue((0, "compute"), "0F0", Access(reads=((("in", 0, 0), None),)))
    with pytest.raises(StreamCheckError, match="overwrites `in:0:0` still read by `0F0`"):
        checker.issue((0, "h2d"), "0H2D0'", Access(writes=((("in", 0, 0), None),)))


def test_filling_a_pooled_buffer_needs_its_release():
    checker = StreamChecker()
    slot = ("weights", 0, 0)
    checker.issue((0, "weights"), "0LOAD.c0", Access(fills=((slot, (0, 0, 0)),)))
    checker.issue((0, "weights"), "0LOAD.c1", Access(fills=((slot, (0, 0, 1)),)))  # same load: fine
    checker.wait((0, "compute"), checker.record((0, "weights")))
    checker.issue((0, "compute"), "0F0", Access(reads=((slot, (0, 0, 1)),)))
    with pytest.raises(StreamCheckError, match="fills `weights:0:0` still holding"):
        checker.issue((0, "weights"), "2LOAD.c0", Access(fills=((slot, (2, 0, 0)),)))
    checker.wait((0, "d2h"), checker.record((0, "compute")))
    checker.issue((0, "d2h"), "0DROP", Access(releases=((slot, ("0F0",)),)))
    with pytest.raises(StreamCheckError, match="released by `0DROP` without waiting for the release"):
        checker.issue((0, "weights"), "2LOAD.c0", Access(fills=((slot, (2, 0, 0)),)))
    checker.wait((0, "weights"), checker.record((0, "d2h")))
    checker.issue((0, "weights"), "2LOAD.c0", Access(fills=((slot, (2, 0, 0)),)))


# ---------------------------------------------------------------------- one removed edge per op kind
def _move_before(program: StreamProgram, op: Op, before: Op) -> StreamProgram:
    """The program with ``op`` moved in front of ``before`` on their (common) stream."""
    device_index, stream, _ = program.location(op)
    ops = [x for x in program.streams[device_index][stream] if x != op]
    ops.insert(ops.index(before), op)
    streams = [dict(s) for s in program.streams]
    streams[device_index][stream] = tuple(ops)
    return StreamProgram(program.plan, tuple(streams), program.deps, program.chunk_bytes, program.recompute)


def _exposed(program: StreamProgram, kind: OpKind) -> StreamProgram:
    """For ``WD2H``/``DROP``, whose edge is implied by the stage's last ``D2H`` on the same stream,
    a valid reordering in which it is not (they move before that ``D2H``)."""
    if kind not in (OpKind.WD2H, OpKind.DROP):
        return program
    for op in program.topological_order():
        spec = program.plan.stages[op.stage_index]
        if op.kind is not kind or (kind is OpKind.DROP and spec.kind != "forward"):
            continue
        device_index, stream, position = program.location(op)
        earlier = [x for x in program.streams[device_index][stream][:position]
                   if x.kind is OpKind.D2H and x.stage_index == op.stage_index]
        if earlier:
            return _move_before(program, op, earlier[-1]).validate()
    raise AssertionError(f"no {kind.value} to expose")


def _racy(program: StreamProgram, kind: OpKind) -> tuple[StreamProgram, Op] | None:
    """The program without the first edge into a ``kind`` op that `validate()` says is needed."""
    program = _exposed(program, kind)
    for op in program.topological_order():
        if op.kind is not kind:
            continue
        for dep in program.deps.get(op, ()):
            candidate = program.without_edge(op, dep)
            try:
                candidate.validate()
            except PlanValidationError:
                return candidate, op
    return None


@pytest.mark.parametrize("kind", ["LOAD", "H2D", "GH2D", "F", "X", "R", "B", "D2H", "WD2H", "DROP"])
def test_checking_mode_names_the_op_whose_edge_was_removed(kind, monkeypatch):
    real_lower = engine_module.lower
    removed: list[Op] = []

    def lower_without_edge(plan, **kw):
        program = real_lower(plan, **kw)
        found = _racy(program, OpKind(kind))
        if found is None:
            return program
        removed.append(found[1])
        return found[0]

    monkeypatch.setattr(engine_module, "lower", lower_without_edge)
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default", check_streams=True)
    with pytest.raises(StreamCheckError) as info:
        fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), strategy=strategy, devices=2, max_steps=1)
    assert removed, f"no {kind} edge was removed: the test would prove nothing"
    assert f"`{removed[0]}`" in str(info.value).splitlines()[0]
    assert f">{removed[0]}<" in str(info.value)  # the grid marks it


# ---------------------------------------------------------------------- run-ahead and the pool
class _IssueWholeStepFirst(L.Callback):
    """At step 1, holds every device before the step; once the host has issued the whole program,
    records the pools and lets the devices go."""

    def __init__(self) -> None:
        self.seen: dict = {}
        self.allocations: list[list[int]] = []
        self._watcher: threading.Thread | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        executor = trainer.strategy.engine.executor
        self.allocations.append([sum(p.allocations for p in b.pools.values()) for b in executor.backends])
        if batch_idx != 1:
            return

        def record(run) -> None:
            self.seen = {"ops": len(run.issued), "buffers": [len(b.pool.buffers) for b in executor.backends]}

        self._watcher, self._done = hold_devices_until_issued(executor, record)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._watcher is not None:
            self._done.set()
            self._watcher.join()
            self._watcher = None


def test_the_host_issues_a_whole_step_before_any_device_runs_with_two_stage_buffers_per_device():
    callback = _IssueWholeStepFirst()
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama", layers=6)), TokenData(), max_steps=4)
    got = fit_params(lambda: CausalLMModule(tiny_hf("llama", layers=6)), TokenData(), devices=2, max_steps=4,
                     callbacks=[callback],
                     strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default"))
    assert callback.seen, "the host never issued the whole step while the devices were held"
    assert callback.seen["ops"] > 40  # a whole fused step: loads, uploads, F/X/R/B, downloads, drops
    assert all(1 <= n <= 2 for n in callback.seen["buffers"])  # never a third stage buffer
    # no allocation after the first step (the pools' counters)
    assert callback.allocations[1] == callback.allocations[-1]
    assert max_diff(ref, got) <= 1e-5  # and the held, run-ahead step still computes the same model


@pytest.mark.parametrize("devices,microbatches,rounds", [(1, 2, None), (2, 3, None), (3, 5, 2), (4, 9, 4)])
def test_pool_slots_never_share_a_buffer_between_resident_stages(devices, microbatches, rounds):
    """Oracle: the plan's own residency (LOAD .. DROP on each device's list): stages resident at the
    same time have different slots, and a device never needs more slots than ``max_resident_stages``."""
    from lightning_roundpipe.runtime.backends.pool import pool_slots
    from lightning_roundpipe.schedule import build_roundpipe_plan, build_stages, default_stage_ranges
    from lightning_roundpipe.schedule.ir import ActionKind
    from lightning_roundpipe.schedule.lower import plan_dispatches

    plan = build_roundpipe_plan(build_stages(*default_stage_ranges(11), fused_tail=True), devices, microbatches,
                                microbatches_per_round=rounds)
    slots = pool_slots(plan)
    by_load = {(x.device_index, x.load_position): x for x in plan_dispatches(plan)}
    for device_index, actions in enumerate(plan.actions):
        resident: dict[int, int] = {}  # stage -> slot
        for position, action in enumerate(actions):
            if action.kind is ActionKind.LOAD:
                dispatch = by_load[(device_index, position)]
                slot = slots[(device_index, dispatch.stage_index, dispatch.round_index)]
                assert slot not in resident.values()
                resident[action.stage_index] = slot
                assert len(resident) <= plan.max_resident_stages
            elif action.kind is ActionKind.DROP:
                del resident[action.stage_index]
        used = {slot for (d, _, _), slot in slots.items() if d == device_index}
        assert used == set(range(len(used))) and len(used) <= plan.max_resident_stages


def test_per_device_peak_memory_is_logged_and_bounded_by_physics():
    """Budgeted CPU virtual devices log `roundpipe/device{i}/peak_memory(GiB)`: at least two slots of
    the largest stage's weights (the pool, fp32 bytes counted from the model here) and at most the budget."""
    budget = 64 * 2**20
    metrics: list[dict] = []

    class Keep(lightning_roundpipe.RoundPipeMetricsCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            metrics.append({k: float(v) for k, v in self.last_metrics.items() if "peak_memory" in k})

    model = tiny_hf("llama", layers=4)
    largest_layer = max(sum(p.numel() * 4 for p in layer.parameters()) for layer in model.model.layers)
    fit_params(lambda: CausalLMModule(model), TokenData(), devices=2, max_steps=2, callbacks=[Keep()],
               strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default",
                                                              device_memory_bytes=budget))
    last = metrics[-1]
    assert set(last) == {"roundpipe/device0/peak_memory(GiB)", "roundpipe/device1/peak_memory(GiB)"}
    for value in last.values():
        assert 2 * largest_layer <= value * 2**30 <= budget


def test_the_automatic_choice_takes_the_smallest_measured_stage_budget():
    """GPUs measure their stage budget after the profiled steps; the choice uses the smallest of them
    and never more than the configured budget. CPU virtual devices measure nothing."""
    from types import SimpleNamespace

    from lightning_roundpipe.runtime.tuning.autopartition import stage_budget

    def backend(measured, device="cuda:0"):
        return SimpleNamespace(measured_stage_budget=lambda: measured, device=device)

    assert stage_budget(SimpleNamespace(backends=[backend(None)] * 2, stage_memory_bytes=100)) == 100
    two_gpus = [backend(70, "cuda:0"), backend(40, "cuda:1")]
    assert stage_budget(SimpleNamespace(backends=two_gpus, stage_memory_bytes=100)) == 40
    roomy = [backend(700, "cuda:0"), backend(400, "cuda:1")]
    assert stage_budget(SimpleNamespace(backends=roomy, stage_memory_bytes=100)) == 100
    assert stage_budget(SimpleNamespace(backends=[backend(70, "cuda:0"), backend(40, "cuda:1")],
                                        stage_memory_bytes=None)) == 40
    # two logical devices on one GPU share what that GPU measured
    assert stage_budget(SimpleNamespace(backends=[backend(80), backend(80)], stage_memory_bytes=None)) == 40


def test_shadows_are_refreshed_off_the_main_thread_in_upload_order(monkeypatch):
    """bf16-mixed: every optimizer step makes the trainable shadows stale; the next program copies
    them on the refresh thread (never the main thread), in the order the program first uploads them,
    and the run still matches the default strategy (its own parity oracle)."""
    from lightning_roundpipe.runtime.execution.executor import Executor
    from lightning_roundpipe.runtime.host.store import WeightStore

    events: list = []  # ("run", executor, program) then ("copy", thread name, key) for each shadow copied
    real_copy, real_run = WeightStore.refresh_entry, Executor.start  # every program is issued by `start`

    def copy_spy(self, key):
        events.append(("copy", threading.current_thread().name, key))
        return real_copy(self, key)

    def run_spy(self, program, state):
        events.append(("run", self, program))
        return real_run(self, program, state)

    monkeypatch.setattr(WeightStore, "refresh_entry", copy_spy)
    monkeypatch.setattr(Executor, "start", run_spy)
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), max_steps=3, precision="bf16-mixed")
    got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), devices=2, max_steps=3,
                     precision="bf16-mixed",
                     strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default"))
    copies = [e for e in events if e[0] == "copy"]
    assert copies and {name for _, name, _ in copies} == {"roundpipe-host-refresh"}
    checked = 0
    for i, event in enumerate(events):
        if event[0] != "run":
            continue
        _, executor, program = event
        keys = []
        for later in events[i + 1:]:
            if later[0] == "run":
                break
            keys.append(later[2])
        # oracle: position of each tensor's first upload in an in-order walk of the program
        first_use: dict[int, int] = {}
        for position, op in enumerate(program.topological_order()):
            if op.kind is OpKind.LOAD and op.chunk_index == 0:
                for key in executor.store.layout(program.plan.stages[op.stage_index].layers).tensors:
                    first_use.setdefault(key, position)
        positions = [first_use.get(key, 10**9) for key in keys]
        assert positions == sorted(positions)
        checked += bool(keys)
    assert checked >= 2  # the steps after the first optimizer steps refreshed their shadows
    # bf16 (unit roundoff 2**-8) rounding of the uploaded weights, relative to how far the weights moved
    moved = max_diff(ref, params(CausalLMModule(tiny_hf("llama"))))
    assert max_diff(ref, got) <= 3 * 2**-8 * moved


def test_a_pool_that_does_not_fit_names_the_largest_stage_and_its_two_slots():
    from lightning_roundpipe.runtime.backends import DeviceMemoryError

    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=2, partition="default", device_memory_bytes=20_000)
    with pytest.raises(DeviceMemoryError) as info:
        fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), strategy=strategy, devices=2, max_steps=1)
    message = str(info.value)
    assert "the stage weight pool" in message and "2 slots of" in message and "for the largest stage, stage " in message and "(forward, layers" in message
    assert "HINT: this device holds 2 slots of the largest stage" in message
    assert " bytes) > " in message  # a small budget prints bytes, never "0.0 MiB > 0.0 MiB"


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False), ("", False), ("yes", None)])
def test_the_checking_environment_variable_is_parsed_strictly(monkeypatch, value, expected):
    from lightning_roundpipe.runtime.backends.checker import CHECK_ENV, checking_default

    monkeypatch.setenv(CHECK_ENV, value)
    if expected is None:
        with pytest.raises(ValueError, match="valid values: 1, true, 0, false"):
            checking_default()
    else:
        assert checking_default() is expected
