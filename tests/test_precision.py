"""Every Lightning precision under RoundPipe (DESIGN.md section 5; issue 7, item 4).

Oracle: Lightning's default single-device strategy with the same precision, from the same initial
weights and batches. For ``16-mixed`` on the CPU, Lightning's ``Trainer(precision="16-mixed")`` would
fall back to bf16, so the reference is Lightning's own fp16 AMP with a CPU ``GradScaler``, built with
``plugins=[MixedPrecision("16-mixed", "cpu")]`` (the connector keeps a plugin it is given).

Bounds. Both runs evaluate the same operations in the same dtype; they differ only in grouping: the
batch is cut into microbatches (per-microbatch matmuls, per-microbatch weight gradients summed), and
under the mixed precisions the weights are rounded to the compute dtype on the host before the upload
instead of inside autocast (the same rounding). A regrouped operation perturbs its result by about one
unit roundoff ``u`` of the compute dtype (fp64 2**-53, fp32 2**-24, bf16 2**-8, fp16 2**-11), and such
perturbations add up along the ``DEPTH`` matmul layers of a forward and again of a backward. Hence:

- forward only (validate, test, predict): relative error <= ``2 * DEPTH * u``;
- fit over ``S`` steps: relative error of the update ``theta - theta0`` <= ``2 * DEPTH * S * u``; the
  true half precisions also round the masters themselves at every step, which moves the update by up
  to ``u * |theta|`` a step: ``S * u * (2 * DEPTH + |theta| / |theta - theta0|)``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

import lightning_roundpipe
from lightning_roundpipe import RoundPipePrecision
from lightning_roundpipe.runtime.host.store import WeightStore
from _helpers import CausalLMModule, MLPModule, TokenData, VectorData, loader, params, tiny_hf, trainer

PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"]
COMPUTE = {"32-true": torch.float32, "64-true": torch.float64, "bf16-mixed": torch.bfloat16,
           "16-mixed": torch.float16, "bf16-true": torch.bfloat16, "16-true": torch.float16}
DEPTH = 4  # matmul layers of the MLP (tests/_helpers.py: tiny_mlp)
STEPS = 3
_REFERENCE: dict = {}


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def precision_args(precision: str, strategy) -> dict:
    """Trainer arguments for ``precision``; the default strategy's 16-mixed reference is Lightning's own fp16 AMP."""
    if precision == "16-mixed" and strategy == "auto":
        return dict(plugins=[MixedPrecision("16-mixed", "cpu")])
    return dict(precision=precision)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().double().flatten() for t in tensors])


def relative(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    return ((got - ref).norm() / (ref if scale is None else scale).norm()).item()


class EvalMLP(MLPModule):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", nn.functional.cross_entropy(self.model(x), y))


def run_cell(precision: str, mode: str, strategy) -> dict:
    """One cell: ``fit`` (initial and final parameters) or the output of validate/test/predict."""
    module = EvalMLP()
    data = loader(VectorData(n=7 * STEPS, seed=1 if mode == "fit" else 2))
    t = trainer(strategy, 1 if strategy == "auto" else 2, max_steps=STEPS, **precision_args(precision, strategy))
    if mode == "fit":
        before = flat(module.parameters())
        t.fit(module, data)
        return {"before": before, "after": flat(module.parameters()), "dtype": next(module.parameters()).dtype}
    if mode == "predict":
        return {"out": flat(t.predict(module, data))}
    result = getattr(t, mode)(module, data, verbose=False)[0]
    return {"out": torch.tensor([result[f"{'val' if mode == 'validate' else 'test'}/loss"]], dtype=torch.float64)}


def reference(precision: str, mode: str) -> dict:
    if (precision, mode) not in _REFERENCE:
        _REFERENCE[(precision, mode)] = run_cell(precision, mode, "auto")
    return _REFERENCE[(precision, mode)]


@pytest.mark.parametrize("mode", ["fit", "validate", "test", "predict"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_precision_matrix_matches_default_strategy(precision, mode, record_property):
    ref = reference(precision, mode)
    got = run_cell(precision, mode, lightning_roundpipe.RoundPipeStrategy(num_microbatches=3))
    u = unit_roundoff(COMPUTE[precision])
    if mode == "fit":
        update = ref["after"] - ref["before"]
        err = relative(got["after"] - ref["before"], update)
        bound = STEPS * u * 2 * DEPTH
        if precision.endswith("-true") and COMPUTE[precision] in (torch.bfloat16, torch.float16):
            bound = STEPS * u * (2 * DEPTH + (ref["after"].norm() / update.norm()).item())
        assert got["dtype"] == ref["dtype"]  # masters: fp32 for mixed, the dtype itself for true
        assert torch.equal(got["before"], ref["before"]) and update.norm() > 0
    else:
        err, bound = relative(got["out"], ref["out"]), 2 * DEPTH * u
    record_property("relative_error", err)
    print(f"{precision} {mode}: relative error {err:.3e} ({err / u:.2f} u), bound {bound:.3e}")
    assert err <= bound


# ---------------------------------------------------------------------------------------- 16-mixed on the CPU
class DtypeSpy(Callback):
    """Records the dtype of the first Linear's output as computed on the device workers."""

    def __init__(self) -> None:
        self.dtypes: set = set()
        self.scales: list[float] = []

    def on_train_start(self, trainer, pl_module):
        pl_module.model[0].register_forward_hook(lambda mod, args, out: self.dtypes.add(out.dtype))

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def test_16_mixed_on_cpu_computes_in_fp16_with_loss_scaling():
    """Lightning turns `16-mixed` on the CPU into bf16 for its own plugin; RoundPipe's devices compute in fp16."""
    assert trainer("auto", precision="16-mixed").precision == "bf16-mixed"  # what Lightning does on its own
    spy = DtypeSpy()
    t = trainer("roundpipe", devices=2, precision="16-mixed", max_steps=2, callbacks=[spy])
    plugin = t.precision_plugin
    assert (plugin.precision, plugin.compute_dtype, plugin.autocast_dtype) == ("16-mixed", torch.float16, torch.float16)
    assert isinstance(plugin.scaler, torch.amp.GradScaler) and plugin.scaler._device == "cpu"
    t.fit(MLPModule(), loader(VectorData()))
    assert spy.dtypes == {torch.float16}
    assert spy.scales == [2.0**16, 2.0**16]  # GradScaler's default init_scale, no growth before 2000 steps
    # a bf16 choice stays bf16
    assert trainer("roundpipe", devices=2, precision="bf16-mixed").precision_plugin.compute_dtype == torch.bfloat16


class Trigger:
    """Armed by a callback at one step; the first backward through `InjectInf` then consumes it."""

    def __init__(self) -> None:
        self.armed = False
        self.fired_at: list[int] = []
        self.step = -1
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):  # `save_hyperparameters` copies the module's init arguments
        return self

    def consume(self) -> bool:
        with self._lock:
            fired, self.armed = self.armed, False
            if fired:
                self.fired_at.append(self.step)
            return fired


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, trigger):
        ctx.trigger = trigger
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad * float("inf") if ctx.trigger.consume() else grad), None


class InjectInf(nn.Module):
    """Identity; its backward multiplies one microbatch's gradient by inf when armed."""

    def __init__(self, trigger: Trigger) -> None:
        super().__init__()
        self.trigger = trigger

    def forward(self, x):
        return _InfGrad.apply(x, self.trigger)


class InfModule(MLPModule):
    def __init__(self, trigger: Trigger) -> None:
        super().__init__(scheduler=False)
        layers = list(self.model)
        self.model = nn.Sequential(*layers[:4], InjectInf(trigger), *layers[4:])


class Recorder(Callback):
    def __init__(self, trigger: Trigger, inf_step: int) -> None:
        self.trigger, self.inf_step = trigger, inf_step
        self.params: list[dict] = []
        self.scales: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.trigger.step = trainer.global_step
        self.trigger.armed = trainer.global_step == self.inf_step

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.params.append(params(pl_module))
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def expected_scales(init_scale: float, inf_steps: set, steps: int, growth_interval: int) -> list[float]:
    """`torch.amp.GradScaler`'s documented rule: x0.5 (backoff_factor) on a step with inf/NaN gradients,
    x2 (growth_factor) after `growth_interval` consecutive good steps."""
    scale, good, out = init_scale, 0, []
    for step in range(steps):
        if step in inf_steps:
            scale, good = scale * 0.5, 0
        else:
            good += 1
            if good == growth_interval:
                scale, good = scale * 2.0, 0
        out.append(scale)
    return out


def _inf_run(strategy, plugin, inf_step: int, steps: int):
    trigger = Trigger()
    module = InfModule(trigger)
    recorder = Recorder(trigger, inf_step)
    t = trainer(strategy, 1 if strategy == "auto" else 2, max_steps=steps, plugins=[plugin], callbacks=[recorder],
                gradient_clip_val=0.01)  # clips every step: on unscaled gradients, or the update would be 1/scale
    initial = params(module)
    t.fit(module, loader(VectorData(n=7 * steps)))
    return initial, recorder, trigger


def test_inf_gradient_skips_exactly_that_step_and_backs_off():
    steps, inf_step = 4, 1
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    initial, got, trigger = _inf_run(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3),
                                     RoundPipePrecision("16-mixed", scaler=scaler), inf_step, steps)
    assert trigger.fired_at == [inf_step]  # one microbatch's gradient, once
    history = [initial] + got.params
    for step in range(steps):
        unchanged = all(torch.equal(history[step][k], history[step + 1][k]) for k in initial)
        assert unchanged == (step == inf_step), step
    assert got.scales == expected_scales(2.0**10, {inf_step}, steps, growth_interval=2) == [1024, 512, 512, 1024]
    # Lightning's own fp16 AMP (default strategy) with the same injection: same scales, same parameters
    _, ref, _ = _inf_run("auto", MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10,
                                                                                      growth_interval=2)), inf_step, steps)
    assert ref.scales == got.scales
    update = flat(ref.params[-1].values()) - flat(initial.values())
    err = relative(flat(got.params[-1].values()) - flat(initial.values()), update)
    bound = 2 * DEPTH * (steps - 1) * unit_roundoff(torch.float16)  # 3 real steps
    print(f"16-mixed with an inf step vs Lightning: relative error {err:.3e}, bound {bound:.3e}")
    assert err <= bound


class ScaleSpy(Callback):
    def __init__(self) -> None:
        self.at_start: float | None = None

    def on_train_start(self, trainer, pl_module):
        self.at_start = trainer.precision_plugin.scaler.get_scale()


def test_resume_restores_the_loss_scale(tmp_path):
    # growth_interval=1: the scale doubles every good step, so the saved scale differs from any initial one
    plugin = RoundPipePrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1))
    t = trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), devices=2, max_steps=2, plugins=[plugin],
                enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    t.fit(MLPModule(scheduler=False), loader(VectorData(n=7)))  # one batch an epoch: saved at each epoch end
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["RoundPipePrecision"]["scale"] == 2.0**10 == plugin.scaler.get_scale()
    assert saved["MixedPrecision"] == saved["RoundPipePrecision"]  # Lightning's own plugin finds it too
    for strategy, args in (("roundpipe", dict(precision="16-mixed")),
                           ("auto", dict(plugins=[MixedPrecision("16-mixed", "cpu")]))):
        spy = ScaleSpy()
        resumed = trainer(strategy, 2 if strategy == "roundpipe" else 1, max_steps=3, callbacks=[spy], **args)
        resumed.fit(MLPModule(scheduler=False), loader(VectorData(n=7)), ckpt_path=tmp_path / "last.ckpt")
        assert spy.at_start == 2.0**10, strategy  # not the default 2**16
        assert resumed.precision_plugin.scaler.get_growth_interval() == 1


def test_16_mixed_manual_optimization_matches_lightning():
    class Manual(MLPModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            opt.zero_grad()
            self.manual_backward(nn.functional.cross_entropy(self.model(x), y))
            opt.step()

    def run(strategy, precision_plugin):
        module = Manual()
        before = flat(module.parameters())
        trainer(strategy, 2 if strategy != "auto" else 1, max_steps=STEPS, plugins=[precision_plugin]).fit(
            module, loader(VectorData(n=7 * STEPS)))
        return before, flat(module.parameters())

    before, ref = run("auto", MixedPrecision("16-mixed", "cpu"))
    _, got = run("roundpipe", RoundPipePrecision("16-mixed"))
    err, bound = relative(got - before, ref - before), 2 * DEPTH * STEPS * unit_roundoff(torch.float16)
    print(f"16-mixed manual optimization vs Lightning: relative error {err:.3e}, bound {bound:.3e}")
    assert err <= bound


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_clipping_a_fused_optimizer(precision):
    """bf16-mixed has no scaler, so a fused AdamW (which unscales inside its step) clips; under 16-mixed its
    gradients are still scaled when clipping runs, and Lightning's check refuses, as with the default strategy."""

    class Fused(MLPModule):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    t = trainer("roundpipe", devices=2, precision=precision, max_steps=1, gradient_clip_val=1e-3)
    if precision == "16-mixed":
        with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
            t.fit(Fused(), loader(VectorData()))
        return
    t.fit(Fused(), loader(VectorData()))  # Lightning's `MixedPrecision` would refuse here even without a scaler
    assert t.global_step == 1


# ---------------------------------------------------------------------------------------- the fused path
HF_LAYERS = 2  # decoder layers of the tiny Llama
# its depth in matmul layers, counted high: the 7 weight matmuls of a decoder layer (q k v o gate up down) + the head
HF_DEPTH = 7 * HF_LAYERS + 1


def _fused_fit(strategy, args: dict, callbacks=()) -> tuple[torch.Tensor, torch.Tensor]:
    module = CausalLMModule(tiny_hf("llama", layers=HF_LAYERS))
    before = flat(module.parameters())
    trainer(strategy, 2 if strategy != "auto" else 1, max_steps=2, callbacks=list(callbacks), **args).fit(
        module, loader(TokenData(n=14)))
    return before, flat(module.parameters())


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_fused_path_matches_default_strategy(precision):
    """The fused tail (HF loss inside the pipeline) under mixed and true precisions; 16-mixed seeds the
    device backward with the loss scale (`loss_seed`) and divides it out on the host."""
    seen = []

    class SeedSpy(Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append((trainer.strategy.engine.loss_seed(), trainer.precision_plugin.loss_seed()))

    before, ref = _fused_fit("auto", precision_args(precision, "auto"))
    _, got = _fused_fit(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), dict(precision=precision), [SeedSpy()])
    u = unit_roundoff(COMPUTE[precision])
    bound = 2 * 2 * HF_DEPTH * u
    if precision == "bf16-true":
        bound = 2 * u * (2 * HF_DEPTH + (ref.norm() / (ref - before).norm()).item())
    err = relative(got - before, ref - before)
    print(f"fused {precision}: relative error {err:.3e} ({err / u:.2f} u), bound {bound:.3e}")
    assert err <= bound
    expected_seed = 2.0**16 if precision == "16-mixed" else 1.0  # the scaler's scale reaches the engine
    assert seen == [(expected_seed, expected_seed)] * 2


def test_fused_path_divides_the_seed_out_exactly():
    """fp32, seed 2**10 instead of 1: gradients are linear in the seed and a power of two scales exactly,
    so the parameters must be bitwise those of the unseeded run (a missing seed or a missing division
    is off by 1024x)."""

    class Seed(Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.strategy.engine.loss_seed = lambda: 2.0**10

    _, plain = _fused_fit(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), {})
    _, seeded = _fused_fit(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), {}, [Seed()])
    assert torch.equal(plain, seeded)


class FirstGrads(Callback):
    """The decoder layers' gradients at the first `on_before_optimizer_step` (after `unscale_`)."""

    def __init__(self) -> None:
        self.grads: torch.Tensor | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads is None:
            self.grads = flat(p.grad for n, p in pl_module.named_parameters() if "layers" in n)


def test_fused_16_mixed_gradients_do_not_underflow():
    """Tied embeddings scaled by 1e-3: the decoder layers' gradients fall to 1e-11..1e-4, under fp16's
    smallest normal (6e-5). Seeded with the loss scale they survive: fp16 bound ``2 * HF_DEPTH * u``
    against fp32; the same run without the seed (control) underflows far past the bound."""

    class Unseeded(Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.strategy.engine.loss_seed = None

    def first_grads(strategy, args: dict, callbacks=()) -> torch.Tensor:
        model = tiny_hf("llama", layers=HF_LAYERS)
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(1e-3)
        spy = FirstGrads()
        trainer(strategy, 2 if strategy != "auto" else 1, max_steps=1, callbacks=[spy, *callbacks], **args).fit(
            CausalLMModule(model), loader(TokenData(n=7)))
        return spy.grads

    ref = first_grads("auto", {})
    bound = 2 * HF_DEPTH * unit_roundoff(torch.float16)
    seeded = relative(first_grads("roundpipe", dict(precision="16-mixed")), ref)
    unseeded = relative(first_grads("roundpipe", dict(precision="16-mixed"), [Unseeded()]), ref)
    print(f"fused 16-mixed gradients vs fp32: seeded {seeded:.3e}, unseeded {unseeded:.3e}, bound {bound:.3e}")
    assert seeded <= bound < unseeded


# ---------------------------------------------------------------------------------------- what is uploaded in half
class ConvTiedNet(nn.Module):
    """An embedding tied to the LM head, a Conv1d and a Linear with biases, a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h + self.proj(self.norm(h)))


def _llama_lora() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_hf("llama", layers=2), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                 lora_dropout=0.0))


def _autocast_run(model: nn.Module, ids: torch.Tensor, tensors: dict, dtype: torch.dtype) -> torch.Tensor:
    """Forward under CPU autocast with ``tensors`` as the parameters, then the backward of a loss."""
    with torch.autocast("cpu", dtype=dtype):
        out = torch.func.functional_call(model, tensors, (ids,))
    out = getattr(out, "logits", out)
    out.float().square().mean().backward()
    return out.detach()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("make", [ConvTiedNet, _llama_lora], ids=["conv_tied", "llama_lora"])
def test_uploaded_copies_compute_bitwise_what_autocast_computes(make, dtype):
    """Oracle: the module under CPU autocast with its fp32 parameters (Lightning's mixed precision).
    Run on the weight store's upload copies under the same autocast, the outputs and every gradient are
    bitwise equal (all parameters uploaded in half, the old rule, changes both); the matmul weights
    (Linear / Conv weights, LoRA A/B, the frozen base linears) are the ones in half, and every other
    parameter but the biases must stay fp32: rounding it alone to ``dtype`` changes the output."""
    torch.manual_seed(0)
    model = make()
    with torch.no_grad():  # no parameter exactly representable in half (norm weights start at 1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, 50, (2, 8))
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}

    def leaves(tensors: dict) -> dict:
        return {n: t.detach().clone().requires_grad_(model.get_parameter(n).requires_grad) for n, t in tensors.items()}

    ref_leaves = leaves(fp32)
    ref = _autocast_run(model, ids, ref_leaves, dtype)
    store = WeightStore([model], compute_dtype=dtype)
    try:
        store.refresh()
        got_leaves = leaves({n: store.tensors[id(p)].shadow for n, p in model.named_parameters()})
    finally:
        store.restore_frozen()
    got = _autocast_run(model, ids, got_leaves, dtype)
    assert torch.equal(got, ref)
    trained = [n for n, t in ref_leaves.items() if t.grad is not None]
    assert trained and all(torch.equal(got_leaves[n].grad.float(), ref_leaves[n].grad) for n in trained)

    half = {n for n, t in got_leaves.items() if t.dtype == dtype}
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matmul = {n for n, p in model.named_parameters() for m in model.modules()
              if isinstance(m, (nn.Linear, nn.Conv1d)) and m.weight is p and id(p) not in tied}
    assert half == matmul and {t.dtype for n, t in got_leaves.items() if n not in half} == {torch.float32}
    for n in fp32.keys() - half:
        if n.endswith("bias"):
            continue  # autocast casts a Linear's / Conv's bias too: fp32 by choice (DESIGN.md section 5)
        rounded = dict(fp32, **{n: fp32[n].to(dtype).float()})
        assert not torch.equal(_autocast_run(model, ids, leaves(rounded), dtype), ref), n


# ---------------------------------------------------------------------------------------- choices and errors
@pytest.mark.parametrize("flag,expected", [(32, "32-true"), ("bf16", "bf16-mixed"), ("64", "64-true")])
def test_aliases(flag, expected):
    assert RoundPipePrecision(flag).precision == expected


def test_unsupported_precision_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"Valid options: \['32-true', '64-true', 'bf16-mixed', '16-mixed'"):
        RoundPipePrecision("transformer-engine")
    with pytest.raises(ValueError, match="scaler"):
        RoundPipePrecision("bf16-mixed", scaler=torch.amp.GradScaler("cpu"))


def test_plugin_and_strategy_argument_routes():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    t = trainer("roundpipe", devices=2, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert t.precision_plugin.precision == "16-mixed" and t.precision_plugin.scaler is scaler
    strategy = lightning_roundpipe.RoundPipeStrategy(precision_plugin=RoundPipePrecision("bf16-true"))
    assert trainer(strategy, devices=2).precision == "bf16-true"
    # reading the default plugin does not make it look like the user's choice to Lightning
    fresh = lightning_roundpipe.RoundPipeStrategy()
    assert fresh.precision_plugin.precision == "32-true"
    assert trainer(fresh, devices=2, precision="bf16-mixed").precision == "bf16-mixed"
