"""Races between the main thread and the overlapped runs (issue 30), and the schedule jitter that shows them.

Oracles: the default Lightning strategy (the same fit without RoundPipe), runs of RoundPipe itself
without the overlap (``overlap_batches=False``) and without jitter, the program's own structure (every
issued op of a finished run has a completed timing span), and the jitter's definition (per-thread
generators seeded from one seed).
"""

from __future__ import annotations

import math
import random
import threading

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, fit_params, jitter_seeds, max_diff, tiny_hf, use_jitter
from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.runtime.execution import jitter
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
from lightning_roundpipe.runtime.execution.executor import PipelineState
from lightning_roundpipe.runtime.execution.microbatch import split_microbatches

CPU = torch.device("cpu")


def with_seeds(cases: list, default: int) -> list:
    """``(case, jitter seed)`` parameters: each case under :func:`jitter_seeds` ``(default)``."""
    out = []
    for case in cases:
        for value in jitter_seeds(default):
            out.append(pytest.param(case, *value.values, marks=value.marks) if hasattr(value, "values")
                       else (case, value))
    return out


# ---------------------------------------------------------------------- finish with a newer run in flight
def _forward_run(engine: RoundPipeEngine, x: torch.Tensor, cursor: int):
    state = PipelineState(num_microbatches=3)
    microbatches, _ = split_microbatches(engine.seq.prepare((x,), {}), 3)
    for i, microbatch in enumerate(microbatches):
        state.acts[(0, i)] = microbatch
    return engine.executor.start(engine.program(3, cursor, phase="forward"), state)


@pytest.mark.parametrize("seed", jitter_seeds(1))
def test_finish_with_a_newer_run_in_flight_reads_completed_timing_spans(seed, monkeypatch):
    """``Executor.finish`` of a run while a newer one is in flight waits for each stream's last op
    event only; each op's timing end marker comes after that event on its stream. Under jitter the
    stream worker is late to the marker, and the timeline must still hold only completed spans
    (before the fix: ``TypeError: ... 'NoneType' and 'float'``). The compute workers' delays are
    scaled up 50 times (up to 100 ms, a GPU whose compute runs far behind): the race needs the worker
    that completed an op's event to reach the marker after it later than the host reaches the timeline."""
    monkeypatch.setattr(jitter, "_forced", jitter.Jitter(seed, scales={"compute-worker": 50}))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    engine = RoundPipeEngine(make_layer_sequence(model), [CPU, CPU], 3)
    try:
        with torch.no_grad():
            for _ in range(2):
                older = _forward_run(engine, torch.randn(6, 8), 0)
                newer = _forward_run(engine, torch.randn(6, 8), 1)
                timeline = engine.executor.finish(older)  # `newer` still in flight
                later = engine.executor.finish(newer)
                for each in (timeline, later):
                    assert each.intervals
                    assert all(math.isfinite(i.start_s) and math.isfinite(i.end_s) and i.end_s >= i.start_s
                               for i in each.intervals)
    finally:
        engine.close()


# ---------------------------------------------------------------------- the global generator and the overlap
def _lora_module(lora_dropout: float = 0.1, draw_in_step: bool = False):
    torch.manual_seed(0)
    model = get_peft_model(tiny_hf("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        lora_dropout=lora_dropout, init_lora_weights="gaussian"))

    class Module(CausalLMModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if draw_in_step:  # user code drawing from the global generator while the previous batch drains
                loss = loss + 0.0 * torch.rand(64).sum()
            return loss

    return Module(model, lr=0.5)


class _DrawingData(TokenData):
    """A dataset that draws from the global generator in ``__getitem__`` (loaded in the main thread:
    ``num_workers=0``), while the previous batch's run drains."""

    def __getitem__(self, i: int) -> dict:
        torch.rand(16)
        return super().__getitem__(i)


def _lora_fit(optimizer: str = "sync", overlap: bool = True, draw_in_step: bool = False, draw_in_data: bool = False,
              **trainer_kw):
    torch.manual_seed(5)  # the global generator the engine's seeds derive from
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, optimizer=optimizer, overlap_batches=overlap)
    return fit_params(lambda: _lora_module(draw_in_step=draw_in_step), _DrawingData() if draw_in_data else TokenData(),
                      strategy=strategy, devices=2, **trainer_kw)


RNG_CASES = {  # the repro: LoRA dropout under overlapped accumulation and under async; user draws
    "accumulate": dict(optimizer="sync", max_steps=3, accumulate_grad_batches=2),
    "async": dict(optimizer="async", max_steps=4),
    "accumulate, torch.rand in training_step": dict(optimizer="sync", draw_in_step=True, max_steps=3,
                                                    accumulate_grad_batches=2),
    "async, torch.rand in the dataset": dict(optimizer="async", draw_in_data=True, max_steps=4),
}


@pytest.mark.parametrize("case,seed", [(case, None) for case in sorted(RNG_CASES)]
                         + with_seeds(["accumulate", "async"], 1))
def test_lora_dropout_with_overlapped_runs_equals_the_run_without_overlap(case, seed, monkeypatch):
    """The main thread draws from torch's global CPU generator (the engine's seed, user code) while the
    previous batch's random layers run on the devices: no false "drew random numbers" error (before
    the fix: ``ValueError: RoundPipe: layer 4 drew random numbers from torch's global `cpu`
    generator``), and the same masks as without the overlap, so the same parameters; also under
    schedule jitter (``seed``), which the run without overlap does not need."""
    kw = RNG_CASES[case]
    use_jitter(monkeypatch, seed)
    got = _lora_fit(overlap=True, **kw)
    monkeypatch.delenv("LIGHTNING_ROUNDPIPE_JITTER_SEED", raising=False)
    want = _lora_fit(overlap=False, **kw)
    assert max_diff(got, want) <= 1e-6
    assert max_diff(got, {n: p.detach() for n, p in _lora_module(0.0).named_parameters()}) > 1e-4  # it trained


@pytest.mark.parametrize("seed", [None, 7])
def test_guard_does_not_blame_a_layer_for_another_threads_draw(seed):
    """A layer scope on one thread while the main thread draws from the global CPU generator (as the
    engine's seed and user code did during an overlapped run), twice (the second time the layer is
    suspect and runs under the per-thread guard): no error; the layer's own draw from it still
    raises, at the op, naming it (at its next call at the latest: its recomputation)."""
    from lightning_roundpipe.runtime.replay import rng_guard
    from lightning_roundpipe.runtime.replay.rng import rng_scope

    layer_index = 1000 + (seed or 0)  # not suspected by an earlier test
    rng_guard._SUSPECT.discard(layer_index)
    for _ in range(2):
        inside, drawn = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def layer() -> None:
            try:
                with rng_scope(seed, CPU, layer_index=layer_index):
                    inside.set()
                    drawn.wait(30)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        thread = threading.Thread(target=layer)
        thread.start()
        assert inside.wait(30)
        torch.rand(10)  # the main thread's draw, inside the layer's window
        drawn.set()
        thread.join(30)
        assert not errors
    assert layer_index in rng_guard._SUSPECT  # the draw was seen; the guard now watches the layer's own thread
    rng_guard._SUSPECT.discard(layer_index)
    with pytest.raises(ValueError, match=rf"layer {layer_index} drew random numbers from torch's global `cpu` generator \(`"):
        for _ in range(2):  # the first call of a layer never suspected only marks it
            with rng_scope(seed, CPU, layer_index=layer_index):
                torch.empty(4).exponential_(generator=torch.default_generator)


_STATE_READS = """
import gc, sys, threading, torch
from lightning_roundpipe.runtime.replay.rng_guard import generator_state
read = torch.Generator.get_state if sys.argv[1] == "plain" else generator_state
gc.set_threshold(5)  # a collection at nearly every allocation, each freeing a tensor held by a cycle

def reads() -> None:
    for _ in range(2000):
        cycle = [torch.empty(8)]
        cycle.append(cycle)
        read(torch.default_generator)

threads = [threading.Thread(target=reads) for _ in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("done")
"""


def test_generator_state_reads_from_two_threads_never_deadlock():
    """Two threads reading the global generator's state, as two compute workers' guards do, while
    collections free tensors: ``Generator.get_state`` wraps the state under the generator's mutex and a
    collection there releases the GIL, so the other thread can block on the mutex holding the GIL (a
    clean-clone run hung so; ``plain`` below deadlocks at once). Through ``generator_state`` the reads
    all finish. The subprocess's timeout is a hang guard, not a timing: the reads take well under a
    second; a deadlocked process never prints."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _STATE_READS, "guarded"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr[-2000:]


# ---------------------------------------------------------------------- the jitter itself
def test_jitter_is_off_unless_asked_for_and_refuses_a_bad_seed(monkeypatch):
    monkeypatch.delenv(jitter.JITTER_ENV, raising=False)
    assert jitter.active_jitter() is None
    monkeypatch.setenv(jitter.JITTER_ENV, "3")
    assert jitter.active_jitter().seed == 3
    monkeypatch.setenv(jitter.JITTER_ENV, "three")
    with pytest.raises(ValueError, match=r"LIGHTNING_ROUNDPIPE_JITTER_SEED=three.*HINT"):
        jitter.active_jitter()
    jitter.set_jitter(None)  # wins over the variable
    try:
        assert jitter.active_jitter() is None
    finally:
        jitter.reset_jitter()
    with pytest.raises(ValueError, match="stall_probability.*HINT"):
        jitter.Jitter(0, stall_probability=2)


def test_jitter_delays_are_seeded_per_thread():
    """Oracle: the documented generator (``random.Random`` seeded with the BLAKE2b digest of
    ``"{seed}:{thread name}"``); the delays lie in their ranges; scales apply by thread name."""
    import hashlib

    def oracle(seed: int, name: str, count: int, max_delay_s: float, scale: float = 1.0) -> list[float]:
        rng = random.Random(int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little"))
        out = []
        for _ in range(count):
            longest = 0.05 if rng.random() < 0.5 else max_delay_s
            out.append(rng.uniform(0.0, longest) * scale)
        return out

    made = jitter.Jitter(11, max_delay_s=0.002, stall_probability=0.5, stall_s=0.05, scales={"slow": 3})
    got: dict[str, list[float]] = {}

    def draw(name: str) -> None:
        got[name] = [made.delay_s() for _ in range(50)]

    for name in ("roundpipe-device0-compute-worker", "roundpipe-slow-thread"):
        thread = threading.Thread(target=draw, args=(name,), name=name)
        thread.start()
        thread.join(30)
    assert got["roundpipe-device0-compute-worker"] == oracle(11, "roundpipe-device0-compute-worker", 50, 0.002)
    assert got["roundpipe-slow-thread"] == oracle(11, "roundpipe-slow-thread", 50, 0.002, scale=3)
    assert all(0 <= d <= 0.05 for d in got["roundpipe-device0-compute-worker"])
    assert got["roundpipe-device0-compute-worker"] != oracle(12, "roundpipe-device0-compute-worker", 50, 0.002)
