"""``RoundPipeStrategy(optimizer="async", staleness_correction=...)``: the stale step corrected on the host.

The oracle is a plain-torch one-step-stale loop written here from the corrections' formulas
(:func:`corrected_reference`), independent of ``runtime/host/staleness.py``: step 1 computes on
``W_0``; step ``k >= 2`` computes its gradient ``g`` on the weights ``V_k`` and applies it to
``W_{k-1}``, where ``V_k = W_{k-2}``, or ``W_{k-2} + (W_{k-2} - W_{k-3})`` with weight prediction
(``W_{-1} = W_0``); delay compensation applies ``g + lambda * g * g * (W_{k-1} - V_k)`` (DC-ASGD),
gradient extrapolation ``g_k + (g_k - g_{k-1})``; a step after a validation computes on the current
weights and is not corrected. Clipping by norm sees the corrected gradient; a StepLR steps the LR.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import lightning_roundpipe
from _helpers import loader, max_diff, params, trainer
from test_async_optimizer import TOL, Module, _case, _loss, make_optimizer, reference

CLIP = 0.5
LAMBDA = 1000.0  # large: these tiny models' gradients are small, and the DC term is quadratic in them
STEPS = 4
CORRECTIONS = ("weight_prediction", "delay_compensation", "gradient_extrapolation")


def corrected_reference(model, batches, optimizer: str, lr: float, steps: int, correction: str | None,
                        lam: float = LAMBDA, clip: float = CLIP, fresh_after: tuple[int, ...] = ()) -> dict:
    """The trainable parameters after ``steps`` corrected one-step-stale steps (module docstring).
    ``fresh_after``: steps after which the next step computes on the current weights (a validation)."""
    live, view = copy.deepcopy(model), copy.deepcopy(model)
    trained = [n for n, p in live.named_parameters() if p.requires_grad]
    opt = make_optimizer([p for p in live.parameters() if p.requires_grad], optimizer, lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before_last = {n: p.detach().clone() for n, p in live.named_parameters()}  # the weights before the latest update
    grad_prev = None
    fresh = True
    batches = iter(batches)
    for step in range(1, steps + 1):
        view.zero_grad(set_to_none=True)
        _loss(view, next(batches)).backward()
        seen, now = params(view), params(live)
        raw = {n: p.grad.clone() for n, p in view.named_parameters() if p.requires_grad}
        grad = dict(raw)
        if correction == "delay_compensation" and not fresh:
            grad = {n: g + lam * g * g * (now[n] - seen[n]) for n, g in raw.items()}
        if correction == "gradient_extrapolation":
            if not fresh and grad_prev is not None:
                grad = {n: g + (g - grad_prev[n]) for n, g in raw.items()}
            grad_prev = raw
        # the weights the next step computes on, taken before this step's update is applied
        upcoming = {n: now[n] + (now[n] - before_last[n]) for n in now} if correction == "weight_prediction" else now
        for name, param in live.named_parameters():
            if name in grad:
                param.grad = grad[name].clone()
        torch.nn.utils.clip_grad_norm_(live.parameters(), clip)
        before_last = params(live)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        fresh = step in fresh_after
        with torch.no_grad():
            for name, param in view.named_parameters():
                param.copy_(params(live)[name] if fresh else upcoming[name])
    return {n: p for n, p in params(live).items() if n in trained}


def _strategy(correction, **kw) -> lightning_roundpipe.RoundPipeStrategy:
    if correction == "delay_compensation":  # the only correction that reads lambda (others refuse a set one)
        kw["staleness_correction_lambda"] = LAMBDA
    return lightning_roundpipe.RoundPipeStrategy(optimizer="async", staleness_correction=correction,
                                                 num_microbatches=3, partition="default", **kw)


def _trained(module) -> dict:
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}


def test_reference_without_correction_is_the_stale_reference():
    """The oracle's loop with no correction is ``test_async_optimizer.reference`` (checked against
    Lightning there), so the corrected loops differ from the plain stale step by the correction alone."""
    model, data = _case("llama")
    batches = list(loader(data))
    ours = corrected_reference(model, batches, "sgd", 0.05, STEPS, None)
    theirs = reference(model, batches, "sgd", 0.05, STEPS, clip=CLIP, scheduler=True)[-1][0]
    assert max_diff(ours, theirs) == 0.0


@pytest.mark.parametrize("correction,devices", [
    *((correction, 2) for correction in CORRECTIONS), ("weight_prediction", 3),
    *(pytest.param(correction, 3, marks=pytest.mark.slow) for correction in CORRECTIONS[1:])])
def test_corrected_async_equals_the_formula(correction, devices, caplog):
    """Steady state (the default ``overlap_batches=True``), clipping and a StepLR: within 1e-6 of the
    formula; and the correction is real (the plain stale step is over 20x further). The setup line
    names the correction."""
    caplog.set_level(logging.INFO)
    model, data = _case("llama")
    batches = list(loader(data))
    want = corrected_reference(model, batches, "sgd", 0.05, STEPS, correction)
    module = Module(copy.deepcopy(model), "sgd", 0.05, scheduler=True)
    trainer(_strategy(correction), devices, max_steps=STEPS, gradient_clip_val=CLIP).fit(module, loader(data))
    got = _trained(module)
    plain = corrected_reference(model, batches, "sgd", 0.05, STEPS, None)
    print(f"{correction} devices={devices}: {max_diff(got, want):.2e} to the formula, the plain stale step"
          f" {max_diff(plain, want):.2e} away")
    assert max_diff(got, want) <= TOL
    assert max_diff(plain, want) > 20 * TOL
    assert f"optimizer 'async' (staleness correction {correction!r})" in caplog.text


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_corrected_async_without_the_steady_state(correction):
    """``overlap_batches=False`` (each pipeline drains before its backward returns; the snapshot is
    refreshed in the main thread): the same formula."""
    model, data = _case("mlp")
    batches = list(loader(data))
    want = corrected_reference(model, batches, "sgd", 0.05, STEPS, correction)
    module = Module(copy.deepcopy(model), "sgd", 0.05, scheduler=True)
    trainer(_strategy(correction, overlap_batches=False), 2, max_steps=STEPS, gradient_clip_val=CLIP).fit(
        module, loader(data))
    assert max_diff(_trained(module), want) <= TOL


class _ValModule(Module):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", _loss(self.model, batch))


def _final_state(path) -> dict:
    saved = torch.load(path, weights_only=False)
    return {"state_dict": saved["state_dict"], "optimizer": saved["optimizer_states"][0]["state"],
            "staleness": saved["roundpipe_staleness"], "global_step": saved["global_step"]}


def _assert_same(got, want) -> None:
    assert isinstance(got, type(want)), (type(got), type(want))
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    else:
        assert got == want


@pytest.mark.parametrize("correction", [
    "weight_prediction", *(pytest.param(correction, marks=pytest.mark.slow) for correction in CORRECTIONS[1:])])
def test_resume_is_bitwise(correction, tmp_path):
    """Two epochs of 2 steps with a validation after each (which makes the next step compute on the
    current weights, as a resume does): straight, or 2 steps, a checkpoint, and a resumed fit. The
    weights, optimizer state and the correction's state at the end are bitwise equal; and the
    formula with a fresh step after step 2 is what both computed."""
    model, data = _case("llama")
    kw = dict(limit_train_batches=2, limit_val_batches=1, gradient_clip_val=CLIP)
    straight = _ValModule(copy.deepcopy(model), "sgd", 0.05, scheduler=True)
    run = trainer(_strategy(correction), 2, max_steps=4, **kw)
    run.fit(straight, loader(data), loader(data))
    run.save_checkpoint(tmp_path / "straight.ckpt")
    first = _ValModule(copy.deepcopy(model), "sgd", 0.05, scheduler=True)
    half = trainer(_strategy(correction), 2, max_steps=2, **kw)
    half.fit(first, loader(data), loader(data))
    half.save_checkpoint(tmp_path / "half.ckpt")
    assert torch.load(tmp_path / "half.ckpt", weights_only=False)["roundpipe_staleness"]["kind"] == correction
    resumed = _ValModule(copy.deepcopy(model), "sgd", 0.05, scheduler=True)
    rest = trainer(_strategy(correction), 2, max_steps=4, **kw)
    rest.fit(resumed, loader(data), loader(data), ckpt_path=tmp_path / "half.ckpt")
    rest.save_checkpoint(tmp_path / "resumed.ckpt")
    _assert_same(_final_state(tmp_path / "resumed.ckpt"), _final_state(tmp_path / "straight.ckpt"))
    batches = list(loader(data))
    want = corrected_reference(model, batches[:2] * 2, "sgd", 0.05, 4, correction, fresh_after=(2,))
    assert max_diff(_trained(resumed), want) <= TOL


@pytest.mark.parametrize("kwargs,match", [
    (dict(optimizer="async", staleness_correction="foo"),
     r"`staleness_correction` must be one of \[None, 'weight_prediction', 'delay_compensation',"
     r" 'gradient_extrapolation'\].*HINT"),
    (dict(optimizer="async", staleness_correction="Weight-Prediction"), r"HINT: use 'weight_prediction'"),
    (dict(optimizer="sync", staleness_correction="weight_prediction"), r"`optimizer='sync'` has no stale step.*HINT"),
    (dict(staleness_correction="delay_compensation"), r"`optimizer='sync'` has no stale step.*HINT"),
    (dict(optimizer="async", staleness_correction="delay_compensation", staleness_correction_lambda=-0.1),
     r"`staleness_correction_lambda` must be a finite number >= 0.*HINT"),
    (dict(optimizer="async", staleness_correction_lambda=float("nan")), r"`staleness_correction_lambda`.*HINT"),
    (dict(optimizer="async", staleness_correction="weight_prediction", staleness_correction_lambda=0.5),
     r"`staleness_correction_lambda=0.5` is read only by `staleness_correction='delay_compensation'`.*ignored.*HINT"),
    (dict(optimizer="async", staleness_correction_lambda=0.5), r"read only by.*delay_compensation.*HINT"),
    (dict(optimizer="Async"), r"`optimizer` must be one of \['sync', 'async'\].*HINT: use 'async' \(lowercase, no spaces\);"
     r" from the command line `strategy.optimizer=async`"),
    (dict(dispatch="Auto"), r"HINT: use 'auto' \(lowercase, no spaces\)"),
])
def test_bad_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lightning_roundpipe.RoundPipeStrategy(**kwargs)


def test_none_spellings_and_hydra():
    """``None`` and ``"none"`` are the paper's update; Hydra's ``strategy.staleness_correction=...``
    reaches the strategy."""
    from hydra.utils import instantiate

    from test_config import _compose

    for value in (None, "none", "None"):
        assert lightning_roundpipe.RoundPipeStrategy(optimizer="async", staleness_correction=value).config \
            .staleness_correction is None
    cfg = _compose("strategy.optimizer=async", "strategy.staleness_correction=delay_compensation",
                   "strategy.staleness_correction_lambda=0.5")
    config = instantiate(cfg.strategy).config
    assert (config.staleness_correction, config.staleness_correction_lambda) == ("delay_compensation", 0.5)
    assert instantiate(_compose("strategy.optimizer=async").strategy).config.staleness_correction is None


def test_the_planner_adds_the_correction_to_the_async_optimizer_op():
    """``roundpipe plan --staleness-correction``: the async mode's ``OPT`` op takes the correction's
    measured bytes per trainable parameter on top of Adam's (the formula of
    ``partition.profile.STALENESS_CORRECTION_BYTES_PER_PARAM``); the sync mode's is unchanged. With a
    slow host optimizer (1 GB/s) the async step is the ``OPT`` op, so it grows."""
    from lightning_roundpipe.partition.profile import STALENESS_CORRECTION_BYTES_PER_PARAM
    from test_plan_cmd import parse
    from lightning_roundpipe.cli import plan_cmd

    argv = ["plan", "--preset", "qwen3-1.7b", "--devices", "4", "--optimizer", "async", "--optimizer-gbps", "1"]
    plain = plan_cmd.make_report(parse(argv))
    corrected = plan_cmd.make_report(parse([*argv, "--staleness-correction", "delay_compensation"]))
    trainable = plain.optimizer_bytes // 12  # fp32 Adam: 12 counted bytes per trainable parameter
    assert plain.correction_bytes == 0
    assert corrected.correction_bytes == round(trainable * STALENESS_CORRECTION_BYTES_PER_PARAM["delay_compensation"])
    rate = plain.hardware.optimizer_bytes_per_s
    async_opt = corrected.mode_choices["async"].prediction.optimizer_step_s
    assert async_opt == pytest.approx((plain.optimizer_bytes + corrected.correction_bytes) / rate, rel=1e-12)
    assert plain.mode_choices["async"].prediction.optimizer_step_s == pytest.approx(plain.optimizer_bytes / rate)
    assert (corrected.mode_choices["sync"].prediction.optimizer_step_s
            == plain.mode_choices["sync"].prediction.optimizer_step_s)
    assert corrected.mode_choices["async"].prediction.step_s > plain.mode_choices["async"].prediction.step_s
