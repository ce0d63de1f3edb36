"""The run's own mode, simulated (issue 19): the host's optimizer step as an op of the program,
steady state with one-step-stale weights, and the optimizer rate the runtime measures.

Oracles: closed-form periods and idle of equal-cost stages (derived in the docstrings), the ops'
order (nothing of a window before its optimizer step), the optimizer's bytes by definition (fp32
Adam: 12 bytes per parameter), and the measurement the runtime records during a real fit.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from lightning_roundpipe.partition.profile import (
    DEFAULT_HOST_OPTIMIZER_BYTES_PER_S,
    HardwareModel,
    LayerProfile,
    optimizer_step_bytes,
)
from lightning_roundpipe.runtime.tuning import optimizer_mode
from lightning_roundpipe.schedule import build_stages, build_steady_state_plan, lower_steady_state
from lightning_roundpipe.simulate.steady import optimizer_step_s, simulate_steady_program, simulate_training

C = 3.0  # seconds per microbatch of every stage


def _equal_stages(num_stages: int) -> tuple[tuple, list[LayerProfile]]:
    """``num_stages`` stages each costing ``C`` per microbatch: one forward stage over ``t = S - 2``
    layers (each ``forward_s = C / t``), the fused tail (one layer, ``C / 2 + C / 2``) and ``t``
    one-layer backward stages (``forward_s + backward_s = C``); ``S = 1``: the whole model as the
    fused tail (two layers of ``C / 4 + C / 4``)."""
    if num_stages == 1:
        profiles = [LayerProfile(forward_s=C / 4, backward_s=C / 4, param_bytes=0, activation_bytes=0)] * 2
        return build_stages([], [range(0, 2)], fused_tail=True), profiles
    t = num_stages - 2
    profiles = [LayerProfile(forward_s=C / t, backward_s=C - C / t, param_bytes=0, activation_bytes=0)] * t
    profiles.append(LayerProfile(forward_s=C / 2, backward_s=C / 2, param_bytes=0, activation_bytes=0))
    stages = build_stages([range(0, t)], [range(t, t + 1)] + [range(i, i + 1) for i in reversed(range(t))],
                          fused_tail=True)
    assert len(stages) == num_stages
    return stages, profiles


def _program(stages, devices: int, microbatches: int, windows: int, optimizer: str, accumulate: int = 1):
    plan = build_steady_state_plan(stages, devices, microbatches, windows * accumulate, optimizer=optimizer,
                                   accumulate_grad_batches=accumulate)
    # "late" recompute: a backward stage's recompute also waits for its incoming gradient, so every
    # stage runs microbatch m only after its predecessor stage finished m (one chain of cost C)
    return lower_steady_state(plan, recompute="late")


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("stages_count", [1, 3, 5, 9])
@pytest.mark.parametrize("extra_microbatches", [0, 1, 5])
def test_async_steady_state_matches_the_formula(devices, stages_count, extra_microbatches):
    """Equal stages (cost ``C``), ``M >= D`` microbatches, transfers free, optimizer step 0.

    Slot ``j`` of the round robin (stage ``j mod S`` of iteration ``j div S``) runs on device
    ``j mod D``; it starts when that device finished slot ``j - D`` (``M C`` after its start) and,
    inside an iteration, ``C`` after slot ``j - 1`` started. With ``M >= D`` the devices bind:
    slots start ``M C`` apart per row of ``D``, ``S M C / D`` per iteration, no device idle. The
    one-step-stale weights add one constraint: iteration ``k + 2`` starts after iteration ``k``
    ends, ``(S - 1) C + M C`` after it started, so at most two iterations are in flight. The host's
    issue order adds another: Lightning calls step ``k + 1`` once step ``k``'s loss is back, so
    iteration ``k + 1`` starts after iteration ``k``'s fused tail (slot ``f`` of it: ``f = 0`` for
    the whole model as one stage, else ``f = 1``) ends, ``f C + M C`` after iteration ``k`` started:

        period = C x max(S M / D, (S - 1 + M) / 2, f + M),   idle = 1 - S M C / (D x period).

    Measured over whole rotations (``n`` iterations with ``n S`` a multiple of ``D``, ``n`` even),
    from window 3 (after the fill).
    """
    microbatches = devices + extra_microbatches
    stages, profiles = _equal_stages(stages_count)
    rotation = devices // math.gcd(stages_count, devices)
    measured = rotation * 2 // math.gcd(rotation, 2)
    program = _program(stages, devices, microbatches, 3 + measured + 1, "async")
    result = simulate_steady_program(program, profiles, None, optimizer_step_s=0.0, measure_from_window=3)
    before_tail = 0 if stages_count == 1 else 1
    period = C * max(stages_count * microbatches / devices, (stages_count - 1 + microbatches) / 2,
                     before_tail + microbatches)
    assert result.step_s == pytest.approx(period, rel=1e-12)
    idle = 100 * (1 - stages_count * microbatches * C / (devices * period))
    assert result.mean_idle_pct == pytest.approx(idle, abs=1e-9)
    assert result.num_iterations == measured


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("stages_count", [3, 5, 9])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_sync_step_is_one_pipeline_plus_the_optimizer(devices, stages_count, accumulate):
    """Sync, ``M = D + 1``: within a window of ``A`` iterations slot ``j`` (stage ``s = j mod S`` of
    iteration ``k = j div S``, on device ``j mod D``) starts at the latest of: ``C`` after slot
    ``j - 1`` started (``s > 0``), ``M C`` after slot ``j - D`` started (its device), and, for
    ``s = 0``, ``M C`` after the previous iteration's fused tail (slot ``(k - 1) S + 1``) started
    (the host issues step ``k`` once step ``k - 1``'s loss is back). The window ends ``M C`` after
    its last slot starts; then the optimizer step (``OPT`` seconds), and only then does the next
    window upload anything: period per window ``start(A S - 1) + M C + OPT``."""
    microbatches, opt_s = devices + 1, 7.5
    stages, profiles = _equal_stages(stages_count)
    starts: list[float] = []
    for j in range(accumulate * stages_count):
        iteration, stage = divmod(j, stages_count)
        earliest = [0.0]
        if stage:
            earliest.append(starts[j - 1] + C)
        if j >= devices:
            earliest.append(starts[j - devices] + microbatches * C)
        if stage == 0 and iteration:
            earliest.append(starts[(iteration - 1) * stages_count + 1] + microbatches * C)
        starts.append(max(earliest))
    window = starts[-1] + microbatches * C + opt_s
    for windows in (1, 3):  # one window measured to its optimizer step's end = two measured start to start
        program = _program(stages, devices, microbatches, windows, "sync", accumulate)
        result = simulate_steady_program(program, profiles, None, optimizer_step_s=opt_s, measure_from_window=0)
        assert result.step_s * accumulate == pytest.approx(window, rel=1e-12)
        work = accumulate * stages_count * microbatches * C
        assert result.mean_idle_pct == pytest.approx(100 * (1 - work / (devices * window)), abs=1e-9)


def _iteration_of_label(interval, microbatches: int) -> int | None:
    return None if interval.microbatch_index is None else interval.microbatch_index // microbatches


@pytest.mark.parametrize("devices", [2, 3])
def test_sync_nothing_of_the_next_window_starts_before_the_optimizer_step_ends(devices):
    stages, profiles = _equal_stages(5)
    microbatches, opt_s = devices + 1, 4.0
    result = simulate_steady_program(_program(stages, devices, microbatches, 3, "sync"), profiles, None,
                                     optimizer_step_s=opt_s, measure_from_window=0, record_run=True)
    steps = result.optimizer_steps_s
    assert len(steps) == 3
    for k, (start, end) in enumerate(steps):
        assert end - start == pytest.approx(opt_s)
        mine = [iv for iv in result.run_timeline.intervals if _iteration_of_label(iv, microbatches) == k]
        later = [iv for iv in result.run_timeline.intervals if (_iteration_of_label(iv, microbatches) or -1) > k]
        assert start >= max(iv.end_s for iv in mine) - 1e-12  # after the iteration's last work
        assert min((iv.start_s for iv in later), default=math.inf) >= end - 1e-12


def test_async_optimizer_overlaps_and_keeps_the_staleness_edge():
    """Async: step k's optimizer runs while iteration k + 1 computes; iteration k + 2's first
    compute (its weights were uploaded after the step) starts after it; with an optimizer step longer
    than the pipeline the host sets the pace: the period is the step itself."""
    stages, profiles = _equal_stages(5)
    devices, microbatches = 2, 3
    work_s = 5 * microbatches * C / devices  # one iteration's compute per device
    opt_s = 0.5 * work_s
    result = simulate_steady_program(_program(stages, devices, microbatches, 6, "async"), profiles, None,
                                     optimizer_step_s=opt_s, record_run=True)
    intervals = result.run_timeline.intervals
    computes = [iv for iv in intervals if iv.is_compute]
    overlapped = False
    for k, (start, end) in enumerate(result.optimizer_steps_s):
        assert start >= max(iv.end_s for iv in computes if _iteration_of_label(iv, microbatches) == k) - 1e-12
        after = [iv.start_s for iv in computes if _iteration_of_label(iv, microbatches) == k + 2]
        if after:
            assert min(after) >= end - 1e-12
        nxt = [iv for iv in computes if _iteration_of_label(iv, microbatches) == k + 1]
        overlapped |= any(iv.start_s < end and iv.end_s > start for iv in nxt)
    assert overlapped  # the step is hidden under the next iteration's pipeline
    slow = simulate_steady_program(_program(stages, devices, microbatches, 7, "async"), profiles, None,
                                   optimizer_step_s=10 * work_s)
    assert slow.step_s == pytest.approx(10 * work_s)


def test_optimizer_step_seconds_and_the_default_rate():
    hw = HardwareModel(flops_per_s=1e12, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, host_optimizer_bytes_per_s=50e9)
    assert optimizer_step_bytes(1_000_000) == 12_000_000  # fp32 master + two Adam moments
    assert optimizer_step_s(12_000_000_000, hw) == pytest.approx(0.24)
    assert optimizer_step_s(12_000_000_000, None) == pytest.approx(12e9 / DEFAULT_HOST_OPTIMIZER_BYTES_PER_S)
    assert DEFAULT_HOST_OPTIMIZER_BYTES_PER_S == pytest.approx(200e9 * 12 / 34)  # 200 GB/s, 34 bytes moved per 12 counted
    with pytest.raises(ValueError, match="host_optimizer_bytes_per_s"):
        HardwareModel(flops_per_s=1e12, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, host_optimizer_bytes_per_s=0)
    stages, profiles = _equal_stages(3)
    one = simulate_training(stages, 2, 3, profiles, hw, optimizer="sync", optimizer_bytes=0)
    with_step = simulate_training(stages, 2, 3, profiles, hw, optimizer="sync", optimizer_bytes=12_000_000_000)
    assert with_step.step_s - one.step_s == pytest.approx(0.24)
    with pytest.raises(ValueError, match=r"`optimizer` must be one of \['sync', 'async'\]"):
        simulate_training(stages, 2, 3, profiles, hw, optimizer="stale")


# ---------------------------------------------------------------------------------------- runtime
def test_optimizer_state_bytes_count_masters_and_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[1].bias.requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adam = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    assert optimizer_mode.optimizer_state_bytes([adam]) == 4 * trainable  # no state before the first step
    model(torch.randn(3, 4)).sum().backward()
    adam.step()
    assert optimizer_mode.optimizer_state_bytes([adam]) == 12 * trainable == optimizer_step_bytes(trainable)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd.step()
    assert optimizer_mode.optimizer_state_bytes([sgd]) == 8 * trainable  # one momentum buffer, frozen bias out


def _fake_engine(profiling: bool = True):
    return types.SimpleNamespace(executor=types.SimpleNamespace(profiler=types.SimpleNamespace(enabled=profiling)))


def test_measured_rate_and_the_step_prediction_per_mode():
    engine = _fake_engine()
    model = torch.nn.Linear(10, 10)
    adam = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 10)).sum().backward()
    adam.step()
    nbytes = 12 * 110
    assert optimizer_mode.measured_optimizer_rate(engine) is None
    assert optimizer_mode.step_with_optimizer_s(engine, 2.0, 0.5) == 2.5  # no rate yet: the step's own time
    for seconds in (1.0, 0.010, 0.020, 0.030):  # the first (state creation) is dropped; the median of the rest
        optimizer_mode.record_optimizer_step(engine, [adam], seconds, "sync")
    assert optimizer_mode.measured_optimizer_rate(engine) == pytest.approx(nbytes / 0.020)
    assert optimizer_mode.predicted_optimizer_s(engine) == pytest.approx(0.020)
    assert optimizer_mode.step_with_optimizer_s(engine, 1.0) == pytest.approx(1.020)
    engine.optimizer_mode = "async"
    assert optimizer_mode.step_with_optimizer_s(engine, 1.0) == pytest.approx(1.0)  # hidden under the pipeline
    assert optimizer_mode.step_with_optimizer_s(engine, 0.005) == pytest.approx(0.020)  # the host sets the pace
    assert optimizer_mode.step_with_optimizer_s(engine, None) is None
    done = _fake_engine(profiling=False)
    optimizer_mode.record_optimizer_step(done, [adam], 0.5, "async")
    assert optimizer_mode.measured_optimizer_rate(done) is None and optimizer_mode.run_mode(done) == "async"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_fit_measures_the_host_optimizer_rate_during_the_profiled_steps(mode):
    """A real fit (CPU virtual devices, AdamW): the metrics callback records the optimizer step of
    each profiled step (async: the optimizer thread's busy time, from the step whose wait saw the
    first update done on); the bytes are the trainable fp32 masters and their two moments."""
    import lightning as L

    import lightning_roundpipe
    from _helpers import CausalLMModule, TokenData, loader, tiny_hf, trainer

    class Keep(L.Callback):
        engine = None

        def on_train_batch_end(self, trainer, *args, **kwargs):
            Keep.engine = trainer.strategy.engine

    module = CausalLMModule(tiny_hf(layers=2), optimizer="adamw", lr=1e-3)
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=2, profile_steps=3, optimizer=mode)
    t = trainer(strategy, devices=2, max_steps=5, callbacks=[Keep()])
    t.fit(module, loader(TokenData(40), 8))
    engine = Keep.engine
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    samples = engine._optimizer_samples
    # the profiled steps only (async: the first update may still run when its batch ends)
    assert len(samples) == 3 if mode == "sync" else 2 <= len(samples) <= 3
    assert all(nbytes == 12 * trainable for nbytes, _ in samples), (samples, trainable)
    assert optimizer_mode.measured_optimizer_rate(engine) > 0
    assert optimizer_mode.run_mode(engine) == mode
    assert engine.hardware_model() is None or engine.hardware_model().host_optimizer_bytes_per_s > 0


def test_mode_step_follows_the_stage_sizes_between_calls():
    """``mode_step_s`` (the steady state's step, predicted every step by the metrics callback) keeps
    the lowered program between calls; a call with other stage byte sizes or another chunk size must
    not reuse it. Oracle: the pure pipeline (plan, lowering, simulator) run directly on the sizes."""
    from lightning_roundpipe.simulate.steady import DEFAULT_WINDOWS, rotation_windows

    stages, profiles = _equal_stages(3)
    hardware = HardwareModel(flops_per_s=1e12, h2d_bytes_per_s=1e6, d2h_bytes_per_s=1e6)
    sizes = {"bytes_per_layer": 100_000}
    store = types.SimpleNamespace(stage_bytes=lambda layers: sizes["bytes_per_layer"] * len(layers),
                                  stage_grad_bytes=lambda layers: 2 * sizes["bytes_per_layer"] * len(layers))
    gpu = types.SimpleNamespace(is_cuda=True)  # no cores shared: the oracle below simulates none
    engine = types.SimpleNamespace(backends=[gpu, gpu], store=store, chunk_bytes=64 << 20, optimizer_mode="async",
                                   overlaps_steps=True, hardware_model=lambda: hardware,
                                   microbatch_weights=lambda n: None)
    windows, first = DEFAULT_WINDOWS["async"]
    windows = first + 1 + rotation_windows(len(stages), 2, 1)

    def direct() -> float:
        plan = build_steady_state_plan(stages, 2, 4, windows, optimizer="async", validate=False)
        program = lower_steady_state(
            plan, stage_weight_bytes=[store.stage_bytes(s.layers) for s in plan.stages],
            stage_grad_bytes=[store.stage_grad_bytes(s.layers) if s.kind == "backward" else 0 for s in plan.stages],
            chunk_bytes=engine.chunk_bytes, validate=False)
        return simulate_steady_program(program, profiles, hardware, optimizer_step_s=0.0,
                                       measure_from_window=first).step_s

    seen = []
    for bytes_per_layer, chunk_bytes in ((100_000, 64 << 20), (50_000_000, 64 << 20), (50_000_000, 1 << 20),
                                         (100_000, 64 << 20)):
        sizes["bytes_per_layer"], engine.chunk_bytes = bytes_per_layer, chunk_bytes
        step_s = optimizer_mode.mode_step_s(engine, 0.0, stages, profiles, None, 4)
        assert step_s == pytest.approx(direct(), rel=1e-12)
        seen.append(step_s)
    assert seen[1] > seen[0]  # 50 MB a layer on a 1 MB/s link: the uploads set the pace
    assert seen[3] == seen[0]


def test_steady_state_prediction_with_accumulation_is_the_pure_pipeline():
    """``steady_state_prediction`` (the benchmark's and ``mode_step_s``'s helper) in sync mode with
    ``accumulate_grad_batches=4``: the same result as the pure pipeline run directly (plan of 4
    batches to one optimizer step, lowering, simulator); a larger per-batch step without the
    accumulation (the drain before every optimizer step); bad input raises."""
    stages, profiles = _equal_stages(3)
    hardware = HardwareModel(flops_per_s=1e12, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    store = types.SimpleNamespace(stage_bytes=lambda layers: 1000 * len(layers),
                                  stage_grad_bytes=lambda layers: 2000 * len(layers))
    gpu = types.SimpleNamespace(is_cuda=True)
    engine = types.SimpleNamespace(backends=[gpu, gpu], store=store, chunk_bytes=64 << 20, optimizer_mode="async",
                                   overlaps_steps=True, hardware_model=lambda: hardware,
                                   microbatch_weights=lambda n: None)

    def direct(accumulate: int) -> tuple[float, float]:
        plan = build_steady_state_plan(stages, 2, 4, accumulate, optimizer="sync", accumulate_grad_batches=accumulate,
                                       validate=False)
        program = lower_steady_state(
            plan, stage_weight_bytes=[store.stage_bytes(s.layers) for s in plan.stages],
            stage_grad_bytes=[store.stage_grad_bytes(s.layers) if s.kind == "backward" else 0 for s in plan.stages],
            chunk_bytes=engine.chunk_bytes, validate=False)
        result = simulate_steady_program(program, profiles, hardware, optimizer_step_s=0.0, measure_from_window=0)
        return result.step_s, result.mean_idle_pct

    for accumulate in (1, 4):
        result = optimizer_mode.steady_state_prediction(engine, stages, profiles, None, 4, mode="sync",
                                                        accumulate_grad_batches=accumulate)
        assert (result.step_s, result.mean_idle_pct) == pytest.approx(direct(accumulate), rel=1e-12)
    assert direct(4)[0] < direct(1)[0]
    with pytest.raises(ValueError, match="`mode`"):
        optimizer_mode.steady_state_prediction(engine, stages, profiles, None, 4, mode="stale")
    with pytest.raises(ValueError, match="`accumulate_grad_batches`"):
        optimizer_mode.steady_state_prediction(engine, stages, profiles, None, 4, accumulate_grad_batches=0)
