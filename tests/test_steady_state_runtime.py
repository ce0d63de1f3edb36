"""Sync mode with ``accumulate_grad_batches > 1``: the next batch's program is issued while the
previous batch's backward stages drain (DESIGN.md section 11, ``runtime/execution/overlap.py``).

Oracles: Lightning's default single-device strategy (parameters and the gradients its hooks see,
fp32, 1e-5), and the executor's own records (which runs were in flight together; when each op ran).
"""

import lightning.pytorch as L
import pytest
import torch

import lightning_roundpipe
from _helpers import (CausalLMModule, TokenData, fit_params, jitter_seeds, loader, max_diff, params, tiny_hf, trainer,
                      use_jitter)
from lightning_roundpipe.runtime.execution.executor import Executor

TOL = 1e-5
ACCUMULATE = dict(max_steps=2, accumulate_grad_batches=4, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


def _strategy(**kw):
    return lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default", **kw)


class _FinishSpy:
    """Records every finished run (its bank, its program's number of runs in flight at start, its
    timeline) from :meth:`Executor.start` / :meth:`Executor.finish`."""

    def __init__(self, monkeypatch) -> None:
        self.started: list = []  # (run, runs in flight right after it was issued)
        self.finished: list = []  # (run, timeline)
        real_start, real_finish = Executor.start, Executor.finish

        def start(executor, program, state):
            run = real_start(executor, program, state)
            self.started.append((run, len(executor.in_flight)))
            return run

        def finish(executor, run):
            timeline = real_finish(executor, run)
            self.finished.append((run, timeline))
            return timeline

        monkeypatch.setattr(Executor, "start", start)
        monkeypatch.setattr(Executor, "finish", finish)


@pytest.mark.parametrize("jitter_seed", [None, *jitter_seeds(0)])
def test_accumulation_overlap_matches_default_strategy_with_clip_by_norm(jitter_seed, monkeypatch):
    """Also under schedule jitter (``jitter_seed``: the main thread and the overlapped runs interleave
    otherwise; the result may not change)."""
    spy = _FinishSpy(monkeypatch)
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), **ACCUMULATE)
    use_jitter(monkeypatch, jitter_seed)
    got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), devices=2, strategy=_strategy(),
                     **ACCUMULATE)
    assert max_diff(ref, got) <= TOL
    assert max_diff(got, fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), max_steps=0)) > 1e-3
    # 8 fused programs; the batch after each of the 3 non-stepping batches of a step is issued
    # while that batch still runs: two runs in flight, on different pool banks
    assert len(spy.started) == 8
    overlapped = [run for run, in_flight in spy.started if in_flight == 2]
    assert len(overlapped) == 6
    banks = [run.bank for run, _ in spy.started]
    assert all(a != b for (a, b), (_, n) in zip(zip(banks, banks[1:]), spy.started[1:]) if n == 2)


def test_next_batch_forward_runs_while_previous_backward_drains(monkeypatch):
    """The state that makes the overlap: a compute op of batch i+1's forward stages started on a
    device before batch i's last backward op had finished (both read from the runs' timelines, on the
    one host clock), and the timeline of batch i+1 shows it on a device batch i left first."""
    spy = _FinishSpy(monkeypatch)
    fit_params(lambda: CausalLMModule(tiny_hf("llama", layers=7)), TokenData(), devices=2, max_steps=1,
               accumulate_grad_batches=4, strategy=_strategy())
    by_run = {id(run): timeline for run, timeline in spy.finished}
    runs = [run for run, _ in spy.started]
    seen = 0
    for previous, nxt in zip(runs, runs[1:]):
        if next(n for r, n in spy.started if r is nxt) != 2:
            continue
        before, after = by_run[id(previous)], by_run[id(nxt)]
        last_backward_end = max(before.origin_s + i.end_s for i in before.intervals if i.kind == "B")
        first_forward_start = min(after.origin_s + i.start_s for i in after.intervals if i.kind == "F")
        assert first_forward_start < last_backward_end
        seen += 1
    assert seen == 3


class _GradRecorder(L.Callback):
    """Copies every parameter's ``.grad`` at ``on_before_optimizer_step`` (after the whole accumulation)."""

    def __init__(self) -> None:
        self.grads: list[dict] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None})


class _AfterBackwardModule(CausalLMModule):
    """Reads the gradients at every ``on_after_backward`` (so RoundPipe does not overlap that batch)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seen: list[dict] = []

    def on_after_backward(self) -> None:
        self.seen.append({n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None})


def _grad_diff(a: list[dict], b: list[dict]) -> float:
    assert len(a) == len(b) and a and all(x.keys() == y.keys() and x for x, y in zip(a, b))
    return max(max_diff(x, y) for x, y in zip(a, b))


def test_hooks_see_complete_gradients():
    """``on_before_optimizer_step`` (a callback: the batch overlaps) and ``on_after_backward`` (the
    module overrides it: no batch overlaps) see the default strategy's gradients at every call."""
    kw = dict(max_steps=2, accumulate_grad_batches=3)
    ref_cb, got_cb = _GradRecorder(), _GradRecorder()
    fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), callbacks=[ref_cb], **kw)
    fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), devices=2, strategy=_strategy(),
               callbacks=[got_cb], **kw)
    assert _grad_diff(ref_cb.grads, got_cb.grads) <= TOL

    ref_module = _AfterBackwardModule(tiny_hf("llama"))
    trainer(**kw).fit(ref_module, loader(TokenData()))
    got_module = _AfterBackwardModule(tiny_hf("llama"))
    trainer(_strategy(), devices=2, **kw).fit(got_module, loader(TokenData()))
    assert len(got_module.seen) == 6
    assert _grad_diff(ref_module.seen, got_module.seen) <= TOL


class Boom(RuntimeError):
    pass


def test_error_while_previous_batch_drains_surfaces_and_keeps_its_gradients(monkeypatch):
    """Batch 2's forward raises (in a decoder layer, on a device) while batch 1 still drains: the
    original exception reaches the caller, and ``.grad`` holds batches 0 and 1 exactly as the default
    strategy has them when the same batch raises there. Batch 2 is told apart by its rows (12, cut
    into microbatches of 4; the other batches have 7 rows: microbatches of 3 and 2), so batch 1's
    recomputation, still running, does not raise."""
    from torch.utils.data import DataLoader
    from transformers.models.llama import modeling_llama

    real_forward = modeling_llama.LlamaDecoderLayer.forward

    def forward(self, hidden_states, *args, **kwargs):
        if hidden_states.shape[0] in (4, 12):
            raise Boom("layer failed")
        return real_forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", forward)
    sizes = [7, 7, 12, 7, 7]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    batches = [list(range(start, start + size)) for start, size in zip(starts, sizes)]

    def grads_after_failure(strategy, devices):
        module = CausalLMModule(tiny_hf("llama"))
        with pytest.raises(Boom, match="layer failed"):
            trainer(strategy, devices, max_steps=2, accumulate_grad_batches=4).fit(
                module, DataLoader(TokenData(), batch_sampler=batches))
        return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}, params(module)

    ref_grads, ref_params = grads_after_failure("auto", 1)
    spy = _FinishSpy(monkeypatch)
    got_grads, got_params = grads_after_failure(_strategy(), 2)
    assert [n for _, n in spy.started] == [1, 2, 2]  # batch 2 was issued while batch 1 was in flight
    assert ref_grads.keys() == got_grads.keys() and ref_grads
    assert max_diff(ref_grads, got_grads) <= TOL
    assert max_diff(ref_params, got_params) == 0.0  # no optimizer step ran


class _Peaks(L.Callback):
    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.one_bank = None

    def on_train_end(self, trainer, pl_module) -> None:
        engine = trainer.strategy.engine
        self.peaks = [backend.memory.peak_bytes for backend in engine.backends]
        self.one_bank = engine.executor.one_bank


def test_a_second_pool_bank_that_does_not_fit_turns_the_overlap_off(caplog):
    """With a device budget that holds one drained batch (its measured peak, + 10 %) but not a second
    set of pools, the overlapped batches fall back to one program at a time, say so once, and the
    result is still the default strategy's (the budget ledger is the oracle of what fits)."""
    peaks = _Peaks()
    fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), devices=2, callbacks=[peaks],
               strategy=_strategy(overlap_batches=False, device_memory_bytes=2**30), **ACCUMULATE)
    budget = int(max(peaks.peaks) * 1.1)
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), **ACCUMULATE)
    tight = _Peaks()
    with caplog.at_level("INFO"):
        got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), devices=2, callbacks=[tight],
                         strategy=_strategy(device_memory_bytes=budget), **ACCUMULATE)
    assert tight.one_bank is not None and "the memory model" in tight.one_bank  # decided before bank 1 was allocated
    assert max(tight.peaks) <= budget
    assert sum("no longer overlaps" in record.getMessage() for record in caplog.records) == 1
    assert max_diff(ref, got) <= TOL
