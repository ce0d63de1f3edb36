"""The one memory model against the ledger (issue 30, What to build 3): partitions whose second pool bank
or fp8 dequantised copies do not fit are caught before the first step, and the model's per-device peak
is within 10 % of the ledger's measured peak (never below it by more than 5 %)."""

from __future__ import annotations

import os
import sys

import lightning as L
import pytest

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, VectorData, fit_params, loader, max_diff, tiny_hf, trainer
from lightning_roundpipe.runtime.backends import DeviceMemoryError
from lightning_roundpipe.runtime.tuning.device_memory import PlanMemoryError, predicted_peaks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

TOL = 1e-5


class _Watch(L.Callback):
    """The ledger's peaks and the pools' allocations at the end; with ``banks``, the model's per-device
    peaks of every program the executor starts, when it starts (the weight store still holds the fp8
    blocks then; teardown converts them back)."""

    def __init__(self, banks: int | None = None, compute_bytes: int = 4, rows: int = 3) -> None:
        self.banks, self.compute_bytes, self.rows = banks, compute_bytes, rows
        self.predicted: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        engine = self.engine = trainer.strategy.engine
        if self.banks is None:
            return
        start = engine.executor.start

        def predicting_start(program, state):
            run = start(program, state)  # its check records the call's shape (the microbatch's packed bytes)
            batch_bytes = engine.memory_shape[3] if hasattr(engine, "memory_shape") else None
            self.predicted.append(predicted_peaks(engine.seq, engine.store, program, rows=self.rows, seq_len=8,
                                                  banks=self.banks, compute_bytes=self.compute_bytes,
                                                  batch_bytes=batch_bytes))
            return run

        engine.executor.start = predicting_start

    def on_train_end(self, trainer, pl_module) -> None:
        self.peaks = [backend.memory.peak_bytes for backend in self.engine.backends]
        self.one_bank = self.engine.executor.one_bank
        self.allocations = self.engine.executor.pool_allocations()
        self.engine.executor.__dict__.pop("start", None)

    def peak(self) -> int:
        return max(peak.peak_bytes for peaks in self.predicted for peak in peaks)


def test_a_second_bank_the_model_does_not_fit_is_never_allocated(caplog):
    """Accumulation overlaps batches on a second pool bank. With a budget between the model's one-bank and
    two-bank peaks, the second bank used to be reserved (its pools alone fit) and the overlapped program then
    ran out of memory, or the reservation did, depending on what the draining run held at that moment; now
    the model decides before anything of bank 1 is allocated, says so once, and the result is the default
    strategy's."""
    accumulate = dict(max_steps=2, accumulate_grad_batches=2)
    one, two = _Watch(banks=1), _Watch(banks=2)
    fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), devices=2, callbacks=[one, two],
               strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default",
                                                              device_memory_bytes=2**40), **accumulate)
    one, two = one.peak(), two.peak()
    assert one < two
    budget = (one + two) // 2
    watch = _Watch()
    with caplog.at_level("INFO"):
        got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), devices=2, callbacks=[watch],
                         strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default",
                                                                        device_memory_bytes=budget), **accumulate)
    assert watch.one_bank is not None and "the memory model" in watch.one_bank
    assert not any("bank 1" in name and count for name, count in watch.allocations.items())
    assert max(watch.peaks) <= budget
    assert sum("no longer overlaps" in record.getMessage() for record in caplog.records) == 1
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), **accumulate)
    assert max_diff(ref, got) <= TOL


def _lora_fp8():
    from peft import LoraConfig, get_peft_model

    return CausalLMModule(get_peft_model(tiny_hf("llama"), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights="gaussian")))


def test_fp8_dequantised_copies_that_do_not_fit_fail_before_the_first_step():
    """With ``frozen_weights="fp8"`` each frozen matmul weight is dequantised on the device (a compute-dtype
    copy held while its stage computes, and an fp32 transient). A given partition with a forward stage of
    five decoder layers, one row per microbatch: the copies of that stage set the device's peak. A budget
    that holds every stage without its copies, and the tail with them, used to be accepted (a given partition
    was never checked) and failed inside the stage's first compute op; now the check before the first step
    names the device, the stage, the bytes and the dequantised copies, with a HINT."""
    strategy = dict(num_microbatches=3, frozen_weights="fp8", forward_stages=[range(0, 1), range(1, 6), range(6, 7)],
                    backward_stages=[range(6, 7)] + [range(i, i + 1) for i in range(5, -1, -1)])
    probe = _Watch(banks=1, compute_bytes=2, rows=1)
    trainer(lightning_roundpipe.RoundPipeStrategy(device_memory_bytes=2**40, **strategy), 2, max_steps=1,
            precision="bf16-mixed", callbacks=[probe]).fit(_lora_fp8(), loader(TokenData(), 3))
    peaks = [peak for peaks in probe.predicted for peak in peaks]
    largest = max(peaks, key=lambda peak: peak.peak_bytes)
    budget = max(peak.peak_bytes for peak in peaks if peak.stage_index != largest.stage_index) + 1
    assert 0 < largest.peak_bytes - budget < largest.parts["dequantised"]  # it fits without its copies
    with pytest.raises(DeviceMemoryError) as info:
        trainer(lightning_roundpipe.RoundPipeStrategy(device_memory_bytes=budget, **strategy), 2, max_steps=1,
                precision="bf16-mixed").fit(_lora_fp8(), loader(TokenData(), 3))
    error = info.value
    assert isinstance(error, PlanMemoryError)  # raised by the check, not by an op of the step
    message = str(error)
    assert f"device {error.device_index}" in message and f"stage {largest.stage_index}" in message
    assert str(budget) in message and f"dequantised {largest.parts['dequantised']}" in message and "HINT" in message


#: configurations of bitsandbytes weights: they need the runtime that streams them (issue 33 items 1-2)
_BNB_CONFIGS = ("LoRA, nf4 base, bf16-mixed", "QLoRA loaded in 4 bits (nf4, double quant)", "loaded in 8 bits")


@pytest.mark.parametrize("name", ["sync, full FT, fp32", "sync, full FT, bf16-mixed", "accumulation (2 banks)",
                                  "async (2 banks)", "LoRA, bf16-mixed", "LoRA, fp8 base, bf16-mixed",
                                  "mixed devices (weighted, speeds 1, 0.5)", "nn.Sequential MLP, sync",
                                  "nn.Sequential MLP, async", "nn.Sequential MLP, accumulation", *_BNB_CONFIGS])
def test_the_model_predicts_the_ledger_peak(name, monkeypatch):
    """The ledger (every device allocation while alive) is the oracle: the model's per-device peak is
    within 10 % of the measured one and never below it by more than 5 % (benchmarks/memory_model.py prints
    the table of docs/partitioner.md)."""
    if name in _BNB_CONFIGS:
        pytest.importorskip("bitsandbytes")
        pytest.importorskip("lightning_roundpipe.runtime.host.bnb", reason="the runtime of issue 33 items 1-2")
    monkeypatch.setenv("LIGHTNING_ROUNDPIPE_MEASURE_DEVICE_MEMORY", "1")
    import memory_model

    config = next(c for c in memory_model.CONFIGS if c.name == name)
    for device, predicted, measured in memory_model.measure(config):
        ratio = predicted / measured
        assert 0.95 <= ratio <= 1.10, (name, device, predicted, measured)


def test_device_peaks_formula_by_hand():
    """Pure: two layers of 100 weight bytes (50 of them trainable), boundaries of 10 bytes; stages
    forward [0, 2), fused [1, 2), backward [0, 1) on 2 devices: 3 stages > 2 devices, so 2 slots."""
    from lightning_roundpipe.partition.memory import StageBytes, device_peaks
    from lightning_roundpipe.partition.profile import LayerProfile

    profiles = [LayerProfile(forward_s=0, backward_s=0, param_bytes=100, activation_bytes=10, trainable_param_bytes=50)] * 2
    stages = [("forward", range(0, 2)), ("fused", range(1, 2)), ("backward", range(0, 1))]
    extra = [StageBytes(), StageBytes(accumulator_bytes=200, cast_bytes=7),
             StageBytes(accumulator_bytes=200, dequantised_bytes=30, dequant_transient_bytes=60)]
    one = device_peaks(profiles, stages, 2, stage_bytes=extra, transfer_bytes=40, banks=1)
    # pools: 2 x 200 (stage 0's weights) + 2 x 200 (accumulators) + 40 = 840; working sets: forward: input and
    # output 10 + 10 = 20 (its output is the last layer's: nothing downloaded beside it); fused: gradients 50 +
    # input and output 10 + max(saved 10, fresh gradient 50) + 2 outgoing gradients held for download 2 x 10
    # + casts 7 = 137; backward: 50 + 20 + max(10, 50) + 2 x 10 + dequantised 30 = 170; the stage before the
    # backward one on its device (round robin: stage 2 - 2 = 0) is a forward stage: no held gradients
    assert [p.peak_bytes for p in one] == [840 + 170 + 60] * 2 and one[0].stage_index == 2
    two = device_peaks(profiles, stages, 2, stage_bytes=extra, transfer_bytes=40, banks=2)
    assert [p.peak_bytes for p in two] == [2 * 840 + 170 + 60] * 2  # a second bank of every pool
    after = device_peaks(profiles, stages, 2, stage_bytes=extra, transfer_bytes=40, previous=[{2: 1}, {2: 1}])
    assert after[0].peak_bytes == 840 + 170 + 50 + 60  # the fused stage's 50 gradient bytes, not yet dropped
    assert after[0].parts["previous stage's gradients"] == 50
    only = device_peaks(profiles, stages, 2, stage_bytes=extra, transfer_bytes=40, stage_devices=[[0], [0], [1]],
                        pool_devices=[[0], [0, 1], [0, 1]])
    assert only[1].pool_bytes == 2 * 100 + 2 * 200 + 40 and only[1].stage_index == 2  # the forward stage is not its


def test_roundpipe_plan_counts_the_second_bank_of_the_overlapped_modes():
    """`roundpipe plan --accumulate-grad-batches 2` counts two pool banks: its modelled peak fits the device
    and is above the same stages' one-bank peak."""
    import argparse

    from lightning_roundpipe.cli import plan_cmd

    parser = argparse.ArgumentParser()
    plan_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--preset", "llama3.1-8b", "--devices", "8", "--device-memory-gib", "24",
                                      "--seq-len", "1024", "--microbatch-size", "1", "--accumulate-grad-batches", "2",
                                      "--method", "optimal"])
    report = plan_cmd.make_report(args)
    one_bank = plan_cmd.modelled_peak(report.modelled, report.stages, 8, report.num_microbatches, 1, args.dtype_bytes)
    assert one_bank < report.peak_device_memory_bytes <= 24 * 2**30


def test_the_second_bank_and_the_transfer_slots_are_reserved_before_the_first_program():
    """Accumulation overlaps batches: bank 1 (stage slots, accumulators, transfer slots sized from bank 0)
    and both banks' transfer slots (sized by the model's boundaries) exist before the first program runs
    an op (the devices are paused while it is issued); no pool allocates inside a program afterwards
    (lazily grown transfer slots used to be allocated inside the first program, on whichever stream ran it)."""
    seen = {}

    class Paused(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            executor = trainer.strategy.engine.executor
            start = executor.start

            def paused_start(program, state):
                if seen:
                    return start(program, state)
                for backend in executor.backends:
                    backend.pause()
                try:
                    run = start(program, state)
                    seen["banks"] = [len(backend.banks) for backend in executor.backends]
                    seen["slots"] = [[b is not None and b.numel() > 0 for b in backend.bank(bank).transfer_pool.buffers]
                                     for backend in executor.backends for bank in (0, 1)]
                    seen["allocations"] = executor.pool_allocations()
                finally:
                    for backend in executor.backends:
                        backend.resume()
                return run

            executor.start = paused_start

        def on_train_end(self, trainer, pl_module) -> None:
            seen["end"] = trainer.strategy.engine.executor.pool_allocations()

    fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), devices=2, callbacks=[Paused()], max_steps=2,
               accumulate_grad_batches=2,
               strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default"))
    assert seen["banks"] == [2, 2]
    assert all(slots and all(slots) for slots in seen["slots"]), [[i for i, x in enumerate(s) if not x] for s in seen["slots"]]
    device = lambda counts: {name: n for name, n in counts.items() if name != "host staging"}  # noqa: E731
    assert device(seen["end"]) == device(seen["allocations"])  # no device pool allocated inside any program


def test_an_oom_in_the_first_program_with_the_second_bank_held_falls_back_to_one_bank(caplog):
    """Where the model's check does not see it (switched off here: on a GPU the budget is measured, other
    processes allocate), the first program with the second bank held can run out of memory although one
    bank fits: it is rerun on one bank (its gradients and loss as they would have been), the run goes on
    one program at a time and says so once, and the result is the default strategy's. Before, the error
    killed the fit (only an OOM while reserving bank 1 fell back)."""
    accumulate = dict(max_steps=2, accumulate_grad_batches=2)
    sizes = {}

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            backends = trainer.strategy.engine.backends
            sizes["pools"] = max(backend.bank(0).pool.nbytes + backend.bank(0).transfer_pool.nbytes
                                 + backend.bank(0).accumulator_pool.nbytes for backend in backends)
            sizes["peak"] = max(backend.memory.peak_bytes for backend in backends)

    fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), devices=2, callbacks=[Probe()],
               strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default",
                                                              overlap_batches=False, device_memory_bytes=2**40),
               **accumulate)
    working = sizes["peak"] - sizes["pools"]
    budget = 2 * sizes["pools"] + working // 2  # both banks' pools fit, a program beside them does not
    assert sizes["peak"] <= budget

    class NoCheck(_Watch):
        def on_train_start(self, trainer, pl_module) -> None:
            super().on_train_start(trainer, pl_module)
            self.engine.executor.memory_check = None

    watch = NoCheck()
    with caplog.at_level("INFO"):
        got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), devices=2, callbacks=[watch],
                         strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default",
                                                                        device_memory_bytes=budget), **accumulate)
    assert watch.one_bank is not None and "DeviceMemoryError" in watch.one_bank
    assert max(watch.peaks) <= budget
    assert sum("no longer overlaps" in record.getMessage() for record in caplog.records) == 1
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), **accumulate)
    assert max_diff(ref, got) <= TOL


def _mlp_fit(budget: int, **trainer_args) -> None:
    import memory_model

    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=memory_model.MICROBATCHES, partition="default",
                                                     device_memory_bytes=budget)
    trainer(strategy, 2, max_steps=2, **trainer_args).fit(memory_model.SequentialMLPModule(),
                                                          loader(VectorData(), memory_model.BATCH))


@pytest.mark.parametrize("trainer_args", [{}, {"accumulate_grad_batches": 2}], ids=["sync", "accumulation"])
def test_an_mlp_budget_below_the_modelled_peak_is_refused_up_front_and_one_at_it_trains(trainer_args, monkeypatch):
    """An ``nn.Sequential`` MLP (activations from a shape-only pass, the loss outside the sequence). The
    model used to leave out its activations, transfer slots, the outputs held for download and the previous
    backward stage's gradients (dropped on the ``d2h`` stream while the next stage computes): a budget the
    check passed then ran out inside a backward stage. Now a budget one byte below the modelled peak is
    refused before the first step, naming the device, the stage, the bytes and a HINT, and the modelled peak
    itself trains (the ledger never exceeds it)."""
    monkeypatch.setenv("LIGHTNING_ROUNDPIPE_MEASURE_DEVICE_MEMORY", "1")
    import memory_model

    config = next(c for c in memory_model.CONFIGS if c.name == "nn.Sequential MLP, sync")
    config = memory_model.Config(config.name, module=config.module, trainer=trainer_args)
    peak = max(predicted for _, predicted, _ in memory_model.measure(config))
    with pytest.raises(PlanMemoryError) as info:
        _mlp_fit(peak - 1, **trainer_args)
    message = str(info.value)
    assert f"device {info.value.device_index}" in message and "stage " in message and str(peak) in message
    assert str(peak - 1) in message and "HINT" in message
    _mlp_fit(peak, **trainer_args)  # no DeviceMemoryError inside the step


def test_the_automatic_choice_drops_candidates_whose_modelled_peak_does_not_fit(monkeypatch):
    """The automatic choice (`partition="auto"`) times every candidate partition and takes the fastest
    among those whose modelled one-bank peak fits every device (`fits_memory`). The simulated times are
    replaced by a figure that makes the largest stage the fastest (the whole model as one stage wins without
    a budget); with a budget one byte below that candidate's modelled peak, it is dropped and the choice is
    a candidate whose peak fits. The batch is not cut finer (`balance_microbatches=False`: the rows per
    microbatch stay those of the last call), but the choice may take microbatch rounds: each peak is that
    of the plan as chosen, rounds included."""
    import memory_model

    from lightning_roundpipe.runtime.tuning import autopartition
    from lightning_roundpipe.runtime.tuning.mixed import build_plan
    from lightning_roundpipe.schedule import build_stages

    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=memory_model.MICROBATCHES, partition="auto",
                                                     profile_steps=2, device_memory_bytes=2**40)
    seen = {}

    class Choose(L.Callback):  # while the engine is alive, after the profiled steps and its own choice
        def on_train_end(self, trainer, pl_module) -> None:
            engine = trainer.strategy.engine
            rows, seq_len, _, batch_bytes = engine.memory_shape

            def peak(partition, microbatches_per_round=None) -> int:
                plan = build_plan(engine, build_stages(partition.forward_stages, partition.backward_stages),
                                  memory_model.MICROBATCHES, 0, microbatches_per_round, None)
                return max(p.peak_bytes for p in predicted_peaks(
                    engine.seq, engine.store, engine._lower(plan), rows=rows, seq_len=seq_len, banks=1,
                    batch_bytes=batch_bytes, sample=engine.memory_sample))

            largest = lambda partition: max(len(r) for r in (*partition.forward_stages, *partition.backward_stages))  # noqa: E731
            monkeypatch.setattr(autopartition, "simulated_step_s",
                                lambda engine, partition, *args, **kwargs: 1.0 / (1 + largest(partition)))
            monkeypatch.setattr(engine, "_last_call", (engine._last_call[0], False))  # the programs as they ran
            unlimited_choice = autopartition.choose_partition(engine, engine.measured_profiles)
            unlimited, rounds = unlimited_choice.partition, unlimited_choice.microbatches_per_round
            seen["unlimited"] = autopartition.one_stage(unlimited)
            budget = peak(unlimited, rounds) - 1
            for backend in engine.backends:
                backend.memory.budget_bytes = budget
            seen["fits"] = autopartition.fits_memory(engine, unlimited, memory_model.MICROBATCHES, rounds)
            choice = autopartition.choose_partition(engine, engine.measured_profiles)
            # a one-stage plan with smaller microbatch rounds may fit where the unlimited choice does not
            same = (choice.partition, choice.microbatches_per_round) == (unlimited, rounds)
            seen["chosen"] = (same, peak(choice.partition, choice.microbatches_per_round), budget)
            for backend in engine.backends:
                backend.memory.budget_bytes = 2**40

    trainer(strategy, 2, max_steps=3, callbacks=[Choose()]).fit(memory_model.SequentialMLPModule(),
                                                                loader(VectorData(), memory_model.BATCH))
    assert seen["unlimited"]  # the faked times make the whole model as one stage the fastest
    assert not seen["fits"]
    same, chosen_peak, budget = seen["chosen"]
    assert not same and chosen_peak <= budget


#: How far the ledger may exceed the modelled peak when the budget is the modelled peak itself: once, under
#: ONEDNN_MAX_CPU_ISA=AVX2 and a load of 17, the automatic re-cut's stage 6 (6B2) ran out by 16 bytes
#: (357904 > 357888: a 512-byte output with 357392 in use), an interleaving of the d2h stream's frees with the
#: compute stream that the deferred-DROP accounting does not pin down. 1.0 x is then "trains, or runs out by
#: less than this"; every budget under the peak must still be refused before any program runs.
_PEAK_SLACK_BYTES = 64


@pytest.mark.slow  # about 10 fits
@pytest.mark.parametrize("partition", ["default", "auto"])
def test_no_mlp_budget_passes_the_check_and_then_runs_out(partition):
    """Budgets from half to 1.3 x the MLP's modelled peak, with accumulation and (``"auto"``) the re-cut after
    the profiled steps: each is refused before a program runs (`PlanMemoryError`; with ``"auto"`` also the
    partitioner's `ValueError` for a layer over the per-stage budget) or trains; none
    runs out inside a step (before, budgets between the refused and the working ones passed the check and
    then ran out, 3 of 4 fits with the re-cut)."""
    import memory_model

    from lightning_roundpipe.runtime.backends import DeviceMemoryError

    config = memory_model.Config("sweep", module=memory_model.SequentialMLPModule,
                                 trainer=dict(accumulate_grad_batches=2))
    peak = max(predicted for _, predicted, _ in memory_model.measure(config))
    outcomes = []
    for fraction in (0.5, 0.7, 0.85, 0.95, 1.0, 1.1, 1.3):
        budget = int(peak * fraction)
        strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=memory_model.MICROBATCHES,
                                                         partition=partition, profile_steps=2,
                                                         device_memory_bytes=budget)
        try:
            trainer(strategy, 2, max_steps=4, accumulate_grad_batches=2).fit(
                memory_model.SequentialMLPModule(), loader(VectorData(), memory_model.BATCH))
            outcomes.append((fraction, "trained"))
        except PlanMemoryError:
            outcomes.append((fraction, "refused"))
        except ValueError as error:  # the automatic cut: a single layer over the per-stage budget, before any program
            assert partition == "auto" and "per-stage memory budget" in str(error), error
            outcomes.append((fraction, "refused"))
        except DeviceMemoryError as error:  # ran out inside a step: only at the modelled peak itself, by a few bytes
            over = error.asked_bytes + error.in_use_bytes - error.budget_bytes
            assert fraction == 1.0 and over <= _PEAK_SLACK_BYTES, (fraction, over, str(error))
            outcomes.append((fraction, "trained"))
    got = dict(outcomes)  # any other DeviceMemoryError inside a step would have failed the test above
    assert got[1.3] == "trained", outcomes
    # the profiled partition of "auto" is the default one: refused below its modelled peak, trains from it on
    # (the re-cut used to raise a `ValueError` after the profiled steps at 1.0 and 1.1 x: a single layer over the
    # per-stage budget, half the device, although the running partition fitted the device)
    assert [got[f] for f in (0.5, 0.7, 0.85, 0.95)] == ["refused"] * 4 and got[1.0] == got[1.1] == "trained", outcomes
