"""``optimizer="async"`` in the paper's steady state (DESIGN.md section 11, paper section 4): step
k+1's fused pipeline is issued while step k's backward stages still drain, the weights stay exactly
one step stale.

Oracles: the plain-torch one-step-stale loop of ``test_async_optimizer.reference`` (parameters,
each step's gradient before clipping, each batch's loss), formulas (the scheduler's learning rate,
Lightning's step counter), the executor's own records (which runs were in flight together), and a
clean run stopped at the same step (checkpoints compared bitwise).
"""

from __future__ import annotations

import copy

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

import lightning_roundpipe
from _helpers import jitter_seeds, loader, max_diff, params, trainer, use_jitter
from test_async_optimizer import STEPS, TOL, Module, _case, reference
from test_steady_state_runtime import _FinishSpy

CLIP, LR_GAMMA = 0.5, 0.5  # test_async_optimizer.Module's StepLR: gamma 0.5 every step


def _steady(**kw) -> lightning_roundpipe.RoundPipeStrategy:
    return lightning_roundpipe.RoundPipeStrategy(optimizer="async", num_microbatches=3, partition="default", **kw)


def _in_flight(spy: _FinishSpy) -> list[int]:
    return [n for _, n in spy.started]


@pytest.mark.parametrize("kind,optimizer,lr,devices,jitter_seed", [
    ("llama", "sgd", 0.05, 2, None), ("llama", "adam", 1e-3, 3, None), ("lora", "adam", 1e-3, 2, None),
    *(pytest.param("llama", "sgd", 0.05, 2, *seed.values, marks=seed.marks) if hasattr(seed, "values")
      else ("llama", "sgd", 0.05, 2, seed) for seed in jitter_seeds(1))])
def test_steady_state_equals_one_step_stale_reference(kind, optimizer, lr, devices, jitter_seed, monkeypatch):
    """Clipping by norm and a per-step LR scheduler included; every program after the first is
    issued while the previous one is in flight; also under schedule jitter (``jitter_seed``: the
    optimizer thread, the shadow refresh and the main thread interleave otherwise)."""
    use_jitter(monkeypatch, jitter_seed)
    spy = _FinishSpy(monkeypatch)
    model, data = _case(kind)
    batches = list(loader(data))
    kw = dict(clip=CLIP, scheduler=True)
    stale = reference(model, batches, optimizer, lr, STEPS, **kw)[-1][0]
    module = Module(copy.deepcopy(model), optimizer, lr, scheduler=True)
    trainer(_steady(), devices, max_steps=STEPS, gradient_clip_val=CLIP).fit(module, loader(data))
    got = params(module.model)
    noise = max_diff(stale, reference(model, batches, optimizer, lr, STEPS, split=4, **kw)[-1][0])
    moved = max_diff(stale, params(model))
    diff = max_diff(got, stale)
    print(f"steady {kind} {optimizer} devices={devices}: {diff:.2e} (reference split by hand: {noise:.2e})")
    assert diff <= max(TOL, 4 * noise, 1e-3 * moved if optimizer == "adam" else 0.0)
    exact = reference(model, batches, optimizer, lr, STEPS, stale=False, **kw)[-1][0]
    assert max_diff(got, exact) > 100 * TOL  # the staleness is real
    assert _in_flight(spy) == [1] + [2] * (STEPS - 1)


class _Recorder(L.Callback):
    """What the hooks see: ``on_before_optimizer_step`` (gradient, LR, ``global_step``) and each
    batch's loss at ``on_train_batch_end``."""

    def __init__(self) -> None:
        self.grads: list[dict] = []
        self.lrs: list[float] = []
        self.global_steps: list[int] = []
        self.losses: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n[len("model."):]: p.grad.clone() for n, p in pl_module.named_parameters()
                           if p.grad is not None})
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self.global_steps.append(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach().clone())


class _LoggingModule(Module):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        total = sum(p.grad.sum() for p in self.model.parameters() if p.grad is not None)
        self.log("grad_sum", total)


class _AfterBackward(Module):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.seen: list[dict] = []

    def on_after_backward(self) -> None:
        self.seen.append({n[len("model."):]: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None})


def _grads_diff(got: list[dict], want: list[dict]) -> float:
    assert len(got) == len(want) and all(g.keys() == w.keys() and g for g, w in zip(got, want))
    return max(max_diff(g, w) for g, w in zip(got, want))


def test_hooks_in_the_steady_state(monkeypatch):
    """``on_before_optimizer_step`` sees each step's complete gradient (before clipping) and the LR of
    that step, once the gradient is complete: during the next step's ``training_step``, so
    ``trainer.global_step`` is one more than under the default strategy (the last step's at the end of
    fit); ``self.log`` works there. Each batch's loss (returned and logged) is the stale weights'."""
    spy = _FinishSpy(monkeypatch)
    model, data = _case("llama")
    grads, losses = [], []
    steps = reference(model, list(loader(data)), "sgd", 0.05, STEPS, clip=CLIP, scheduler=True, grads_out=grads,
                      losses_out=losses)
    recorder = _Recorder()
    module = _LoggingModule(copy.deepcopy(model), "sgd", 0.05, scheduler=True)
    fitted = trainer(_steady(), 2, max_steps=STEPS, gradient_clip_val=CLIP, callbacks=[recorder])
    fitted.fit(module, loader(data))
    assert _in_flight(spy) == [1] + [2] * (STEPS - 1)
    assert _grads_diff(recorder.grads, grads) <= TOL
    assert recorder.lrs == pytest.approx([0.05 * LR_GAMMA ** j for j in range(STEPS)])
    assert recorder.global_steps == list(range(1, STEPS + 1))
    assert max(abs(float(a) - float(b)) for a, b in zip(recorder.losses, losses)) <= TOL
    assert len(recorder.losses) == STEPS
    assert float(fitted.callback_metrics["train_loss"]) == pytest.approx(float(losses[-1]), abs=TOL)
    want_sum = float(sum(g.sum() for g in grads[-1].values()))
    assert float(fitted.callback_metrics["grad_sum"]) == pytest.approx(want_sum, rel=1e-5, abs=TOL)
    assert max_diff(params(module.model), steps[-1][0]) <= TOL


def test_on_after_backward_turns_the_overlap_off(monkeypatch):
    """A LightningModule that reads gradients in ``on_after_backward`` gets them complete: no step's
    pipeline overlaps the next; the weights are still one step stale."""
    spy = _FinishSpy(monkeypatch)
    model, data = _case("llama")
    grads = []
    steps = reference(model, list(loader(data)), "sgd", 0.05, STEPS, grads_out=grads)
    module = _AfterBackward(copy.deepcopy(model), "sgd", 0.05)
    trainer(_steady(), 2, max_steps=STEPS).fit(module, loader(data))
    assert _in_flight(spy) == [1] * STEPS
    assert _grads_diff(module.seen, grads) <= TOL
    assert max_diff(params(module.model), steps[-1][0]) <= TOL


class Boom(RuntimeError):
    pass


def _checkpoint(path) -> dict:
    saved = torch.load(path, weights_only=False)
    return {"state_dict": saved["state_dict"], "optimizer": saved["optimizer_states"][0]["state"],
            "global_step": saved["global_step"]}


def _assert_bitwise(got: dict, want: dict) -> None:
    assert got["global_step"] == want["global_step"]
    assert got["state_dict"].keys() == want["state_dict"].keys()
    for name, tensor in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], tensor), name
    assert got["optimizer"].keys() == want["optimizer"].keys() and want["optimizer"]
    for index, state in want["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"][index][key], value), (index, key)


@pytest.mark.parametrize("where", ["training_step", "device"])
def test_error_while_the_previous_step_drains_loses_nothing(where, tmp_path, monkeypatch):
    """Step 3 raises while step 2's pipeline drains (in ``training_step`` before the model runs, or in
    a decoder layer on a device after step 3's pipeline was issued): the original exception reaches
    the caller and the checkpoint written on the exception holds everything of steps 1-2, bitwise
    equal to the checkpoint of a run stopped cleanly after step 2 (so resuming either is the same).
    Step 3's batch is told apart by its rows (12, microbatches of 4; the others have 7: 3, 2, 2), so
    step 2's recomputation, still running, does not raise."""
    from torch.utils.data import DataLoader
    from transformers.models.llama import modeling_llama

    model, data = _case("llama")
    sizes = [7, 7, 12, 7]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    batches = [list(range(start, start + size)) for start, size in zip(starts, sizes)]

    def data_loader():
        return DataLoader(data, batch_sampler=batches)

    module = Module(copy.deepcopy(model), "adam", 1e-3, scheduler=True)
    clean = trainer(_steady(), 2, max_steps=2, gradient_clip_val=CLIP)
    clean.fit(module, data_loader())
    clean.save_checkpoint(tmp_path / "clean.ckpt")

    class Failing(Module):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2 and where == "training_step":
                raise Boom("step 3")
            return super().training_step(batch, batch_idx)

    if where == "device":
        real_forward = modeling_llama.LlamaDecoderLayer.forward

        def forward(self, hidden_states, *args, **kwargs):
            if hidden_states.shape[0] == 4:
                raise Boom("layer failed")
            return real_forward(self, hidden_states, *args, **kwargs)

        monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", forward)
    spy = _FinishSpy(monkeypatch)
    failing = Failing(copy.deepcopy(model), "adam", 1e-3, scheduler=True)
    run = trainer(_steady(), 2, max_steps=STEPS, gradient_clip_val=CLIP, enable_checkpointing=True,
                  callbacks=[OnExceptionCheckpoint(dirpath=tmp_path, filename="on_exception")])
    with pytest.raises(Boom):
        run.fit(failing, data_loader())
    assert _in_flight(spy) == ([1, 2, 2] if where == "device" else [1, 2])
    _assert_bitwise(_checkpoint(tmp_path / "on_exception.ckpt"), _checkpoint(tmp_path / "clean.ckpt"))
