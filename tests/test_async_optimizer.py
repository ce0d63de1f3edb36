"""`RoundPipeStrategy(optimizer="async")`: the paper's asynchronous optimizer (section 4).

The oracle is a hand-written one-step-stale training loop in plain torch (:func:`reference`): step 1
computes its gradient on ``W_0``; step ``j >= 2`` computes it on ``W_{j-2}`` and applies it to
``W_{j-1}``. The same loop with ``stale=False`` is Lightning's own semantics; it is checked against
the default strategy, so the loop models Lightning's loss normalisation, clipping and scheduler
order, and the async runs are checked to differ from it (the staleness is real).
"""

from __future__ import annotations

import copy
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import lightning_roundpipe
from _helpers import TokenData, VectorData, loader, max_diff, params, tiny_hf, tiny_mlp, trainer

TOL = 1e-6
STEPS = 4


def _loss(model: nn.Module, batch) -> torch.Tensor:
    if isinstance(batch, dict):
        return model(**batch).loss
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _split_loss(model: nn.Module, batch, split: int) -> torch.Tensor:
    """The batch's loss computed as ``split`` row microbatches summed by hand (each normalised by the
    whole batch's label count, as the pipeline does): the same value, another float summation order."""
    if split == 1:
        return _loss(model, batch)
    if isinstance(batch, dict):
        items = int((batch["labels"][..., 1:] != -100).sum())
        parts = [dict(zip(batch, values)) for values in zip(*(t.tensor_split(split) for t in batch.values()))]
        return sum(model(**part, num_items_in_batch=items).loss for part in parts)
    x, y = batch
    return sum(nn.functional.cross_entropy(model(xs), ys, reduction="sum")
               for xs, ys in zip(x.tensor_split(split), y.tensor_split(split))) / len(y)


class SlowSGD(torch.optim.SGD):
    """SGD whose step sleeps before and after the update: a read of the weights that does not wait
    for the step in flight sees the old weights, and a pipeline that reads the masters instead of
    its snapshot sees the new ones."""

    def __init__(self, *args, sleep_s: float = 0.1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sleep_s = sleep_s

    def step(self, closure=None):
        time.sleep(self.sleep_s)
        out = super().step(closure)
        time.sleep(self.sleep_s)
        return out


def make_optimizer(parameters, kind: str, lr: float) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(parameters, lr=lr)
    if kind == "slow_sgd":
        return SlowSGD(parameters, lr=lr, momentum=0.9)
    raise ValueError(kind)


class Module(L.LightningModule):
    def __init__(self, model: nn.Module, optimizer: str = "sgd", lr: float = 0.05, scheduler: bool = False) -> None:
        super().__init__()
        self.model = model
        self.optimizer_kind, self.lr, self.scheduler = optimizer, lr, scheduler
        self.val_outputs: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        return _loss(self.model, batch)

    def validation_step(self, batch, batch_idx):
        self.val_outputs.append(self.model(batch[0]).detach().clone())

    def configure_optimizers(self):
        opt = make_optimizer([p for p in self.model.parameters() if p.requires_grad], self.optimizer_kind, self.lr)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def reference(model: nn.Module, batches: list, optimizer: str, lr: float, steps: int, stale: bool = True,
              accumulate: int = 1, clip: float | None = None, scheduler: bool = False,
              refresh_after: tuple[int, ...] = (), split: int = 1, grads_out: list | None = None,
              losses_out: list | None = None) -> list[tuple[dict, dict]]:
    """Plain-torch training, one step stale when ``stale``: ``(parameters, optimizer state)`` after
    every optimizer step. ``refresh_after``: steps after which the computing copy takes the current
    weights (a validation run during async fit refreshes the pipeline's weights). ``split``: each
    batch's gradient summed over that many row microbatches by hand (:func:`_split_loss`). ``grads_out``
    / ``losses_out``: receive each step's gradient before clipping (by parameter name) / each batch's loss."""
    live = copy.deepcopy(model)
    view = copy.deepcopy(model)  # the weights the pipeline computes on
    opt = make_optimizer([p for p in live.parameters() if p.requires_grad], optimizer, lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    out = []
    batches = iter(batches)
    for step in range(1, steps + 1):
        if not stale:
            view.load_state_dict(live.state_dict())
        view.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            loss = _split_loss(view, next(batches), split)
            (loss / accumulate).backward()
            if losses_out is not None:
                losses_out.append(loss.detach().clone())
        grads = [p.grad.clone() for p in view.parameters() if p.requires_grad]
        if grads_out is not None:
            grads_out.append({n: p.grad.clone() for n, p in view.named_parameters() if p.requires_grad})
        view.load_state_dict(live.state_dict())  # W_{step-1}: what the next step computes on
        for param, grad in zip([p for p in live.parameters() if p.requires_grad], grads):
            param.grad = grad
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(live.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        if step in refresh_after:
            view.load_state_dict(live.state_dict())
        out.append((params(live), copy.deepcopy(opt.state_dict())))
    return out


def _case(kind: str):
    if kind == "mlp":
        return tiny_mlp(), VectorData()
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(tiny_hf("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0)), TokenData()
    return tiny_hf("llama"), TokenData()


def _fit(model, data, optimizer, lr, mode="async", devices=2, module_kw=None, strategy_kw=None, **trainer_kw):
    module = Module(model, optimizer, lr, **(module_kw or {}))
    strategy = lightning_roundpipe.RoundPipeStrategy(optimizer=mode, **(strategy_kw or {}))
    trainer(strategy, devices, **trainer_kw).fit(module, loader(data))
    return module


@pytest.mark.parametrize("kind", ["mlp", "llama"])
@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.05), ("adam", 1e-3)])
@pytest.mark.parametrize("devices", [1, 2])
def test_async_equals_one_step_stale_reference(kind, optimizer, lr, devices):
    model, data = _case(kind)
    batches = list(loader(data))
    stale = reference(model, batches, optimizer, lr, STEPS)[-1][0]
    got = params(_fit(copy.deepcopy(model), data, optimizer, lr, devices=devices, max_steps=STEPS).model)
    diff = max_diff(got, stale)
    # Adam divides by sqrt(v): a weight whose gradient is near zero moves by about lr whatever the
    # rounding of that gradient, so float-order differences of the microbatch sum (the reference cut by
    # hand differs from itself by `noise`) are amplified. For Adam the bound is 0.1 % of how far the
    # weights moved; a wrong staleness moves them by a whole step's update (checked below: > 100 * TOL).
    noise = max_diff(stale, reference(model, batches, optimizer, lr, STEPS, split=devices + 1)[-1][0])
    moved = max_diff(stale, params(model))
    print(f"async {kind} {optimizer} devices={devices}: max abs diff to the stale reference {diff:.2e}"
          f" (reference vs itself split by hand: {noise:.2e}; weights moved {moved:.2e})")
    assert diff <= max(TOL, 4 * noise, 1e-3 * moved if optimizer == "adam" else 0.0)
    exact = reference(model, batches, optimizer, lr, STEPS, stale=False)[-1][0]
    assert max_diff(got, exact) > 100 * TOL  # the staleness is real


def test_async_lora_frozen_base_keeps_its_single_copy():
    """LoRA (PEFT, frozen base): the adapters follow the stale reference; only trainable weights get
    a snapshot copy, the frozen base stays its own shadow."""
    model, data = _case("lora")
    stale = reference(model, list(loader(data)), "adam", 1e-3, STEPS)[-1][0]
    module = Module(copy.deepcopy(model), "adam", 1e-3)
    copies = {}

    class Shadows(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            for entry in trainer.strategy.engine.store.tensors.values():
                if entry.is_param:
                    copies[entry.master.requires_grad] = copies.get(entry.master.requires_grad, set()) | {
                        entry.shadow.data_ptr() != entry.master.data_ptr()}

    trainer(lightning_roundpipe.RoundPipeStrategy(optimizer="async"), 2, max_steps=STEPS,
            callbacks=[Shadows()]).fit(module, loader(data))
    assert max_diff(params(module.model), stale) <= TOL
    exact = reference(model, list(loader(data)), "adam", 1e-3, STEPS, stale=False)[-1][0]
    assert max_diff(params(module.model), exact) > 100 * TOL  # the staleness is real
    assert copies == {True: {True}, False: {False}}


def test_reference_without_staleness_is_lightning():
    """The oracle's loop with ``stale=False`` is the default strategy (clipping, accumulation, LR
    scheduler), so the stale loop differs from Lightning by the staleness alone."""
    model, data = _case("mlp")
    kw = dict(accumulate=2, clip=0.5, scheduler=True)
    exact = reference(model, list(loader(data)), "sgd", 0.05, 3, stale=False, **kw)[-1][0]
    module = Module(copy.deepcopy(model), "sgd", 0.05, scheduler=True)
    trainer("auto", 1, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5).fit(module, loader(data))
    assert max_diff(params(module.model), exact) <= TOL


@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_async_with_accumulation_clipping_and_scheduler(kind):
    """Every batch of an accumulation window computes on the same (stale) weights; clipping sees the
    step's gradient; the StepLR step runs after the update it follows (queued to the next wait: the
    slow optimizer reads the learning rate after a sleep, so a scheduler step run at once changes
    the learning rate of the update in flight)."""
    model, data = _case(kind)
    kw = dict(accumulate=2, clip=0.5, scheduler=True)
    stale = reference(model, list(loader(data)), "slow_sgd", 0.05, 3, **kw)[-1][0]
    module = _fit(copy.deepcopy(model), data, "slow_sgd", 0.05, module_kw=dict(scheduler=True), max_steps=3,
                  accumulate_grad_batches=2, gradient_clip_val=0.5, strategy_kw=dict(num_microbatches=3))
    assert max_diff(params(module.model), stale) <= TOL
    assert module.trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == pytest.approx(0.05 * 0.5 ** 3)


def test_checkpoint_mid_fit_waits_for_the_step_in_flight(tmp_path):
    """A checkpoint saved after step j holds W_j and the optimizer state after step j (the slow
    optimizer makes a read that does not wait see W_{j-1})."""
    model, data = _case("mlp")
    steps = reference(model, list(loader(data)), "slow_sgd", 0.05, 3)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    module = _fit(copy.deepcopy(model), data, "slow_sgd", 0.05, max_steps=3, enable_checkpointing=True,
                  callbacks=[checkpoint])
    for step, (weights, opt_state) in enumerate(steps, start=1):
        saved = torch.load(tmp_path / f"step={step}.ckpt", weights_only=False)
        got = {name[len("model."):]: tensor for name, tensor in saved["state_dict"].items()}
        assert max_diff(got, weights) <= TOL, step
        momentum = saved["optimizer_states"][0]["state"]
        for index, state in opt_state["state"].items():
            assert torch.allclose(momentum[index]["momentum_buffer"], state["momentum_buffer"], atol=TOL), step
    assert max_diff(params(module.model), steps[-1][0]) <= TOL  # the last step is complete after fit


class WeightsAfterWait(L.Callback):
    """Records the weights in ``on_train_batch_end`` after ``trainer.strategy.wait_for_optimizer()``."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        trainer.strategy.wait_for_optimizer()
        self.seen.append(params(pl_module.model))


def test_validation_mid_fit_sees_current_weights():
    """Validation after step j evaluates W_j (it waits and refreshes the pipeline's weights), and
    the training step after it computes on W_j; a callback that calls `wait_for_optimizer()` sees
    W_j after every step."""
    model, data = _case("mlp")
    val = VectorData(n=5, seed=3)
    steps = reference(model, list(loader(data)), "slow_sgd", 0.05, STEPS, refresh_after=(2, 4))
    module = Module(copy.deepcopy(model), "slow_sgd", 0.05)
    recorder = WeightsAfterWait()
    t = trainer(lightning_roundpipe.RoundPipeStrategy(optimizer="async"), 2, max_steps=STEPS, val_check_interval=2,
                callbacks=[recorder])
    t.fit(module, loader(data), loader(val))
    assert len(recorder.seen) == STEPS
    for seen, (weights, _) in zip(recorder.seen, steps):
        assert max_diff(seen, weights) <= TOL
    metrics = t.strategy.step_metrics  # the last step's: it waited for step 3's update (0.2 s of sleep)
    assert float(metrics["roundpipe/optimizer_thread(s)"]) >= 0.2
    assert float(metrics["roundpipe/optimizer_wait(s)"]) > 0.0
    assert len(module.val_outputs) == 2
    for output, step in zip(module.val_outputs, (2, 4)):
        evaluated = copy.deepcopy(model)
        evaluated.load_state_dict(steps[step - 1][0])
        with torch.no_grad():
            assert torch.allclose(output, evaluated(val.x), atol=TOL), step
    assert max_diff(params(module.model), steps[-1][0]) <= TOL


class Boom(RuntimeError):
    def __init__(self, code: int) -> None:
        super().__init__(f"boom {code}")
        self.code = code


class FailingSGD(torch.optim.SGD):
    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            raise Boom(7)
        return super().step(closure)


def test_error_in_the_background_step_reaches_the_main_thread():
    class Failing(Module):
        def configure_optimizers(self):
            return FailingSGD(self.model.parameters(), lr=0.05)

    module = Failing(tiny_mlp())
    with pytest.raises(Boom) as info:
        trainer(lightning_roundpipe.RoundPipeStrategy(optimizer="async"), 2, max_steps=STEPS).fit(module, loader(VectorData()))
    assert info.value.code == 7
    assert any("asynchronous optimizer thread" in note for note in info.value.__notes__)
    assert module.trainer.global_step == 2  # raised at the first wait after the failing step
    # the strategy was torn down: a new fit works
    _fit(tiny_mlp(), VectorData(), "sgd", 0.05, max_steps=1)


def test_bad_optimizer_mode_lists_the_options():
    with pytest.raises(ValueError, match=r"\['sync', 'async'\]"):
        lightning_roundpipe.RoundPipeStrategy(optimizer="asynchronous")


def test_manual_optimization_is_refused():
    class Manual(Module):
        def __init__(self):
            super().__init__(tiny_mlp())
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(_loss(self.model, batch))
            opt.step()

    with pytest.raises(ValueError, match="automatic optimization.*HINT"):
        trainer(lightning_roundpipe.RoundPipeStrategy(optimizer="async"), 2, max_steps=1).fit(Manual(), loader(VectorData()))


def test_lbfgs_and_parameters_outside_the_pipeline_are_refused():
    class WithLBFGS(Module):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.model.parameters())

    with pytest.raises(ValueError, match="LBFGS"):
        trainer(lightning_roundpipe.RoundPipeStrategy(optimizer="async"), 1, max_steps=1).fit(
            WithLBFGS(tiny_mlp()), loader(VectorData()))

    class Upstream(Module):
        def __init__(self):
            super().__init__(tiny_mlp())
            self.scale = nn.Parameter(torch.ones(8))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.model(x * self.scale), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    with pytest.raises(ValueError, match="`scale`.*HINT"):
        trainer(lightning_roundpipe.RoundPipeStrategy(optimizer="async"), 1, max_steps=1).fit(
            Upstream(), loader(VectorData()))


def test_16_mixed_inf_step_is_skipped_and_backs_off():
    """Under 16-mixed the loss-scaling plugin decides in the main thread (unscale, inf check, skip,
    scale update); only a step it takes goes to the thread. An inf in step 2's gradient leaves the
    weights after step 2 equal to those after step 1, the scale follows GradScaler's rule."""
    from lightning.pytorch.callbacks import Callback
    from test_precision import InfModule, Trigger, expected_scales

    from lightning_roundpipe import RoundPipePrecision

    class Recorder(Callback):
        def __init__(self) -> None:
            self.params: list[dict] = []
            self.scales: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            trigger.step = trainer.global_step
            trigger.armed = trainer.global_step == inf_step

        def on_train_batch_end(self, trainer, pl_module, *args):
            trainer.strategy.wait_for_optimizer()
            self.params.append(params(pl_module))
            self.scales.append(trainer.precision_plugin.scaler.get_scale())

    steps, inf_step, trigger, recorder = 4, 1, Trigger(), Recorder()
    module = InfModule(trigger)
    initial = params(module)
    plugin = RoundPipePrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2))
    t = trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, optimizer="async"), 2, max_steps=steps,
                plugins=[plugin], callbacks=[recorder], gradient_clip_val=0.01)
    t.fit(module, loader(VectorData(n=7 * steps)))
    assert trigger.fired_at == [inf_step]
    history = [initial] + recorder.params
    for step in range(steps):
        unchanged = all(torch.equal(history[step][k], history[step + 1][k]) for k in initial)
        assert unchanged == (step == inf_step), step
    assert recorder.scales == expected_scales(2.0**10, {inf_step}, steps, growth_interval=2)


def test_only_the_update_runs_off_the_main_thread():
    """The thread runs `optimizer.step()` alone; `zero_grad` (it sets `.grad`, which torch does not
    make safe against a concurrent read) and the LR scheduler step run in the main thread."""
    import threading

    seen: dict[str, set] = {"step": set(), "zero_grad": set(), "lr_scheduler_step": set()}

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen["step"].add(threading.current_thread().name)
            return super().step(closure)

        def zero_grad(self, set_to_none: bool = True):
            seen["zero_grad"].add(threading.current_thread().name)
            super().zero_grad(set_to_none)

    class WithRecording(Module):
        def configure_optimizers(self):
            opt = Recording(self.model.parameters(), lr=0.05)
            return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), "interval": "step"}]

        def lr_scheduler_step(self, scheduler, metric):
            seen["lr_scheduler_step"].add(threading.current_thread().name)
            super().lr_scheduler_step(scheduler, metric)

    trainer(lightning_roundpipe.RoundPipeStrategy(optimizer="async"), 2, max_steps=STEPS).fit(
        WithRecording(tiny_mlp()), loader(VectorData()))
    main = threading.main_thread().name
    assert seen == {"step": {"roundpipe-optimizer"}, "zero_grad": {main}, "lr_scheduler_step": {main}}
