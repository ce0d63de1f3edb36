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
from _helpers import CausalLMModule, TokenData, fit_params, max_diff, tiny_hf
from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.runtime.execution import jitter
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
from lightning_roundpipe.runtime.execution.executor import PipelineState
from lightning_roundpipe.runtime.execution.microbatch import split_microbatches

CPU = torch.device("cpu")

#: Jitter seeds of the default run, and of the slow run (``pytest -m slow``).
SEEDS = (0, 1)
SLOW_SEEDS = tuple(range(2, 8))


# ---------------------------------------------------------------------- finish with a newer run in flight
def _forward_run(engine: RoundPipeEngine, x: torch.Tensor, cursor: int):
    state = PipelineState(num_microbatches=3)
    microbatches, _ = split_microbatches(engine.seq.prepare((x,), {}), 3)
    for i, microbatch in enumerate(microbatches):
        state.acts[(0, i)] = microbatch
    return engine.executor.start(engine.program(3, cursor, phase="forward"), state)


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in SLOW_SEEDS[:2])])
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
