"""Devices of unequal speed and memory (issue 21 item 1, DESIGN.md section 12): the weighted dispatch
in the builder, the simulator's per-device speeds, the CPU driver's speed throttle, the profiler's
per-device scaling, the automatic choice between the rules, per-device memory, parity with the
default strategy, and `roundpipe plan --devices <list>`."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import lightning as L
import pytest
import torch

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, fit_params, max_diff, tiny_hf, trainer, loader
from lightning_roundpipe.cli import main
from lightning_roundpipe.cli.mixed_plan import parse_devices
from lightning_roundpipe.partition import LayerProfile
from lightning_roundpipe.partition.devices import KNOWN_GPUS, MixedDevices, relative_speeds, stage_costs
from lightning_roundpipe.runtime.backends import CpuBackend, make_backends
from lightning_roundpipe.runtime.backends.budget import DeviceMemoryError
from lightning_roundpipe.runtime.tuning.profiler import LayerProfiler
from lightning_roundpipe.schedule import ActionKind, build_roundpipe_plan, build_stages, build_steady_state_plan
from lightning_roundpipe.schedule.dispatch import DispatchPolicy
from lightning_roundpipe.simulate import simulate

TOL = 1e-5
MiB = 2**20
COMMON = dict(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)


def _stages():
    """F(layer 0), F(layer 1), the fused tail X(layer 2), B(layer 1), B(layer 0): stage indices 0..4."""
    return build_stages([range(0, 1), range(1, 2)], [range(2, 3), range(1, 2), range(0, 1)], fused_tail=True)


def _six_stages():
    """F(0), F(1), F(2), the fused tail X(3), B(1..2), B(0): stage indices 0..5."""
    return build_stages([range(0, 1), range(1, 2), range(2, 3)], [range(3, 4), range(1, 3), range(0, 1)], fused_tail=True)


def _computes(plan, device_index):
    return [str(a) for a in plan.actions[device_index] if a.kind.is_compute]


# ---------------------------------------------------------------------------------------- builder
def test_weighted_builder_matches_a_hand_enumerated_schedule():
    """docs/partitioner.md section 8's worked example. Speeds (1.0, 0.5), six stages of cost 1, two
    microbatches: a dispatch takes 2 s on device 0, 4 s on device 1. By hand (finish = load + 2 / speed,
    ties to the first device after the previous dispatch's): stage 0 -> dev0 (2 vs 4); stage 1 -> dev1
    (4 vs 4, rotation from dev1); stage 2 -> dev0 (4 vs 8); stage 3 -> dev0 (8 vs 6); stage 4 -> dev1
    (8 vs 8, rotation from dev1); stage 5 -> dev0 (8 vs 12). Loads 8 s and 8 s; the round robin's are
    6 s and 12 s."""
    policy = DispatchPolicy("weighted", (1.0, 0.5), (1.0,) * 6)
    plan = build_roundpipe_plan(_six_stages(), 2, 2, dispatch=policy)
    assert _computes(plan, 0) == ["0F0", "0F1", "2F0", "2F1", "3X0", "3X1", "5B0", "5B1"]
    assert _computes(plan, 1) == ["1F0", "1F1", "4B0", "4B1"]
    assert plan._meta["next_cursor"] == 1  # the device after the last dispatch's
    assert plan._meta["device_speeds"] == (1.0, 0.5) and plan._meta["dispatch_rule"] == "weighted"
    # each device's compute: its compute actions x 1 s on a device of speed 1, over its speed
    assert [len(_computes(plan, d)) * 1.0 / s for d, s in enumerate((1.0, 0.5))] == [8.0, 8.0]
    plain = build_roundpipe_plan(_six_stages(), 2, 2, dispatch=DispatchPolicy("round_robin", (1.0, 0.5)))
    assert _computes(plain, 1) == ["1F0", "1F1", "3X0", "3X1", "5B0", "5B1"]  # stage k on device k mod 2
    assert [len(_computes(plain, d)) * 1.0 / s for d, s in enumerate((1.0, 0.5))] == [6.0, 12.0]
    assert plain._meta["device_speeds"] == (1.0, 0.5)


@pytest.mark.parametrize("num_devices", [1, 2, 3, 4])
def test_weighted_rule_on_equal_devices_is_the_round_robin(num_devices):
    """Equal speeds and dispatches of equal cost: the weighted rule is the round robin itself, for
    every cursor, microbatch count, equal rounds and the steady state's iterations."""
    for num_layers in (2, 4, 6):
        stages = build_stages([range(i, i + 1) for i in range(num_layers - 1)],
                              [range(num_layers - 1 - i, num_layers - i) for i in range(num_layers)], fused_tail=True)
        policy = DispatchPolicy("weighted", (1.0,) * num_devices, (1.0,) * len(stages))
        for m, per_round in ((1, None), (3, None), (4, 2), (6, 3)):
            for cursor in range(num_devices):
                a = build_roundpipe_plan(stages, num_devices, m, cursor, microbatches_per_round=per_round)
                b = build_roundpipe_plan(stages, num_devices, m, cursor, microbatches_per_round=per_round, dispatch=policy)
                assert a.actions == b.actions and a._meta["next_cursor"] == b._meta["next_cursor"]
                s1 = build_steady_state_plan(stages, num_devices, m, 3, cursor=cursor, microbatches_per_round=per_round)
                s2 = build_steady_state_plan(stages, num_devices, m, 3, cursor=cursor, microbatches_per_round=per_round,
                                             dispatch=policy)
                assert s1.actions == s2.actions and s1._meta["next_cursor"] == s2._meta["next_cursor"]


def test_weighted_rule_keeps_stages_on_devices_that_hold_them_and_rejects_bad_policies():
    allowed = ((0, 1), (1,), (0,), (0, 1), (0, 1))  # stage 1 only on dev1, stage 2 only on dev0
    plan = build_roundpipe_plan(_stages(), 2, 3, dispatch=DispatchPolicy("weighted", (0.5, 1.0), None, allowed))
    for device_index, actions in enumerate(plan.actions):
        for action in actions:
            assert device_index in allowed[action.stage_index], (device_index, str(action))
    assert plan._meta["stage_devices"] == allowed
    assert plan.validate() is plan
    steady = build_steady_state_plan(_stages(), 2, 2, 4, dispatch=DispatchPolicy("weighted", (1.0, 0.25)))
    assert steady.validate() is steady  # the loads carry on over the iterations: no deadlock
    with pytest.raises(ValueError, match="`rule` must be one of"):
        DispatchPolicy("fastest")
    with pytest.raises(ValueError, match="`device_speeds` must hold one finite number > 0"):
        DispatchPolicy("weighted", (1.0, 0.0))
    with pytest.raises(ValueError, match="round robin cannot honour"):
        DispatchPolicy("round_robin", None, None, allowed)
    with pytest.raises(ValueError, match="has 3 entries for 2 devices"):
        build_roundpipe_plan(_stages(), 2, 2, dispatch=DispatchPolicy("weighted", (1.0, 1.0, 1.0)))
    with pytest.raises(ValueError, match="names device"):
        build_roundpipe_plan(_stages(), 2, 2, dispatch=DispatchPolicy("weighted", None, None, ((2,),) * 5))


# ---------------------------------------------------------------------------------------- simulator
def test_simulator_times_the_weighted_plan_with_device_speeds():
    """Transfers free; layer 0: forward 1 s, backward 2 s; layer 1: forward 1 s, backward 3 s; stages
    F(0), X(1), B(0) (costs 1, 4, 3), two microbatches, speeds (1.0, 0.5). The weighted rule (loads
    by hand: F -> dev0 at 2; X -> dev0 at 10 vs dev1 16; B -> dev1 at 12 vs dev0 16) and the hand
    critical path: dev0 F0 [0,1] F1 [1,2] X0 [2,6] X1 [6,10]; dev1 (half speed) recomputes B's input
    right away, R0 [0,2], B0 waits for X0: [6,10], R1 [10,12], B1 [12,16]: 16 s. The round robin
    (F, B on dev0, X on dev1): X0 [1,9] X1 [9,17] on dev1, B1 after X1 [17,19]: 19 s."""
    profiles = [LayerProfile(forward_s=1.0, backward_s=2.0, param_bytes=8, activation_bytes=8),
                LayerProfile(forward_s=1.0, backward_s=3.0, param_bytes=8, activation_bytes=8)]
    stages = build_stages([range(0, 1)], [range(1, 2), range(0, 1)], fused_tail=True)
    devices = MixedDevices((1.0, 0.5))
    weighted = build_roundpipe_plan(stages, 2, 2, dispatch=devices.policy("weighted", stages, profiles))
    assert _computes(weighted, 0) == ["0F0", "0F1", "1X0", "1X1"] and _computes(weighted, 1) == ["2B0", "2B1"]
    assert simulate(weighted, profiles).iteration_s == pytest.approx(16.0)
    plain = build_roundpipe_plan(stages, 2, 2, dispatch=devices.policy("round_robin", stages, profiles))
    assert simulate(plain, profiles).iteration_s == pytest.approx(19.0)
    # equal devices, the same costs: F -> dev0 (a tie: the cursor), X -> dev1 (8 vs 10), B -> dev0 (8 vs 14);
    # dev1 X0 [1,5] X1 [5,9]; dev0 F F [0,2], R0 [2,3], B0 [5,7], R1 [7,8], B1 [9,11]: 11 s
    equal = build_roundpipe_plan(stages, 2, 2, dispatch=DispatchPolicy("weighted", None, (1.0, 4.0, 3.0)))
    assert _computes(equal, 1) == ["1X0", "1X1"]
    assert simulate(equal, profiles).iteration_s == pytest.approx(11.0)
    # the steady state rebuilds the plan with the same dispatch (the weighted rule, the speeds)
    steady = simulate(weighted, profiles, steady_state=True)
    assert steady.iteration_s > 0 and len(steady.idle_pct) == 2


def test_stage_devices_follow_the_memory_model():
    profiles = [LayerProfile(forward_s=1.0, backward_s=2.0, param_bytes=100, activation_bytes=1) for _ in range(3)]
    stages = build_stages([range(0, 2)], [range(2, 3), range(0, 2)], fused_tail=True)
    # the partitioner's model (partition/partitioner.py): forward 0..1: weights 200 + input/output 2 = 202;
    # the tail (layer 2): weights 100 + gradients 100 + max(saved 1 + input/output 1, fresh gradient 100) = 300;
    # backward 0..1: 200 + 200 + max(2 + 2, 100) = 500
    policy = MixedDevices((1.0, 0.5), (1000, 250)).policy("weighted", stages, profiles)
    assert policy.stage_devices == ((0, 1), (0,), (0,))
    assert MixedDevices((1.0, 0.5), (1000, 300)).policy("weighted", stages, profiles).stage_devices == ((0, 1), (0, 1), (0,))
    assert policy.stage_costs == (2.0, 3.0, 6.0)
    with pytest.raises(ValueError, match="more than any device's per-stage budget"):
        MixedDevices((1.0, 0.5), (300, 250)).policy("weighted", stages, profiles)
    assert relative_speeds([165.2e12, 71e12]) == pytest.approx((1.0, 71 / 165.2))


# ---------------------------------------------------------------------------------------- runtime pieces
def test_cpu_throttle_slows_each_op_and_each_span_by_one_over_speed(monkeypatch):
    """A fake clock (wall and the thread's CPU time). The op computes 1 s, marks, computes 2 s more. At
    speed 0.25 each span lasts 4x its CPU time: the worker sleeps 3 s at the mark and 6 s at the op's
    end; a sleep overshoots by 0.5 s (timer slack), which the next sleep gives back. A second op whose
    1 s of CPU time took 3 s of wall time (the host's other threads) sleeps only the 1 s missing."""
    from lightning_roundpipe.runtime.backends import cpu

    lock = threading.Lock()
    clock = {"wall": 0.0, "cpu": 0.0}
    sleeps: list[float] = []

    def advance(wall: float, cpu_s: float) -> None:
        with lock:
            clock["wall"] += wall
            clock["cpu"] += cpu_s

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        advance(seconds + 0.5, 0.0)

    backend = CpuBackend(0)
    try:
        monkeypatch.setattr(cpu, "time", SimpleNamespace(perf_counter=lambda: clock["wall"], thread_time=lambda: clock["cpu"],
                                                         sleep=sleep))
        backend.set_speed(0.25)
        marks = []

        def work() -> None:
            advance(1.0, 1.0)
            marks.append(backend.mark())
            advance(2.0, 2.0)

        backend.launch("compute", work)
        backend.synchronize()
        assert sleeps == [pytest.approx(3.0), pytest.approx(6.0 - 0.5)]
        assert marks == [pytest.approx(1.0 + 3.0 + 0.5)]  # the span before the mark took 1 / 0.25 its work (+ slack)
        assert clock["wall"] == pytest.approx(4 * 3.0 + 0.5)  # the whole op: 4 x its 3 s; the slack given back
        backend.launch("compute", lambda: advance(3.0, 1.0))
        backend.synchronize()
        assert sleeps[2:] == [pytest.approx(4 * 1.0 - 3.0 - 0.5)]  # the previous overshoot taken off too
        with pytest.raises(ValueError, match=r"in \(0, 1\]"):
            backend.set_speed(1.5)
    finally:
        monkeypatch.undo()
        backend.close()


def test_profiler_scales_samples_to_a_device_of_speed_one():
    profiler = LayerProfiler(1)
    profiler.speed_probe = lambda: [1.0, 0.5]
    profiler.record("forward", 0, 9.0, 0)
    profiler.record("backward", 0, 9.0, 1)
    profiler.end_step()  # the warm-up step: dropped; the probe runs after it
    assert profiler.device_speeds == [1.0, 0.5] and profiler.avg["forward"] is None
    profiler.record("forward", 0, 1.0, 0)  # 1 s on the fast device
    profiler.record("forward", 0, 2.0, 1)  # the same work on the half-speed device
    profiler.record("backward", 0, 6.0, 1)
    profiler.end_step()
    assert profiler.avg["forward"] == [pytest.approx(1.0)] and profiler.avg["backward"] == [pytest.approx(3.0)]


def test_configuration_errors_name_the_argument():
    from lightning_roundpipe.runtime.tuning.mixed import configure_devices

    with pytest.raises(ValueError, match=r"`cpu_device_speeds\[1\]` must be a positive finite number"):
        lightning_roundpipe.RoundPipeStrategy(cpu_device_speeds=[1.0, float("inf")])
    with pytest.raises(ValueError, match="`dispatch` must be one of"):
        lightning_roundpipe.RoundPipeStrategy(dispatch="fast")
    with pytest.raises(ValueError, match=r"`device_memory_bytes\[0\]`"):
        lightning_roundpipe.RoundPipeStrategy(device_memory_bytes=[0, 5])
    with pytest.raises(ValueError, match=r"`device_memory_bytes` has 2 entries for 3 devices\. HINT"):
        make_backends([torch.device("cpu")] * 3, device_memory_bytes=[2**20, 2**20])
    engine = SimpleNamespace(backends=[SimpleNamespace(is_cuda=False)] * 2, executor=SimpleNamespace(profiler=None))
    with pytest.raises(ValueError, match="has 3 entries for 2 devices. HINT"):
        configure_devices(engine, [1.0, 0.5, 0.5])
    gpus = SimpleNamespace(backends=[SimpleNamespace(is_cuda=True)] * 2, executor=SimpleNamespace(profiler=None))
    with pytest.raises(ValueError, match="CPU virtual devices only"):
        configure_devices(gpus, [1.0, 0.5])


def test_automatic_choice_takes_the_weighted_rule_only_by_its_margin(monkeypatch):
    """With the simulator stubbed (the oracle: weighted timed 10 % faster, then 1 % faster), the choice
    takes the weighted dispatch only when it beats the round robin by the margin, and says so."""
    from lightning_roundpipe.adapters import make_layer_sequence
    from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
    from lightning_roundpipe.runtime.tuning import autopartition
    from lightning_roundpipe.runtime.tuning.mixed import configure_devices

    engine = RoundPipeEngine(make_layer_sequence(tiny_hf(layers=3)), [torch.device("cpu")] * 2, 3,
                             auto_partition_after_steps=2)
    try:
        lines: list[str] = []
        engine.info = lines.append
        configure_devices(engine, [1.0, 0.5])
        engine._last_call, engine._last_sizes = (3, True), [1] * 3
        profiles = [LayerProfile(forward_s=1.0, backward_s=2.0, param_bytes=100, activation_bytes=10)
                    for _ in range(len(engine.seq))]
        for gain, expected in ((0.10, "weighted"), (0.01, "round_robin")):
            monkeypatch.setattr(autopartition, "simulated_step_s",
                                lambda e, p, prof, per_round=None, count=None, dispatch_rule=None, gain=gain:
                                1.0 - gain if dispatch_rule == "weighted" else 1.0)
            choice = autopartition.choose_partition(engine, profiles)
            assert choice.dispatch_rule == expected and engine.dispatch_rule == expected
            assert f"dispatch {expected.replace('_', ' ')}" in lines[-1]
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------- training
class _Lines:
    """An ``engine.info`` that keeps every line (and still reports it)."""

    def __init__(self, lines: list[str], report) -> None:
        self.lines, self.report = lines, report

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        self.report(line)


class _Watch(L.Callback):
    """After every training batch: the engine's dispatch rule, speeds, the stages each device ran
    (the plan of the last call) and each device's budget-ledger peak."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.speeds: list = []
        self.placed: list[list[set[int]]] = []
        self.peaks: list = []
        self.costs: list = []
        self.lines: list[str] = []
        self.profiled: list[bool] = []
        self.engine = None

    def on_train_batch_end(self, trainer, *args) -> None:
        engine = self.engine = trainer.strategy.engine
        if not isinstance(engine.info, _Lines):
            engine.info = _Lines(self.lines, engine.info)
        self.rules.append(engine.dispatch_rule)
        self.speeds.append(getattr(engine, "measured_device_speeds", None))
        plan = engine.plan(engine._last_call[0], 0, fused=engine._last_call[1])
        self.placed.append([{a.stage_index for a in actions if a.kind is not ActionKind.DROP} for actions in plan.actions])
        policy = plan._meta["builder"]["dispatch"]
        self.costs.append(None if policy is None else policy.stage_costs)
        self.profiled.append(engine.measured_profiles is not None)
        self.peaks.append(engine.pop_device_memory_peaks())


@pytest.mark.parametrize("dispatch,partition,slow", [("weighted", "auto", 0.5), ("auto", "auto", 0.5),
                                                     ("auto", "default", 0.25)])
def test_parity_on_devices_of_unequal_speed(dispatch, partition, slow):
    """2 CPU virtual devices with speeds [1.0, 0.5]: the weighted plan (or the automatic choice after
    the speeds are measured, with the automatic partition or the fixed one) trains the same parameters
    as Lightning's default strategy (fp32, 1e-5). (With the fixed partition device 1 runs at 0.25, so
    the speeds differ beyond the tolerance, and the rule is chosen.) The speeds are the configured ones: no
    probe runs on CPU virtual devices."""
    make, data = (lambda: CausalLMModule(tiny_hf("llama"))), TokenData()
    ref = fit_params(make, data, **COMMON)
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, cpu_device_speeds=[1.0, slow],
                                                     dispatch=dispatch, profile_steps=2, partition=partition)
    module, watch = make(), _Watch()
    trainer(strategy, 2, callbacks=[watch], **COMMON).fit(module, loader(data))
    got = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert max_diff(ref, got) <= TOL
    assert max_diff(got, fit_params(make, data, max_steps=0)) > 1e-3  # training changed the weights
    # CPU virtual devices: the configured speeds are the speeds, never a probe's (issue 31 item 6)
    assert watch.speeds == [None] * len(watch.speeds)
    assert watch.engine.device_speeds == (1.0, slow) and watch.engine.device_speeds_source == "configured"
    if dispatch == "auto" and partition == "default":  # no automatic partition: the rule is chosen alone, once
        assert any("for the fixed partition" in line for line in watch.lines)
    if dispatch == "weighted":
        assert set(watch.rules) == {"weighted"}
        first = watch.placed[0]  # before profiling: 1 per forward layer, 3 per backward layer, speeds [1.0, 0.5]
        assert len(first[0]) > len(first[1]) > 0  # the fast device runs more stages, the slow one some
        assert watch.costs[0] is None and watch.profiled[-2]  # then the plans balance the measured stage costs
        engine = watch.engine
        assert watch.costs[-1] == stage_costs(engine.measured_profiles, engine.fused_stages)


def test_weighted_dispatch_keeps_large_stages_off_the_small_device():
    """Budgets [8 MiB, 1.5 MiB]: the stages that hold the (tied) 1 MiB embedding / LM head (with its
    fp32 gradient accumulator in the backward) need more than half of the small device. The weighted
    plan runs them on the large device only; the CPU budget ledger (the oracle: it raises at once when
    a device would exceed its budget, and its peaks are read after every step) never saw the small
    device above its budget, and the training matches the default strategy. The round robin on the
    same devices runs out of memory on the small device."""
    from lightning_roundpipe.recipes.smollm2 import tiny_smollm2

    budgets = [8 * MiB, 3 * MiB // 2]
    make, data = (lambda: CausalLMModule(tiny_smollm2(num_hidden_layers=4, vocab_size=4096))), TokenData()
    kw = dict(max_steps=2)
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=2, partition="default", dispatch="weighted",
                                                     device_memory_bytes=budgets)
    module, watch = make(), _Watch()
    trainer(strategy, 2, callbacks=[watch], **kw).fit(module, loader(data))
    assert max_diff(fit_params(make, data, **kw), {n: p.detach() for n, p in module.named_parameters()}) <= TOL
    assert watch.peaks and all(0 < peak[1] <= budgets[1] and peak[0] <= budgets[0] for peak in watch.peaks)
    store, stages = watch.engine.store, watch.engine.fused_stages
    large = {s.stage_index for s in stages if store.layout(s.layers).total_bytes > budgets[1] // 4}
    assert large  # the prefix (embedding), the tail (LM head) and the prefix's backward stage
    for on_large, on_small in watch.placed:
        assert large <= on_large and not large & on_small and on_small  # the small device computes the rest
    plain = lightning_roundpipe.RoundPipeStrategy(num_microbatches=2, partition="default", dispatch="round_robin",
                                                  device_memory_bytes=budgets)
    with pytest.raises(DeviceMemoryError) as info:
        trainer(plain, 2, **kw).fit(make(), loader(data))
    assert info.value.device_index == 1 and info.value.budget_bytes == budgets[1]


# ---------------------------------------------------------------------------------------- roundpipe plan
def test_devices_argument_parses_counts_names_and_numbers():
    assert parse_devices("8") == 8
    got = parse_devices("4090,4090, RTX-3090,3060")
    assert [d.name for d in got] == ["RTX 4090", "RTX 4090", "RTX 3090", "RTX 3060"]
    assert got[0] == KNOWN_GPUS["4090"] and got[0].bf16_flops_per_s == 165.2e12 and got[0].memory_bytes == 24 * 2**30
    explicit = parse_devices("330:24,142:12.5")
    assert [d.bf16_flops_per_s for d in explicit] == [330e12, 142e12]
    assert [d.memory_bytes for d in explicit] == [24 * 2**30, int(12.5 * 2**30)]
    assert len(parse_devices("rtx4090")) == 1 and len(parse_devices("4090,")) == 1
    for bad, message in (("4090,foo", "unknown GPU 'foo'; known: 4090"), ("4090,,3090", "empty entry at position 1"),
                         ("330:x", "two finite numbers > 0"), ("0:24", "two finite numbers > 0"),
                         ("330:24:1", "two finite numbers > 0")):
        with pytest.raises(ValueError, match=message):
            parse_devices(bad)


def test_plan_command_prints_both_dispatch_rules(capsys):
    assert main(["plan", "--preset", "llama3.1-8b", "--devices", "4090,3090,3090,3060"]) == 0
    out = capsys.readouterr().out
    assert "RTX 3060" in out and "round robin " in out and "weighted" in out and "tokens/s" in out
    rows = [line for line in out.splitlines() if line.startswith(("round robin", "weighted")) and " stages, " in line]
    assert len(rows) == 2
    dispatches = next(line for line in out.splitlines() if line.startswith("stage dispatches per device, weighted"))
    counts = [int(part.split()[-1]) for part in dispatches.split(": ")[1].split(", ")]
    assert counts[0] > counts[3]  # the RTX 4090 (6.5x the RTX 3060's TFLOP/s) takes more stages
    assert main(["plan", "--preset", "llama3.1-8b", "--devices", "4090,nope"]) == 2
    assert "unknown GPU 'nope'" in capsys.readouterr().err
    assert main(["plan", "--preset", "llama3.1-8b", "--devices", "4090,3090", "--stage-memory-gib", "4"]) == 2
    assert "`--stage-memory-gib`" in capsys.readouterr().err
    for flag in ("--tflops", "--device-memory-gib"):  # the list gives them: a value beside it would be ignored
        assert main(["plan", "--preset", "llama3.1-8b", "--devices", "4090,3090", flag, "330"]) == 2
        assert f"`{flag}` sets one value for equal devices" in capsys.readouterr().err


def test_plan_header_says_mixed_only_for_unlike_devices(capsys):
    """The device list's header: ``identical`` for equal figures (a name and its `TFLOPS:GiB` alike),
    ``mixed`` otherwise; a model that fits no device: one sentence, one period before the HINT."""
    assert main(["plan", "--preset", "qwen3-1.7b", "--devices", "4090,4090", "--grid-rows", "2"]) == 0
    assert "devices (2, identical;" in capsys.readouterr().out
    assert main(["plan", "--preset", "qwen3-1.7b", "--devices", "4090,3090", "--grid-rows", "2"]) == 0
    assert "devices (2, mixed;" in capsys.readouterr().out
    assert main(["plan", "--preset", "llama3.1-8b", "--devices", "1:0.5,2:0.5", "--grid-rows", "2"]) == 2
    err = capsys.readouterr().err
    assert "HINT" in err and ".." not in err.replace("...", "")


def test_speeds_too_far_apart_and_whole_number_budgets():
    """A device more than 100x slower than the fastest is refused (each op would sleep 100x its work:
    the run would look hung); a budget given as a whole-number float (``1e9`` from a command line) or
    a numpy int is taken as that int."""
    import numpy as np

    with pytest.raises(ValueError, match=r"more than 100x slower than the fastest.*HINT"):
        lightning_roundpipe.RoundPipeStrategy(cpu_device_speeds=[1.0, 1e-9])
    with pytest.raises(ValueError, match="is an empty list"):
        lightning_roundpipe.RoundPipeStrategy(cpu_device_speeds=[])
    assert lightning_roundpipe.RoundPipeStrategy(device_memory_bytes=1e9).device_memory_bytes == 10**9
    assert lightning_roundpipe.RoundPipeStrategy(device_memory_bytes=[np.int64(2**30), 2e6]).device_memory_bytes == (
        2**30, 2 * 10**6)
    with pytest.raises(ValueError, match="`device_memory_bytes` must be a whole number of bytes .*, got 1.5"):
        lightning_roundpipe.RoundPipeStrategy(device_memory_bytes=1.5)


def test_plan_devices_named_like_a_count_or_a_rate(capsys):
    """`--devices 3060` is a count (out of range: the error says how to name one RTX 3060), and a GPU
    name where `TFLOPS:GiB` wants TFLOP/s (`4090:24`) is refused, not read as 4,090 TFLOP/s."""
    from lightning_roundpipe.cli.mixed_plan import parse_devices

    with pytest.raises(ValueError, match=r"`4090` is a GPU's name: write `--devices 4090`"):
        parse_devices("4090:24")
    assert parse_devices("330:24")[0].bf16_flops_per_s == 330e12
    from lightning_roundpipe.cli import main

    assert main(["plan", "--devices", "3060", "--preset", "llama3.1-8b"]) != 0
    assert "write `--devices rtx3060`" in capsys.readouterr().err
