"""A second backward through one pipelined forward (``retain_graph=True``), as under the default strategy.

Manual optimization with several losses or optimizers backpropagates twice through one forward; the
first backward keeps the graph. The oracle is the default Lightning strategy on the same model, seed
and data in fp32: the gradients after every backward and the parameters after the fit. The
transparent path (an MLP: the backward program runs again from the kept stage inputs) and the fused
path (a Hugging Face causal LM with ``labels``: the gradient buffers are added again) are both run.
Random layers (the recomputation replays the forward's masks in both backwards) are checked in
``test_dropout.py``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

import lightning_roundpipe
from _helpers import TokenData, VectorData, loader, max_diff, params, tiny_hf, tiny_mlp, trainer
from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine

TOL = 1e-6


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in module.named_parameters()}


def _fit(make, strategy, steps: int = 2, **kw) -> tuple[dict, list[dict]]:
    module = make()
    t = trainer(strategy, 2 if strategy != "auto" else 1, max_steps=steps, **kw)
    t.fit(module, loader(TokenData(n=28) if module.hf else VectorData(n=28), 7))
    return params(module), module.seen


class TwoLosses(L.LightningModule):
    """Manual optimization: two losses of the same outputs, ``manual_backward(loss1, retain_graph=True)``
    then ``manual_backward(loss2)``; records ``.grad`` after each backward."""

    def __init__(self, hf: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.hf = hf
        self.model = tiny_hf(layers=3) if hf else tiny_mlp(0)
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        if self.hf:  # the fused path: the model returns the loss only
            loss1 = self.model(**batch).loss
            loss2 = (loss1 - 5.0) ** 2
        else:
            x, y = batch
            out = self.model(x)
            loss1 = nn.functional.cross_entropy(out, y)
            loss2 = (out ** 2).mean()
        self.manual_backward(loss1, retain_graph=True)
        self.seen.append(_grads(self))
        self.manual_backward(loss2)
        self.seen.append(_grads(self))
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("hf", [False, True], ids=["transparent", "fused"])
def test_two_losses_retain_graph_equal_default(hf):
    want, want_seen = _fit(lambda: TwoLosses(hf), "auto")
    got, got_seen = _fit(lambda: TwoLosses(hf), lightning_roundpipe.RoundPipeStrategy(num_microbatches=3))
    assert len(got_seen) == len(want_seen) == 4
    for g, w in zip(got_seen, want_seen):
        assert max_diff(g, w) <= TOL
    # the second backward adds to the first (the oracle can fail: it differs from the first alone)
    assert max_diff(want_seen[0], want_seen[1]) > 1e-3
    assert max_diff(got, want) <= TOL


class GAN(L.LightningModule):
    """Two optimizers on one forward of the pipelined generator: the discriminator's loss backward
    keeps the graph, the generator's loss backward goes through it again."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.hf = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.seen: list[dict] = []

    def training_step(self, batch, batch_idx):
        noise, _ = batch
        real = noise[:, :4].sin()
        opt_g, opt_d = self.optimizers()
        fake = self.generator(noise)
        ones, zeros = torch.ones(len(noise), 1), torch.zeros(len(noise), 1)
        bce = nn.functional.binary_cross_entropy_with_logits
        d_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss, retain_graph=True)  # reaches the generator too
        self.seen.append(_grads(self))
        opt_d.step()
        g_loss = bce(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self.seen.append(_grads(self))
        opt_g.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.generator.parameters(), lr=0.1),
                torch.optim.SGD(self.discriminator.parameters(), lr=0.1))


def test_gan_two_optimizers_on_one_forward_equal_default():
    # two optimizer steps a batch: `max_steps=4` is two batches
    want, want_seen = _fit(GAN, "auto", steps=4)
    got, got_seen = _fit(GAN, lightning_roundpipe.RoundPipeStrategy(module="generator", num_microbatches=3), steps=4)
    assert len(got_seen) == len(want_seen) == 4
    for g, w in zip(got_seen, want_seen):
        assert max_diff(g, w) <= TOL
    assert max_diff(got, want) <= TOL


def _host_staging(engine: RoundPipeEngine) -> int:
    return engine.executor.pool_allocations()["host staging"]


def test_kept_inputs_released_by_the_last_backward():
    """The stage inputs kept for a second backward are released by the last backward (the one
    without ``retain_graph``), not by the graph's end: with every step's graph still alive, the next
    steps' forwards reuse the host staging blocks of the saved inputs and allocate none (a saved input
    still referenced makes the pool allocate another block)."""
    model = tiny_mlp(0)
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * 2, num_microbatches=3)
    engine.install()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    graphs, allocations = [], []
    try:
        for _ in range(3):
            out = model(x)
            loss1, loss2 = out.sum(), (out ** 2).mean()
            loss1.backward(retain_graph=True)
            loss2.backward()
            model.zero_grad(set_to_none=True)  # the gradient blocks are free again too
            graphs.append((out, loss1, loss2))
            allocations.append(_host_staging(engine))
    finally:
        engine.close()
    assert allocations[0] > 0 and allocations == [allocations[0]] * 3


class HostStaging(L.Callback):
    """The host staging allocations of the engine's pools after every training batch."""

    def __init__(self) -> None:
        self.allocations: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.allocations.append(_host_staging(trainer.strategy.engine))


class RetainOnly(TwoLosses):
    """Only ``manual_backward(loss, retain_graph=True)``: the graph is released when the step's
    locals go (no backward frees it)."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        self.manual_backward(nn.functional.cross_entropy(self.model(x), y), retain_graph=True)
        opt.step()


def test_kept_inputs_released_with_the_graph():
    """A graph whose last backward kept it releases its saved inputs when it goes (at once: no
    reference cycle waits for the garbage collector), so the next steps allocate no host staging."""
    counter = HostStaging()
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default")  # no re-cut: the same blocks
    _fit(lambda: RetainOnly(False), strategy, steps=4, callbacks=[counter])
    assert counter.allocations[0] > 0 and counter.allocations == [counter.allocations[0]] * 4


# ---------------------------------------------------------------------- overlapped batches
class BackwardTwice(L.LightningModule):
    """Automatic optimization whose ``backward`` hook goes twice through the graph (``retain_graph=True``
    first), or once keeping it (``twice=False``): the only way to retain a graph where the strategy
    overlaps a batch's drain with the next batch (manual optimization never overlaps)."""

    def __init__(self, twice: bool = True, retain: bool = True) -> None:
        super().__init__()
        self.hf, self.twice, self.retain = True, twice, retain
        self.model = tiny_hf(layers=3)
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def backward(self, loss, *args, **kwargs):
        loss.backward(retain_graph=self.retain)
        if self.twice:
            (2.0 * loss).backward()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_retain_graph_on_overlapped_accumulated_batches_equal_default():
    """``accumulate_grad_batches=2``: a batch that does not step the optimizer drains while the next
    runs; a retained graph on it finishes its run at the backward and adds its buffers once per backward."""
    want, _ = _fit(BackwardTwice, "auto", steps=1, accumulate_grad_batches=2)
    got, _ = _fit(BackwardTwice, lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), steps=1, accumulate_grad_batches=2)
    assert max_diff(got, want) <= TOL


def test_async_steady_state_one_retained_backward_and_a_second_refused():
    """``optimizer="async"`` (every batch overlaps the next): one backward keeping the graph trains as one
    without it (the oracle: the same strategy); a second backward through that batch raises at once,
    naming `retain_graph` (its gradients were handed to the optimizer thread at the first)."""
    async_ = lambda: lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, optimizer="async")  # noqa: E731
    want, _ = _fit(lambda: BackwardTwice(twice=False, retain=False), async_(), steps=3)
    got, _ = _fit(lambda: BackwardTwice(twice=False), async_(), steps=3)
    assert max_diff(got, want) == 0.0
    with pytest.raises(ValueError, match=r"second backward \(`retain_graph=True` before\).*optimizer='async'.*HINT"):
        _fit(BackwardTwice, async_(), steps=3)


# ---------------------------------------------------------------------- after the graph was freed
def _backward_twice(model: nn.Module, loss_of) -> RuntimeError:
    loss = loss_of(model)
    loss.backward(retain_graph=True)
    loss.backward()
    with pytest.raises(RuntimeError) as raised:
        loss.backward()
    return raised.value


@pytest.mark.parametrize("hf", [False, True], ids=["transparent", "fused"])
def test_backward_after_the_graph_was_freed_raises_torchs_error(hf):
    """A third backward after a backward without ``retain_graph`` raises what torch raises without
    the pipeline ("Trying to backward through the graph a second time ..."); the gradients of the
    two allowed backwards equal torch's."""
    if hf:
        data = TokenData(n=5)
        batch = {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}

        def loss_of(model):
            return model(**batch).loss * 3.0
        make = lambda: tiny_hf(layers=3)  # noqa: E731
    else:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))

        def loss_of(model):
            return model(x).sum()  # a sum saves no tensor: only the pipeline's node can tell
        make = lambda: tiny_mlp(0)  # noqa: E731
    reference = make()
    want = _backward_twice(reference, loss_of)
    model = make()
    engine = RoundPipeEngine(make_layer_sequence(model), [torch.device("cpu")] * 2, num_microbatches=3)
    engine.install()
    try:
        got = _backward_twice(model, loss_of)
    finally:
        engine.close()
    assert str(want).startswith("Trying to backward through the graph a second time")
    assert str(got) == str(want)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= TOL, name
