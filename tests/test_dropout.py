"""Random layers under RoundPipe: private per-(layer, microbatch) generators, no process-wide lock.

Oracles: torch's own random ops on the global CPU generator seeded with the same seed (a CPU
``torch.Generator`` and the global one produce the same stream); a plain-torch loop over the
microbatches that seeds the global generator per (layer, microbatch) with the documented seed
(re-derived here from its definition, not imported); the masks a layer drew in the forward; runs on
other device counts; and a ``threading.Barrier`` that only two concurrently running random layers
can pass.
"""

import hashlib
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_roundpipe
from _helpers import CausalLMModule, MLPModule, TokenData, VectorData, fit_params, max_diff, tiny_hf
from lightning_roundpipe.adapters import make_layer_sequence, module_uses_rng
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
from lightning_roundpipe.runtime.execution.microbatch import split_microbatches
from lightning_roundpipe.runtime.replay.rng import rng_scope

CPU = torch.device("cpu")


def oracle_seed(base_seed: int, layer_index: int, microbatch_index: int) -> int:
    """The documented seed of one (layer, microbatch) (DESIGN.md section 5, `runtime/replay/rng.py`)."""
    digest = hashlib.blake2b(f"{base_seed}:{layer_index}:{microbatch_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def base_seed_after(seed: int) -> int:
    """The engine's base seed of its first random call when the global generator was seeded with
    ``seed`` before it: the first draw of the engine's own generator, seeded with one draw of the
    global one (documented in `runtime/replay/rng.py`)."""
    engine_seed = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(seed)).item())
    return int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(engine_seed)).item())


def on_global_generator(fn, seed: int):
    """``fn()`` drawing from the global CPU generator seeded with ``seed`` (state restored after)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


class MaskRecorder(nn.Module):
    """Dropout that records (grad enabled?, mask) of every call, in call order."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p)
        self.calls: list = []

    def forward(self, x):
        out = self.dropout(torch.ones_like(x))
        self.calls.append((torch.is_grad_enabled(), out != 0))
        return x * out


# ---------------------------------------------------------------------- the scope on single ops
X = torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(3))
_BOOL_MASK = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(4)) > 0.3
RANDOM_OPS = {
    "F.dropout": lambda: F.dropout(X, 0.3),
    "F.dropout inplace": lambda: F.dropout(X.clone(), 0.3, inplace=True),
    "F.dropout bf16": lambda: F.dropout(X.bfloat16(), 0.3),
    "F.dropout1d": lambda: F.dropout1d(X[0], 0.5),
    "F.dropout2d": lambda: F.dropout2d(X, 0.5),
    "F.dropout3d": lambda: F.dropout3d(torch.ones(2, 16, 2, 2, 2), 0.5),
    "F.alpha_dropout": lambda: F.alpha_dropout(X, 0.3, training=True),
    "F.feature_alpha_dropout": lambda: F.feature_alpha_dropout(X, 0.3, training=True),
    "torch.dropout": lambda: torch.dropout(X, 0.3, True),
    "nn.Dropout": lambda: nn.Dropout(0.3)(X),
    "sdpa dropout_p": lambda: F.scaled_dot_product_attention(X, X, X, dropout_p=0.3),
    "sdpa dropout_p bool mask": lambda: F.scaled_dot_product_attention(X, X, X, attn_mask=_BOOL_MASK, dropout_p=0.3),
    "sdpa dropout_p causal gqa": lambda: F.scaled_dot_product_attention(X, X[:, :2], X[:, :2], dropout_p=0.3,
                                                                        is_causal=True, enable_gqa=True),
    "torch.rand": lambda: torch.rand(5, 3),
    "torch.rand_like": lambda: torch.rand_like(X),
    "torch.randn": lambda: torch.randn(5, 3),
    "torch.randn_like": lambda: torch.randn_like(X),
    "torch.randint": lambda: torch.randint(0, 1000, (50,)),
    "torch.randint_like": lambda: torch.randint_like(X, 1000),
    "torch.randperm": lambda: torch.randperm(50),
    "torch.normal": lambda: torch.normal(X, 1.0),
    "torch.bernoulli": lambda: torch.bernoulli(torch.full((50,), 0.5)),
    "torch.multinomial": lambda: torch.multinomial(torch.ones(50), 10),
    "Tensor.bernoulli_": lambda: X.clone().bernoulli_(0.5),
    "Tensor.uniform_": lambda: X.clone().uniform_(),
    "Tensor.normal_": lambda: X.clone().normal_(),
    "Tensor.exponential_": lambda: X.clone().exponential_(),
    "Tensor.random_": lambda: X.clone().random_(0, 1000),
    "F.rrelu": lambda: F.rrelu(X, training=True),
    "F.gumbel_softmax": lambda: F.gumbel_softmax(X),
    "F.fractional_max_pool2d": lambda: F.fractional_max_pool2d(X, 2, output_size=5),
    "nn.MultiheadAttention": lambda: _MHA(X[0], X[0], X[0])[0],
    "nn.init.kaiming_uniform_": lambda: nn.init.kaiming_uniform_(torch.empty(16, 16)),
    "torch.ops.aten.rand.default": lambda: torch.ops.aten.rand.default([50]),
    "torch.ops.aten.bernoulli_": lambda: torch.ops.aten.bernoulli_(X.clone(), 0.5),
}
with torch.random.fork_rng(devices=[]):
    torch.manual_seed(0)
    _MHA = nn.MultiheadAttention(16, 2, dropout=0.5)


@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_random_op_draws_from_the_private_generator(name):
    fn = RANDOM_OPS[name]
    before = torch.random.get_rng_state()
    with rng_scope(123, CPU):
        got = fn()
    assert torch.equal(torch.random.get_rng_state(), before), "the global generator was drawn from"
    # the private CPU generator seeded with 123 gives what torch gives on the global one seeded with 123
    want = on_global_generator(fn, 123)
    assert got.dtype == want.dtype
    if name.startswith("sdpa"):  # the math kernel with a mask scales `value` instead of the weights
        assert torch.equal(got == 0, want == 0) and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got, want)
    with rng_scope(124, CPU):
        other = fn()
    assert not torch.equal(got, other)  # the seed matters


def test_dropout_semantics_kept():
    x = torch.randn(64, 32)
    with rng_scope(7, CPU):
        out = F.dropout(x, 0.25)
    kept = out != 0
    assert 0.6 < kept.float().mean() < 0.9
    assert torch.equal(out[kept], x[kept] * torch.tensor(1.0).div(0.75))  # torch's 1/(1-p) scaling, bitwise
    y = x.clone()
    with rng_scope(7, CPU):
        ret = F.dropout(y, 0.25, inplace=True)
    assert ret.data_ptr() == y.data_ptr() and torch.equal(y, out)
    with rng_scope(7, CPU):
        assert torch.equal(F.dropout(x, 0.25, training=False), x)
        assert F.dropout(x.half(), 0.25).dtype == torch.float16


def test_native_dropout_mask_from_the_private_generator():
    """``aten.native_dropout`` (``F.dropout`` on CUDA) has no generator argument: computed with a mask
    drawn from the private generator, torch's semantics otherwise."""
    x = torch.randn(1000)
    before = torch.random.get_rng_state()
    with rng_scope(5, CPU):
        out, mask = torch.native_dropout(x, 0.3, True)
    assert torch.equal(torch.random.get_rng_state(), before)
    want = torch.empty(1000, dtype=torch.uint8).bernoulli_(0.7, generator=torch.Generator().manual_seed(5)).bool()
    assert mask.dtype == torch.bool and torch.equal(mask, want)
    assert torch.equal(out, x * want * (1 / 0.7))
    with rng_scope(5, CPU):
        out, mask = torch.native_dropout(x, 0.3, False)
    assert torch.equal(out, x) and bool(mask.all())


def test_uncovered_random_op_raises_naming_it():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"_scaled_dot_product_flash_attention_for_cpu.*HINT"):
        with rng_scope(1, CPU):
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.1)
    with rng_scope(1, CPU):  # without dropout the fused kernel draws nothing: allowed
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0)


def test_layers_outside_rng_layers_run_without_the_mode():
    from lightning_roundpipe.runtime.replay.rng import _PrivateRandomMode

    active = []

    class Probe(nn.Module):
        def forward(self, x):
            # the RNG scope's mode only (the checking mode has its own, in every op: runtime/backends/op_check.py)
            active.append(any(isinstance(mode, _PrivateRandomMode) for mode in torch.overrides._get_current_function_mode_stack()))
            return x

    model = nn.Sequential(Probe(), nn.Sequential(Probe(), nn.Dropout(0.5)), nn.Linear(8, 4))
    engine = _engine(make_layer_sequence(model), 2, 1)
    try:
        with torch.no_grad():
            model(torch.randn(3, 8))
    finally:
        engine.close()
    assert active == [False, True]


class Noise(nn.Module):
    """Adds `torch.randn_like` noise: random, but nothing `module_uses_rng` can see."""

    def forward(self, x):
        return x + torch.randn_like(x)


def test_undetected_randomness_raises_and_the_opt_in_replays_it():
    x = torch.randn(6, 8)
    model = nn.Sequential(nn.Linear(8, 8), Noise(), nn.Linear(8, 4))
    engine = _engine(make_layer_sequence(model), 2, 2)
    try:
        with pytest.raises(ValueError, match=r"layer 1 drew random numbers from torch's global `cpu`.*roundpipe_uses_rng"):
            model(x).sum().backward()
    finally:
        engine.close()
    model[1].roundpipe_uses_rng = True
    engine = _engine(make_layer_sequence(model), 2, 2)
    try:
        torch.manual_seed(3)
        model(x).sum().backward()
    finally:
        engine.close()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    base = base_seed_after(3)
    outs = []
    for m, rows in enumerate(torch.tensor_split(x, 2)):  # oracle: the noise of the documented generator
        h = model[0](rows)
        outs.append(model[2](h + torch.randn(h.shape, generator=torch.Generator().manual_seed(oracle_seed(base, 1, m)))))
    torch.cat(outs).sum().backward()
    assert max((g - p.grad).abs().max().item() for g, p in zip(got, model.parameters())) <= 1e-6


def test_explicit_global_generator_in_a_random_layer_raises():
    with pytest.raises(ValueError, match=r"layer 4 drew random numbers from torch's global `cpu`.*generator="):
        with rng_scope(1, CPU, layer_index=4):
            torch.rand(3, generator=torch.default_generator)


def test_stacked_rnn_dropout_raises_and_single_layer_passes():
    x = torch.randn(5, 3, 8)
    with pytest.raises(ValueError, match=r"`torch.lstm`.*num_layers=2, dropout=0.2.*HINT"):
        with rng_scope(1, CPU):
            nn.LSTM(8, 8, num_layers=2, dropout=0.2)(x)
    with rng_scope(1, CPU):
        nn.LSTM(8, 8, num_layers=2, dropout=0.2).eval()(x)  # no dropout outside training
        nn.GRU(8, 8, num_layers=1)(x)


def test_scopes_in_threads_are_private():
    """Four threads in scopes with the same seed, at once: each gets the full stream of that seed."""
    barrier = threading.Barrier(4, timeout=30)
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        with rng_scope(77, CPU):
            first = torch.rand(1000)
            barrier.wait()
            results[i] = torch.cat([first, torch.rand(1000)])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    want = torch.rand(2000, generator=torch.Generator().manual_seed(77))
    assert len(results) == 4 and all(torch.equal(r, want) for r in results.values())


def test_module_uses_rng_detects_hf_attention_and_lora_dropout():
    from peft import LoraConfig, get_peft_model

    assert module_uses_rng(tiny_hf("llama", dropout=0.1).model.layers[0])
    assert not module_uses_rng(tiny_hf("llama", dropout=0.0).model.layers[0])
    lora = get_peft_model(tiny_hf("llama"), LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.05))
    layer = lora.base_model.model.model.layers[0]
    assert module_uses_rng(layer)
    assert not module_uses_rng(layer.eval())
    no_dropout = get_peft_model(tiny_hf("llama"), LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0))
    assert not module_uses_rng(no_dropout.base_model.model.model.layers[0])
    assert module_uses_rng(nn.Sequential(nn.Linear(2, 2), nn.RReLU()))


# ---------------------------------------------------------------------- the engine
def _dropout_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.25),
                         nn.Linear(32, 4))


# forward stages of 2 and 4 layers; every backward stage recomputes from a saved boundary
_MLP_PARTITION = PartitionPlan((range(0, 2), range(2, 6)), (range(4, 6), range(2, 4), range(0, 2)))


def _engine(seq, devices: int, num_microbatches: int, partition=None) -> RoundPipeEngine:
    engine = RoundPipeEngine(seq, [CPU] * devices, num_microbatches, partition=partition)
    engine.install()
    return engine


def _mlp_oracle(model: nn.Sequential, x: torch.Tensor, weights: torch.Tensor, base_seed: int, num_microbatches: int,
                microbatch_of=lambda m: m) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Plain torch: per microbatch, each dropout's mask from a generator seeded with the documented seed."""
    outs = []
    for m, h in enumerate(torch.tensor_split(x, num_microbatches)):
        for li, layer in enumerate(model):
            if isinstance(layer, nn.Dropout):
                gen = torch.Generator().manual_seed(oracle_seed(base_seed, li, microbatch_of(m)))
                h = h * torch.empty_like(h).bernoulli_(1 - layer.p, generator=gen).div_(1 - layer.p)
            else:
                h = layer(h)
        outs.append(h)
    out = torch.cat(outs)
    (out * weights).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def test_second_backward_replays_the_forward_masks():
    """Two backwards through one forward (``retain_graph=True``, then another loss of the same output):
    both recomputations replay the forward's masks, so the gradient equals the plain-torch gradient of
    the two losses' sum with the documented masks (another mask in either backward changes it)."""
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))
    w1 = torch.randn(7, 4, generator=torch.Generator().manual_seed(2))
    w2 = torch.randn(7, 4, generator=torch.Generator().manual_seed(3))
    model = _dropout_mlp()
    engine = _engine(make_layer_sequence(model), 2, 3, _MLP_PARTITION)
    try:
        torch.manual_seed(11)
        out = model(x)
        (out * w1).sum().backward(retain_graph=True)
        (out * w2).sum().backward()
    finally:
        engine.close()
    base = base_seed_after(11)
    want_out, want = _mlp_oracle(_dropout_mlp(), x, w1 + w2, base, 3)
    assert (out.detach() - want_out).abs().max().item() <= 1e-6
    assert max((p.grad - w).abs().max().item() for p, w in zip(model.parameters(), want)) <= 1e-6
    _, wrong = _mlp_oracle(_dropout_mlp(), x, w1 + w2, base, 3, microbatch_of=lambda m: (m + 1) % 3)
    assert max((p.grad - w).abs().max().item() for p, w in zip(model.parameters(), wrong)) > 1e-3


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_gradient_equals_plain_torch_with_the_documented_masks(devices):
    """Recomputation replays the forward's masks: RoundPipe's gradient equals the plain-torch
    gradient with the masks of the documented per-(layer, microbatch) generators."""
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(7, 4, generator=torch.Generator().manual_seed(2))
    oracle_model = _dropout_mlp()
    model = _dropout_mlp()
    engine = _engine(make_layer_sequence(model), devices, 3, _MLP_PARTITION)
    try:
        torch.manual_seed(11)
        out = model(x)
        (out * weights).sum().backward()
    finally:
        engine.close()
    got = [p.grad for p in model.parameters()]
    base = base_seed_after(11)
    want_out, want = _mlp_oracle(oracle_model, x, weights, base, 3)
    assert (out.detach() - want_out).abs().max().item() <= 1e-6
    assert max((g - w).abs().max().item() for g, w in zip(got, want)) <= 1e-6
    # the oracle is sensitive to the masks: those of the wrong microbatch give another gradient
    _, wrong = _mlp_oracle(oracle_model, x, weights, base, 3, microbatch_of=lambda m: (m + 1) % 3)
    assert max((g - w).abs().max().item() for g, w in zip(got, wrong)) > 1e-3


def test_global_generator_advances_by_one_base_seed_draw_only():
    """One draw from the global generator in a whole run with random layers (the engine's generator's
    seed, at its first call), none without: later calls draw from the engine's own generator."""
    x = torch.randn(7, 8)
    for model, draws in ((_dropout_mlp(), 1), (nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), 0)):
        engine = _engine(make_layer_sequence(model), 2, 3)
        try:
            torch.manual_seed(5)
            before = torch.random.get_rng_state()
            for _ in range(3):
                model(x).sum().backward()
            after = torch.random.get_rng_state()
        finally:
            engine.close()
        expected = torch.Generator().manual_seed(5)
        for _ in range(draws):
            torch.randint(0, 2**62, (1,), generator=expected)
        assert torch.equal(after, expected.get_state()), f"{draws} draw(s) expected"
        assert torch.equal(before, torch.Generator().manual_seed(5).get_state())


class BarrierDropout(nn.Module):
    """Dropout that, at its ``wait_at``-th forward without grad, waits for a second thread."""

    def __init__(self, barrier: threading.Barrier, wait_at: int) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.barrier, self.wait_at = barrier, wait_at
        self.calls: list[int] = []  # shared by the per-device replicas

    def forward(self, x):
        if not torch.is_grad_enabled():
            if len(self.calls) == self.wait_at:
                self.barrier.wait()
            self.calls.append(1)
        return self.dropout(x)


def test_two_devices_run_random_layers_at_the_same_time():
    """Device 0 runs layer 0 on microbatch 1 while device 1 runs layer 1 on microbatch 0: both wait
    on one barrier, which breaks (after 120 s: a deadlock breaker, never reached when both arrive, even on a
    loaded machine) if random layers are serialised."""
    barrier = threading.Barrier(2, timeout=120)
    model = nn.Sequential(BarrierDropout(barrier, wait_at=1), BarrierDropout(barrier, wait_at=0), nn.Linear(8, 4))
    partition = PartitionPlan((range(0, 1), range(1, 3)), (range(2, 3), range(1, 2), range(0, 1)))
    engine = _engine(make_layer_sequence(model), 2, 2, partition)
    try:
        model(torch.randn(4, 8)).sum().backward()
    finally:
        engine.close()
    assert not barrier.broken and len(model[0].calls) == 2 and len(model[1].calls) == 2


def _hf_oracle_grads(model: nn.Module, batch: dict, base_seed: int, num_microbatches: int) -> dict:
    """Plain torch over the model's layers, microbatch by microbatch, with the global generator
    seeded per (layer, microbatch) with the documented seed before every layer."""
    seq = make_layer_sequence(model)
    microbatches, _ = split_microbatches(seq.prepare((), dict(batch)), num_microbatches)
    total = 0.0
    for m, carry in enumerate(microbatches):
        for li, layer in enumerate(seq.layers):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(oracle_seed(base_seed, li, m))
                carry = layer(carry)
        total = total + carry[seq.loss_key]
    total.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _lora_llama(lora_dropout: float) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_hf("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       lora_dropout=lora_dropout, init_lora_weights="gaussian"))


def _sdpa_llama(dropout: float) -> nn.Module:
    model = tiny_hf("llama", dropout=dropout)
    model.config._attn_implementation = "sdpa"
    return model


HF_RANDOM = {"attention_dropout": lambda: tiny_hf("llama", dropout=0.1), "sdpa_dropout": lambda: _sdpa_llama(0.1),
             "lora_dropout": lambda: _lora_llama(0.1)}


@pytest.mark.parametrize("kind", sorted(HF_RANDOM))
def test_hf_gradient_equals_seeded_plain_torch(kind):
    """HF attention dropout (eager `F.dropout`; SDPA's `dropout_p`) and PEFT's `lora_dropout`, fused
    path, 2 devices. SDPA: torch's kernel scales the weights, the masked kernel `value` (1e-5)."""
    make = HF_RANDOM[kind]
    data = TokenData(n=6)
    batch = {k: torch.stack([data[i][k] for i in range(6)]) for k in ("input_ids", "attention_mask", "labels")}
    model = make().train()
    engine = _engine(make_layer_sequence(model), 2, 3)
    try:
        torch.manual_seed(21)
        model(**batch).loss.backward()
    finally:
        engine.close()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want = _hf_oracle_grads(make().train(), batch, base_seed_after(21), 3)
    assert got.keys() == want.keys() and got
    assert max((got[n] - want[n]).abs().max().item() for n in got) <= (1e-5 if kind == "sdpa_dropout" else 1e-6)
    wrong = _hf_oracle_grads(make().train(), batch, base_seed_after(22), 3)  # other masks: the oracle can fail
    assert max((got[n] - wrong[n]).abs().max().item() for n in got) > 1e-4


# ---------------------------------------------------------------------- through Lightning
@pytest.mark.parametrize("devices", [1, 2, 3])
def test_recompute_replays_forward_masks(devices):
    _check_mask_replay(devices)


def _check_mask_replay(devices: int, **trainer_kw) -> None:
    recorders = []

    class Module(MLPModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = nn.Sequential(nn.Linear(8, 16), MaskRecorder(), nn.Linear(16, 4), MaskRecorder(0.3))
            recorders.extend([self.model[1], self.model[3]])

    strategy = lightning_roundpipe.RoundPipeStrategy(
        num_microbatches=4, forward_stages=[(0, 4)], backward_stages=[(3, 4), (2, 3), (1, 2), (0, 1)])
    fit_params(Module, VectorData(), strategy=strategy, devices=devices, max_steps=2, **trainer_kw)
    for rec in recorders:
        # per step: 4 forwards (no grad), then the 4 recomputations (grad) of the same microbatches
        assert [g for g, _ in rec.calls] == ([False] * 4 + [True] * 4) * 2
        for step in range(2):
            calls = rec.calls[step * 8:(step + 1) * 8]
            for mb in range(4):
                assert torch.equal(calls[mb][1], calls[4 + mb][1])
            assert not torch.equal(calls[0][1][:1], calls[1][1][:1])  # masks differ between microbatches


def test_dropout_run_independent_of_device_count():
    results = [fit_params(lambda: MLPModule(dropout=0.3), VectorData(),
                          strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), devices=d, max_steps=3)
               for d in (1, 2, 3)]
    assert max_diff(results[0], results[1]) == 0.0
    assert max_diff(results[0], results[2]) == 0.0
    no_dropout = fit_params(lambda: MLPModule(dropout=0.0), VectorData(),
                            strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), devices=2, max_steps=3)
    diffs = [(a - b).abs().max().item() for a, b in zip(results[0].values(), no_dropout.values())]
    assert max(diffs) > 1e-4  # dropout was active


@pytest.mark.parametrize("kind", ["attention_dropout", "lora_dropout"])
def test_hf_dropout_run_independent_of_device_count(kind):
    def make(p: float):
        model = tiny_hf("llama", dropout=p) if kind == "attention_dropout" else _lora_llama(p)
        return lambda: CausalLMModule(model, lr=0.5)

    def fit(p: float, devices: int):
        return fit_params(make(p), TokenData(), strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3),
                          devices=devices, max_steps=2)

    results = [fit(0.1, d) for d in (1, 2, 3)]
    assert max_diff(results[0], results[1]) <= 1e-6
    assert max_diff(results[0], results[2]) <= 1e-6
    assert max_diff(results[0], fit(0.0, 2)) > 1e-4  # dropout was active


# ---------------------------------------------------------------------- CUDA (skipped without a GPU)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_recompute_replays_forward_masks():
    """On CUDA `F.dropout` would be the fused `native_dropout` on the device's default generator."""
    _check_mask_replay(1, accelerator="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_cuda_attention_dropout_private_and_deterministic(attention):
    """Eager attention (`F.dropout`) and SDPA (fused kernel on the private generator's state): the
    device's default generator is untouched, two runs agree, and dropout was active."""

    def make(p: float):
        def module():
            model = tiny_hf("llama", dropout=p)
            model.config._attn_implementation = attention
            return CausalLMModule(model, lr=0.5)
        return module

    def fit(p: float):
        return fit_params(make(p), TokenData(), strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3),
                          accelerator="cuda", devices=1, max_steps=2)

    torch.cuda.init()
    state = torch.cuda.get_rng_state()
    first, second = fit(0.1), fit(0.1)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    assert max_diff(first, second) <= 1e-5  # fused attention backward may reduce in any order
    assert max_diff(first, fit(0.0)) > 1e-4
