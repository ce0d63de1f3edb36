"""Hugging Face calls and silent changes to the user's model (issue 20, item 2 of "What to build").

Every call the default strategy accepts either trains to its parameters under RoundPipe or is
refused naming what cannot be pipelined; a compiled model is refused with a HINT; what RoundPipe
does to the user's model is undone after fit (HF gradient checkpointing) or said once at run time
(the frozen base's rounding, attributes a layer sets on its replica), and 64-true is exact on the
fused path too. Oracles: the default strategy, plain Hugging Face / torch.
"""

from __future__ import annotations

import copy
import functools
import warnings

import lightning as L
import pytest
import torch
from torch import nn

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, VectorData, fit_params, loader, max_diff, params, tiny_hf, trainer

ROUNDING = "frozen matmul weights"
DIVERGED = "differ between your layers"


def _strategy(**kw) -> lightning_roundpipe.RoundPipeStrategy:
    return lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default", **kw)


def _messages(record) -> list[str]:
    return [str(w.message) for w in record]


class CallStyle(CausalLMModule):
    """``training_step`` calls the model as a Hugging Face user may."""

    def __init__(self, model: nn.Module, style: str) -> None:
        super().__init__(model)
        self.style = style

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if self.style == "return_dict=False":
            return self.model(**batch, return_dict=False)[0]
        if self.style == "positional":
            return self.model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"]).loss
        if self.style == "extra key":
            return self.model(**batch, idx=torch.arange(len(batch["input_ids"]))).loss
        if self.style == "output_hidden_states":
            return self.model(**batch, output_hidden_states=True).loss
        if self.style == "shift_labels":
            shifted = nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:].contiguous()
            return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              labels=batch["labels"], shift_labels=shifted).loss
        raise ValueError(self.style)


@functools.cache
def _default_fit(style: str, precision: str = "32-true") -> dict[str, torch.Tensor]:
    """The oracle: parameters after 2 steps under the default strategy (shared by the tests' variants)."""
    return fit_params(lambda: CallStyle(tiny_hf(), style), TokenData(), max_steps=2, precision=precision)


@pytest.mark.parametrize("style,fused", [("return_dict=False", True), ("return_dict=False", False), ("positional", True)])
def test_hf_call_styles_train_as_under_the_default_strategy(style, fused):
    """`self.model(**batch, return_dict=False)[0]` and positional arguments (what HF's forward names
    them) are pipelined: the parameters after fit are the default strategy's; nothing is announced."""
    ref = _default_fit(style)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = fit_params(lambda: CallStyle(tiny_hf(), style), TokenData(), _strategy(fused_loss=fused), devices=2,
                         max_steps=2)
    assert max_diff(ref, got) <= 1e-5
    assert not [m for m in _messages(record) if ROUNDING in m or DIVERGED in m]


@pytest.mark.parametrize("fused", [True, False])
def test_return_dict_false_returns_hf_tuple(fused):
    """The tuple is HF's `to_tuple()` of the pipelined output: `(loss, logits)` (HF's own tuple adds
    its cache after them), `(loss,)` on the fused path, `(logits,)` without labels."""
    from lightning_roundpipe.adapters import make_layer_sequence
    from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine

    model = tiny_hf()
    ref = copy.deepcopy(model)
    data = TokenData(n=5)
    batch = {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * 2, num_microbatches=3, fused_loss=fused)
    engine.install()
    try:
        got, expected = model(**batch, return_dict=False), ref(**batch, return_dict=False)
        assert type(got) is tuple and len(got) == (1 if fused else 2)
        for a, b in zip(got, expected):
            assert torch.allclose(a, b, atol=1e-5)
        got[0].backward()
        expected[0].backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), name
        with torch.no_grad():
            got, expected = model(data.ids, return_dict=False), ref(data.ids, return_dict=False)
        assert type(got) is tuple and len(got) == 1 and torch.allclose(got[0], expected[0], atol=1e-5)
    finally:
        engine.close()


@pytest.mark.parametrize("style,named", [
    ("extra key", r"`idx`: extra keys, not arguments of `LlamaForCausalLM.forward`.*HINT: call the model with its"
                  r" arguments only"),
    ("output_hidden_states", r"cannot run `output_hidden_states=True` with gradients.*HINT"),
    ("shift_labels", r"cannot run `shift_labels=<tensor \(7, 8\) int64>` with gradients.*HINT"),
])
def test_calls_that_cannot_be_pipelined_are_refused_naming_the_argument(style, named):
    """The default strategy trains with these calls (its parameters change); RoundPipe refuses them
    before any step, naming the argument it cannot run (an extra batch key as such), and never the
    arguments it does run."""
    before = params(CallStyle(tiny_hf(), style))
    ref = fit_params(lambda: CallStyle(tiny_hf(), style), TokenData(), max_steps=1)
    assert max_diff(before, ref) > 0
    module = CallStyle(tiny_hf(), style)
    with pytest.raises(ValueError, match=named) as error:
        trainer(_strategy(), devices=2, max_steps=1).fit(module, loader(TokenData()))
    for supported in ("input_ids", "attention_mask", "`labels"):
        assert supported not in str(error.value).split(" Pipelined are ")[0]
    assert max_diff(before, params(module)) == 0


class CompiledLM(CausalLMModule):
    """The model compiled as a user may: wrapped (`torch.compile(model)`), in place (`model.compile()`),
    or layer by layer."""

    def __init__(self, how: str) -> None:
        model = tiny_hf(layers=2)
        if how == "wrapped":
            model = torch.compile(model, backend="eager")
        elif how == "in place":
            model.compile(backend="eager")
        else:
            for layer in model.model.layers:
                layer.compile(backend="eager")
        super().__init__(model)


def test_compiled_model_trains_under_the_default_strategy():
    """The oracle of the refusal below: the default strategy trains a model compiled in place."""
    module = CompiledLM("in place")
    before = params(module)
    trainer(max_steps=1).fit(module, loader(TokenData()))
    assert max_diff(before, params(module)) > 0


@pytest.mark.parametrize("how,named", [("wrapped", "`model`"), ("in place", "`model`"),
                                       ("layer by layer", "`model.model.layers.0`, `model.model.layers.1`")])
def test_compiled_model_is_refused_with_a_hint(how, named):
    """A clear error at setup (not dynamo's internal one), naming the compiled modules, with the HINT."""
    module = CompiledLM(how)
    with pytest.raises(ValueError, match=rf"cannot pipeline a compiled model: {named} (is|are) compiled.*HINT: pass"
                                         r" the model uncompiled"):
        trainer(_strategy(), devices=2, max_steps=1).fit(module, loader(TokenData()))


def _lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights="gaussian"))


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_frozen_base_rounding_is_announced_once_and_the_hint_keeps_the_original(precision):
    """bf16-mixed: one warning, with the count of frozen matmul weights (a formula: the frozen
    `nn.Linear` weights of the decoder layers; the tied LM head is the embedding) and the HINT's
    recipe, which gives back the original base bitwise (oracle: its copy before fit; without the
    recipe it is bf16-rounded). 32-true rounds nothing and says nothing."""
    module = CausalLMModule(_lora(tiny_hf()), lr=1e-2)
    before = params(module)
    embedding = module.model.get_input_embeddings().weight
    frozen_linear = [m.weight for m in module.model.modules()
                     if isinstance(m, nn.Linear) and not m.weight.requires_grad and m.weight is not embedding]
    # the HINT's recipe, verbatim
    model = module.model
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(_strategy(), devices=2, max_steps=3, precision=precision).fit(module, loader(TokenData()))
    notes = [m for m in _messages(record) if ROUNDING in m]
    after = params(module)
    base_linear = [n for n in after if n.endswith("base_layer.weight") or (n.endswith("proj.weight") and "lora_" not in n)]
    if precision == "32-true":
        assert notes == []
        assert all(torch.equal(after[n], before[n]) for n in after if "lora_" not in n)
        return
    numel = sum(w.numel() for w in frozen_linear)
    assert len(frozen_linear) == 7 * 5 and len(notes) == 1
    assert f"holds {len(frozen_linear)} frozen matmul weights ({numel / 1e6:.2f}M parameters" in notes[0]
    assert "in bfloat16 while it runs" in notes[0] and "bfloat16-rounded values" in notes[0]
    assert "model.load_state_dict(frozen, strict=False)" in notes[0]
    assert all(torch.equal(after[n], before[n].bfloat16().float()) for n in base_linear)
    assert any(not torch.equal(after[n], before[n]) for n in base_linear)
    model.load_state_dict(frozen, strict=False)
    restored = params(module)
    assert all(torch.equal(restored[n], before[n]) for n in restored if "lora_" not in n)
    assert all(torch.equal(restored[n], after[n]) for n in restored if "lora_" in n)  # the adapters kept


def _forward_calls_in_a_step(model: nn.Module) -> int:
    """How often the first decoder layer's attention runs in one forward + backward of `model`: 2 with
    HF gradient checkpointing (the recomputation), 1 without."""
    calls = []
    handle = model.get_decoder().layers[0].self_attn.register_forward_hook(lambda *args: calls.append(1))
    data = TokenData(n=2)
    model.train()
    model(input_ids=data.ids, labels=data.labels).loss.backward()
    handle.remove()
    return len(calls)


def _input_grad_hook_on(model: nn.Module) -> bool:
    handle = getattr(model, "_require_grads_hook", None)
    return handle is not None and handle.id in model.get_input_embeddings()._forward_hooks


@pytest.mark.parametrize("lora", [False, True])
def test_hf_gradient_checkpointing_is_back_on_after_fit(lora):
    """Turned off for the pipeline (with a warning), on again after fit exactly as before: every
    module's flag and checkpoint function, HF's input-gradient hook, and the recomputation it does.
    Oracle: the same model fitted by the default strategy."""

    def make() -> CausalLMModule:
        model = tiny_hf()
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return CausalLMModule(_lora(model) if lora else model)

    def state(model: nn.Module) -> list:
        return [(name, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"))
                for name, m in model.named_modules() if hasattr(m, "gradient_checkpointing")]

    oracle = make()
    trainer(max_steps=1).fit(oracle, loader(TokenData()))
    module = make()
    before = state(module.model)
    assert module.model.is_activation_checkpointing and _input_grad_hook_on(module.model)
    with pytest.warns(UserWarning, match="turned off Hugging Face gradient checkpointing.*turned back on"):
        trainer(_strategy(), devices=2, max_steps=1).fit(module, loader(TokenData()))
    assert state(module.model) == before
    assert module.model.is_activation_checkpointing == oracle.model.is_activation_checkpointing is True
    assert _input_grad_hook_on(module.model) and _input_grad_hook_on(oracle.model)
    assert _forward_calls_in_a_step(module.model) == _forward_calls_in_a_step(oracle.model) == 2


class Recorder(nn.Module):
    """Keeps the rows of the last batch it saw on itself, as user layers sometimes do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows_seen = x.shape[0]
        return x


class RecorderModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Recorder(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_attributes_a_layer_sets_in_forward_are_announced_once():
    """The default strategy's layer ends with the batch's rows (7); under RoundPipe the forward runs on
    each device's replica per microbatch, so the layer never gets it: one warning names the attribute
    (after the first step, not again at teardown), and the parameters still match the default's."""
    ref_module = RecorderModule()
    trainer(max_steps=3).fit(ref_module, loader(VectorData()))
    assert ref_module.model[2].rows_seen == 7
    module = RecorderModule()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(_strategy(), devices=2, max_steps=3).fit(module, loader(VectorData()))
    notes = [m for m in _messages(record) if DIVERGED in m]
    assert len(notes) == 1
    assert "the attribute(s) `model.2.rows_seen` differ" in notes[0] and "HINT: return such values from forward" in notes[0]
    assert not hasattr(module.model[2], "rows_seen")  # not copied back (no copy gives the default's 7)
    assert max_diff(params(ref_module), params(module)) <= 1e-5


class Scaled(nn.Module):
    """Multiplies by a plain attribute (and adds an optional one): configuration a callback may change."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        self.shift = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + getattr(self, "shift", 0.0)


class ScaledModule(RecorderModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Scaled(), nn.Linear(16, 4))


class ChangeAttributes(L.Callback):
    """Step 1: replace `scale`; step 2: delete `shift`; step 3: set it again (plain attributes set during fit)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        layer = pl_module.model[2]
        if batch_idx == 1:
            layer.scale = 3.0
        elif batch_idx == 2:
            del layer.shift
        elif batch_idx == 3:
            layer.shift = -1.0


def test_attributes_set_on_layers_during_fit_reach_the_replicas():
    """Plain attributes a callback replaces, deletes and sets again on a layer between steps are seen by
    the next step's pipelined forward: the parameters equal the default strategy's, and no warning names them."""
    ref_module = ScaledModule()
    trainer(max_steps=4, callbacks=[ChangeAttributes()]).fit(ref_module, loader(VectorData()))
    module = ScaledModule()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(_strategy(), devices=2, max_steps=4, callbacks=[ChangeAttributes()]).fit(module, loader(VectorData()))
    assert not [m for m in _messages(record) if DIVERGED in m]
    assert (module.model[2].scale, module.model[2].shift) == (3.0, -1.0)
    assert max_diff(params(ref_module), params(module)) <= 1e-6


def test_64_true_chunked_loss_is_hf_exact():
    """fp64 logits: the chunked loss (several chunks, recomputed) gives transformers' `ForCausalLMLoss`
    gradients to fp64 rounding (it was fp32-accurate: relative error about 1e-7)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lightning_roundpipe.adapters.chunked_loss import chunked_causal_lm_loss

    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False).double()
    hidden = torch.randn(3, 9, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 9))
    labels[0, 5:] = -100
    num_items = (labels[..., 1:] != -100).sum()
    got = chunked_causal_lm_loss(hidden, head, labels, num_items, chunk_tokens=4)
    got_grads = torch.autograd.grad(got, [hidden, head.weight])
    expected = ForCausalLMLoss(head(hidden), labels, 50, num_items_in_batch=num_items)
    expected_grads = torch.autograd.grad(expected, [hidden, head.weight])
    assert got.dtype == expected.dtype == torch.float32
    assert torch.allclose(got, expected, rtol=1e-6)
    for a, b in zip(got_grads, expected_grads):
        assert ((a - b).norm() / b.norm()).item() <= 1e-14


@pytest.mark.parametrize("fused", [True, False])
def test_64_true_fused_path_is_exact(fused):
    """64-true parameters after fit equal the default strategy's to fp64 rounding on the fused path as
    with `fused_loss=False` (the fused path was off by about 3e-9)."""
    ref = _default_fit("positional", "64-true")
    got = fit_params(lambda: CallStyle(tiny_hf(), "positional"), TokenData(), _strategy(fused_loss=fused), devices=2,
                     max_steps=2, precision="64-true")
    assert all(p.dtype == torch.float64 for p in got.values())
    assert max_diff(ref, got) <= 1e-13
