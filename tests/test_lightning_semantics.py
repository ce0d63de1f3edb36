"""Lightning's semantics under `RoundPipeStrategy`, with the default strategy as the oracle.

The smallest reproducers of the differences Lightning's own tests found (issue 20): hook order and
the checkpoint dicts the hooks see, copying and pickling a module during fit, cluster environments
and a settable `world_size`, `Strategy.backward` patched with `wraps=`, batch normalisation in train
mode, files nobody asked for, and RoundPipe's metrics kept out of the user's metric dictionaries.
"""

from __future__ import annotations

import copy
import csv
import os
import pickle
import warnings
from functools import partial, update_wrapper
from inspect import getmembers, isfunction
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import Strategy
from torch import nn

import lightning_roundpipe
from _helpers import MLPModule, VectorData, loader, max_diff, params, trainer
from lightning_roundpipe.runtime.execution.installed import InstalledMethod

TOL = 1e-6


def _roundpipe(**kw) -> lightning_roundpipe.RoundPipeStrategy:
    kw.setdefault("partition", "default")
    return lightning_roundpipe.RoundPipeStrategy(**kw)


def _make_trainer(strategy: str, **kw) -> L.Trainer:
    """The default strategy on 1 CPU device, or RoundPipe on 2 CPU virtual devices."""
    if strategy == "roundpipe":
        return trainer(kw.pop("roundpipe", None) or _roundpipe(), devices=2, **kw)
    kw.pop("roundpipe", None)
    return trainer("auto", devices=1, **kw)


class _SequentialBoring(BoringModel):
    """Lightning's demo model with its layer as an `nn.Sequential` (what RoundPipe pipelines)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(32, 2))


# ---------------------------------------------------------------------------------------- hook order
def _hooks(cls: type) -> set[str]:
    return {h for h, _ in getmembers(cls, predicate=isfunction) if not h.startswith("_")}


def _describe(value) -> str:
    """A call argument, comparable across strategies: tensors by kind, dicts by their keys."""
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if isinstance(value, dict):
        return "{" + ",".join(sorted(map(str, value))) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(_describe, value)) + "]"
    if isinstance(value, (int, float, str, bool, type(None), torch.device)):
        return repr(value)
    return type(value).__name__


def _wrap(obj, names, called: list, prefix: str) -> None:
    """Record every call of ``obj.<name>`` as (hook, args, kwargs), keeping the arguments themselves
    (as Lightning's test_hooks.py does), so a dict changed after the hook ran shows."""

    def call(hook, fn, *args, **kwargs):
        out = fn(*args, **kwargs)
        called.append((prefix + hook, args, kwargs))
        return out

    for name in names:
        attr = getattr(obj, name)
        wrapped = partial(call, name, attr)
        update_wrapper(wrapped, attr)
        setattr(obj, name, wrapped)


class _HookedCallback(Callback):
    def __init__(self, called: list) -> None:
        _wrap(self, _hooks(Callback), called, "Callback.")

    def state_dict(self):
        return {"foo": True}


class _HookedModel(_SequentialBoring):
    def __init__(self, called: list, automatic: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = automatic
        self._called = called
        names = _hooks(LightningModule) - {"optimizers", "log", "log_dict"} - (_hooks(nn.Module) - {"forward", "zero_grad", "train"})
        _wrap(self, names, called, "")

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        loss = self.step(batch)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step(lambda: self._called.append(("closure", (), {})))
        return {"loss": loss}


def _recorded_fit(strategy: str, folder, *, validation: bool, automatic: bool = True, resume: bool = False) -> list[str]:
    common = dict(limit_train_batches=2, limit_val_batches=2 if validation else 0, enable_checkpointing=True,
                  num_sanity_val_steps=2 if validation else 0)
    ckpt_path = None
    if resume:  # one step saved by a first fit, then two more
        _make_trainer(strategy, max_steps=1, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)], **common).fit(
            _SequentialBoring())
        ckpt_path = os.path.join(folder, "last.ckpt")
    called: list = []
    t = _make_trainer(strategy, max_steps=3 if resume else 2, callbacks=[_HookedCallback(called), ModelCheckpoint(dirpath=folder)],
                      **common)
    t.fit(_HookedModel(called, automatic), ckpt_path=ckpt_path)
    # described after fit: a checkpoint dict a hook saw and the strategy changed later differs here
    return [hook + "(" + ", ".join([*map(_describe, args), *(f"{k}={_describe(v)}" for k, v in sorted(kwargs.items()))]) + ")"
            for hook, args, kwargs in called]


@pytest.mark.parametrize("case", ["validation", "no_validation", "manual_optimization", "resume"])
def test_hook_order_and_arguments_equal_default(tmp_path, case):
    """Lightning's test_hooks.py: every LightningModule and Callback hook of `fit`, in order, with the
    arguments they get (the checkpoint dicts of `on_save_checkpoint` and `on_load_checkpoint` by key)."""
    kwargs = dict(validation=case == "validation", automatic=case != "manual_optimization", resume=case == "resume")
    expected = _recorded_fit("auto", tmp_path / "default", **kwargs)
    got = _recorded_fit("roundpipe", tmp_path / "roundpipe", **kwargs)
    assert any(h.startswith("on_save_checkpoint(") for h in expected)
    assert got == expected


@pytest.mark.parametrize("verb", ["validate", "test", "predict"])
def test_evaluation_hook_order_equals_default(verb):
    recorded = {}
    for strategy in ("auto", "roundpipe"):
        called: list = []
        t = _make_trainer(strategy, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2,
                          callbacks=[_HookedCallback(called)])
        getattr(t, verb)(_HookedModel(called))
        recorded[strategy] = [(hook, tuple(map(_describe, args)), {k: _describe(v) for k, v in kwargs.items()})
                              for hook, args, kwargs in called]
    assert any(hook == f"{verb}_step" if verb == "predict" else hook == ("validation_step" if verb == "validate" else "test_step")
               for hook, *_ in recorded["auto"])
    assert recorded["roundpipe"] == recorded["auto"]


def test_checkpoint_file_keeps_the_plan_and_hooks_do_not_see_it(tmp_path):
    """The file has RoundPipe's `roundpipe_plan` (a resumed fit reuses the plan); the dict given to
    `on_save_checkpoint` and `on_load_checkpoint` has the keys of the default strategy's."""
    seen: dict[str, list[set]] = {"save": [], "load": []}

    class Keys(Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            seen["save"].append(checkpoint)

        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            seen["load"].append(set(checkpoint))

    folder = tmp_path / "ckpt"
    t = _make_trainer("roundpipe", roundpipe=_roundpipe(partition="auto", profile_steps=2), max_steps=1, callbacks=[Keys()],
                      limit_val_batches=0)
    t.fit(_SequentialBoring())
    t.save_checkpoint(folder / "a.ckpt")
    assert "roundpipe_plan" in torch.load(folder / "a.ckpt", weights_only=False)
    assert all("roundpipe_plan" not in checkpoint for checkpoint in seen["save"])
    _make_trainer("roundpipe", roundpipe=_roundpipe(partition="auto", profile_steps=2), max_steps=2, callbacks=[Keys()],
                  limit_val_batches=0).fit(_SequentialBoring(), ckpt_path=folder / "a.ckpt")
    reference = torch.load(folder / "a.ckpt", weights_only=False)
    assert seen["load"] == [set(reference) - {"roundpipe_plan"}]


# ---------------------------------------------------------------------------------------- copies
class _EMA(Callback):
    """A user's exponential moving average: a deep copy of the module made in `on_fit_start` (after
    the strategy's setup), averaged after every batch, and a pickle of the module at every batch end."""

    def __init__(self) -> None:
        self.average: nn.Module | None = None
        self.pickled: list[bytes] = []

    def on_fit_start(self, trainer, pl_module):
        self.average = copy.deepcopy(pl_module)

    def on_train_batch_end(self, trainer, pl_module, *args):
        getattr(trainer.strategy, "wait_for_optimizer", lambda: None)()
        with torch.no_grad():
            for mine, theirs in zip(self.average.parameters(), pl_module.parameters()):
                mine.lerp_(theirs, 0.5)
        self.pickled.append(pickle.dumps(pl_module))


@pytest.mark.parametrize("optimizer", ["sync", "async"])
def test_module_deep_copies_and_pickles_during_fit(optimizer):
    """`copy.deepcopy`/`pickle.dumps` of the LightningModule while the pipeline is installed (weight
    averaging and checkpointing callbacks do it) work; the copies hold the module's parameters and run
    a plain forward, and the EMA equals the default strategy's."""
    results = {}
    for strategy in ("auto", "roundpipe"):
        ema = _EMA()
        module = MLPModule(scheduler=False)
        t = _make_trainer(strategy, roundpipe=_roundpipe(num_microbatches=3, optimizer=optimizer), max_steps=3,
                          callbacks=[ema])
        t.fit(module, loader(VectorData(n=21)))
        results[strategy] = (ema, module)
    (ema_ref, module_ref), (ema, module) = results["auto"], results["roundpipe"]
    if optimizer == "sync":  # "async" computes on one step older weights (documented), so its EMA differs
        assert max_diff(params(ema.average), params(ema_ref.average)) <= TOL
    last = pickle.loads(ema.pickled[-1])
    assert max_diff(params(last), params(module)) <= TOL  # the last batch end: the fitted weights
    assert len(ema.pickled) == 3
    x = torch.randn(5, 8)
    assert b"lightning_roundpipe" not in ema.pickled[-1]  # unpickles where the package is not installed
    for copied in (ema.average, last):
        assert not isinstance(copied.model.__dict__.get("forward"), InstalledMethod)
        assert copied.model.forward.__self__ is copied.model
        fresh = MLPModule(scheduler=False)
        fresh.load_state_dict(copied.state_dict())
        assert torch.equal(copied.model(x), fresh.model(x))  # a plain forward (no engine runs it)


def test_installed_method_copies_to_what_the_module_had():
    """A target whose instance already had its own `forward` gets that one back in a copy."""
    from lightning_roundpipe.runtime.execution.installed import own_method

    layer = nn.Linear(3, 3)
    layer.forward = partial(torch.mul, other=2.0)  # an instance attribute of the user's
    installed = InstalledMethod(lambda x: x * 0, layer, "forward", layer.__dict__["forward"])
    layer.__dict__["forward"] = installed
    x = torch.randn(2, 3)
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert isinstance(copied.__dict__["forward"], partial)
        assert torch.equal(copied(x), 2 * x)
    assert torch.equal(layer(x), x * 0)
    assert own_method(installed.original) is installed.original


# ---------------------------------------------------------------------------------------- cluster
def test_partial_slurm_environment_gives_default_ranks(monkeypatch):
    """Lightning's test_hpc_restore_attempt: `SLURMEnvironment.detect` patched to True, no SLURM
    variables (no `SLURM_NODEID`): one node runs as under the default strategy (ranks 0, world size 1),
    reading none of them."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    with mock.patch("lightning.fabric.plugins.environments.slurm.SLURMEnvironment.detect", return_value=True):
        ranks = {}
        for strategy in ("auto", "roundpipe"):
            t = _make_trainer(strategy, max_steps=1, limit_val_batches=0)
            t.fit(_SequentialBoring())
            ranks[strategy] = (t.global_rank, t.local_rank, t.node_rank, t.world_size, t.is_global_zero, t.global_step)
    assert ranks["roundpipe"] == ranks["auto"] == (0, 0, 0, 1, True, 1)


@pytest.mark.parametrize("world_size", [1, 2])
def test_world_size_can_be_set_as_on_the_default_strategy(world_size):
    """Lightning's test_training_step_returns_none_distributed: `trainer.strategy.world_size = N` (a mocked
    world size, no processes) is read by Lightning's loop: with 2, a `training_step` returning `None`
    raises as under the default strategy; with 1, it is skipped."""

    class NoneStep(_SequentialBoring):
        def training_step(self, batch, batch_idx):
            return None

    outcomes = {}
    for strategy in ("auto", "roundpipe"):
        t = _make_trainer(strategy, max_steps=1, limit_val_batches=0)
        t.strategy.world_size = world_size
        t.strategy.global_rank = 0
        try:
            t.fit(NoneStep())
            outcomes[strategy] = (t.world_size, "ok")
        except RuntimeError as error:
            outcomes[strategy] = (t.world_size, "Skipping the `training_step`" in str(error))
    assert outcomes["roundpipe"] == outcomes["auto"] == ((1, "ok") if world_size == 1 else (2, True))


def test_launcher_with_several_processes_on_one_node_is_refused(monkeypatch):
    """`torchrun --nproc-per-node 2` with `num_nodes=1` would train the model twice, alone: a clear error."""
    for key, value in {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    t = _make_trainer("roundpipe", max_steps=1, limit_val_batches=0)
    with pytest.raises(ValueError, match=r"world size 2 for `num_nodes=1`.*HINT"):
        t.fit(_SequentialBoring())


# ---------------------------------------------------------------------------------------- backward
def test_strategy_backward_patched_with_wraps():
    """Lightning's tests patch `Strategy.backward` with `wraps=trainer.strategy.backward`: the strategy does
    not override `backward` (its work is in `post_backward`), so the patch counts the calls and recurses nowhere."""
    counts = {}
    for strategy in ("auto", "roundpipe"):
        t = _make_trainer(strategy, max_steps=3, limit_val_batches=0)
        with mock.patch.object(Strategy, "backward", wraps=t.strategy.backward) as backward:
            t.fit(_SequentialBoring())
        counts[strategy] = backward.call_count
    assert counts["roundpipe"] == counts["auto"] == 3


# ---------------------------------------------------------------------------------------- batch statistics
class _BatchNormModule(MLPModule):
    def __init__(self) -> None:
        super().__init__(scheduler=False)
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.parametrize("batch_size", [3, 7])
def test_batchnorm_in_train_mode_sees_the_whole_batch(batch_size):
    """BatchNorm in train mode normalises over the whole batch (microbatches of one row would raise
    "Expected more than 1 value per channel", larger ones would change the statistics): the training
    calls run as one microbatch with a warning naming the layer; fit, running statistics and validation
    equal the default strategy's."""
    fitted, val = {}, {}
    for strategy in ("auto", "roundpipe"):
        module = _BatchNormModule()
        t = _make_trainer(strategy, roundpipe=_roundpipe(num_microbatches=3), max_steps=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(module, loader(VectorData(n=9), batch_size))
        fitted[strategy] = {k: v.float() for k, v in module.state_dict().items()}
        val[strategy] = t.validate(module, loader(VectorData(n=9, seed=2), batch_size), verbose=False)[0]["val/loss"]
        messages = [str(w.message) for w in caught if "normalise" in str(w.message)]
        assert len(messages) == (strategy == "roundpipe")
    assert "`1` of the pipelined `Sequential` (BatchNorm1d)" in messages[0] and "HINT" in messages[0]
    assert max_diff(fitted["roundpipe"], fitted["auto"]) <= TOL
    assert abs(val["roundpipe"] - val["auto"]) <= TOL


def test_weight_averaging_callback_equals_default():
    """Lightning's `WeightAveraging` (EMA: an `AveragedModel`, a deep copy, swapped in for validation) on a
    model with BatchNorm: weights, statistics and validation loss as under the default strategy."""
    from lightning.pytorch.callbacks import WeightAveraging
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    results = {}
    for strategy in ("auto", "roundpipe"):
        module = _BatchNormModule()
        t = _make_trainer(strategy, roundpipe=_roundpipe(num_microbatches=3), max_epochs=3, limit_train_batches=3,
                          limit_val_batches=2, callbacks=[WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.9))])
        t.fit(module, loader(VectorData(n=21)), loader(VectorData(n=14, seed=3)))
        results[strategy] = ({k: v.float() for k, v in module.state_dict().items()}, float(t.callback_metrics["val/loss"]))
    assert max_diff(results["roundpipe"][0], results["auto"][0]) <= TOL
    assert abs(results["roundpipe"][1] - results["auto"][1]) <= TOL


class _ReplaceStatistics(Callback):
    """Replaces the BatchNorm's running statistics by new tensors at the start of epoch 1, as Lightning's
    `StochasticWeightAveraging` does before it recomputes them (`bn.running_mean = torch.zeros_like(...)`)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            bn = pl_module.model[1]
            bn.running_mean = torch.zeros_like(bn.running_mean)
            bn.running_var = torch.ones_like(bn.running_var)


def test_replaced_buffers_are_followed():
    """Buffers a callback replaces during fit get the pipeline's updates (not the tensors the pipeline
    started with): the statistics equal the default strategy's; a replacement of another shape is refused."""
    fitted = {}
    for strategy in ("auto", "roundpipe"):
        module = _BatchNormModule()
        t = _make_trainer(strategy, roundpipe=_roundpipe(num_microbatches=3), max_epochs=2, limit_train_batches=2,
                          callbacks=[_ReplaceStatistics()])
        t.fit(module, loader(VectorData(n=14)))
        fitted[strategy] = {k: v.float() for k, v in module.state_dict().items()}
    assert max_diff(fitted["roundpipe"], fitted["auto"]) <= TOL

    class Resize(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                pl_module.model[1].running_mean = torch.zeros(3)

    t = _make_trainer("roundpipe", roundpipe=_roundpipe(num_microbatches=3), max_epochs=2, limit_train_batches=2,
                      callbacks=[Resize()])
    with pytest.raises(ValueError, match=r"running_mean` of layer 1 .*replaced.*HINT"):
        t.fit(_BatchNormModule(), loader(VectorData(n=14)))


def test_batchnorm_in_eval_mode_keeps_microbatches():
    """Frozen batch normalisation (eval mode: running statistics) is per row: the calls are cut into microbatches."""
    from lightning_roundpipe.runtime.execution.microbatch import BatchStatistics

    model = _BatchNormModule().model
    stats = BatchStatistics(list(model), model)
    assert stats.num_microbatches(4) == 1 and stats.active() == ["1"]
    model[1].eval()
    assert stats.num_microbatches(4) == 4
    model[1].track_running_stats, model[1].running_mean, model[1].running_var = False, None, None
    assert stats.num_microbatches(4) == 1  # eval mode without running statistics uses the batch's


# ---------------------------------------------------------------------------------------- files
def test_no_files_beside_checkpoints_or_in_the_working_directory(tmp_path, monkeypatch):
    """Without a logger nothing but the checkpoints is written (a trace is due at batch 3): the
    checkpoint folder and the working directory list as under the default strategy."""
    listings = {}
    for strategy in ("auto", "roundpipe"):
        folder, cwd = tmp_path / strategy / "ckpt", tmp_path / strategy / "cwd"
        cwd.mkdir(parents=True)
        monkeypatch.chdir(cwd)
        t = _make_trainer(strategy, roundpipe=_roundpipe(num_microbatches=3, profile_steps=2, trace_every_n_steps=1,
                                                        partition="auto"),
                          max_steps=4, default_root_dir=folder, enable_checkpointing=True,
                          callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.fit(MLPModule(), loader(VectorData()))
        listings[strategy] = (sorted(os.listdir(folder)), os.listdir(cwd))
        if strategy == "roundpipe":
            assert any("trace_every_n_steps=1" in str(w.message) and "HINT" in str(w.message) for w in caught)
    assert listings["roundpipe"] == listings["auto"]


# ---------------------------------------------------------------------------------------- metrics
def test_metrics_stay_out_of_user_dicts_and_follow_log_every_n_steps(tmp_path):
    """RoundPipe's metrics reach the logger at the steps the user's metrics do (`log_every_n_steps=2`)
    and never enter `callback_metrics`, `logged_metrics` or `progress_bar_metrics`: those equal the
    default strategy's; every batch's values are in `strategy.step_metrics`."""
    seen = {}
    for strategy in ("auto", "roundpipe"):
        logger = CSVLogger(tmp_path / strategy)
        t = _make_trainer(strategy, roundpipe=_roundpipe(num_microbatches=3), max_steps=5, logger=logger, log_every_n_steps=2)
        t.fit(MLPModule(), loader(VectorData()))
        with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
        user_steps = sorted({int(r["step"]) for r in rows if r.get("train/loss")})
        roundpipe_steps = sorted({int(r["step"]) for r in rows if r.get("roundpipe/device0/bubble(%)")})
        seen[strategy] = (user_steps, roundpipe_steps, set(t.callback_metrics), set(t.logged_metrics),
                          set(t.progress_bar_metrics))
        if strategy == "roundpipe":
            assert "roundpipe/device1/bubble(%)" in t.strategy.step_metrics
    user_steps, roundpipe_steps, *dicts = seen["roundpipe"]
    assert user_steps == seen["auto"][0] == [1, 3]
    assert roundpipe_steps == user_steps
    assert seen["auto"][1] == []
    assert dicts == list(seen["auto"][2:])


def test_stochastic_weight_averaging_with_batchnorm_equals_default():
    """Lightning's `StochasticWeightAveraging` on a model with BatchNorm sets `momentum = None` on the layers in
    its last epoch (a plain attribute set during fit) and recomputes the running statistics of the averaged
    weights: the replicas follow the layer's attribute, so weights and statistics equal the default strategy's,
    and no attribute warning is given. With `momentum = None` torch's BatchNorm reads `num_batches_tracked` as a
    Python float (a host sync on a GPU, under the default strategy too): the checking mode counts those, one per
    training microbatch of that epoch (one microbatch a batch in train mode), and no other."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from lightning_roundpipe.runtime.backends import op_check

    results = {}
    for strategy in ("auto", "roundpipe"):
        module = _BatchNormModule()
        t = _make_trainer(strategy, roundpipe=_roundpipe(num_microbatches=3), max_epochs=3, limit_train_batches=3,
                          limit_val_batches=0, callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)])
        with warnings.catch_warnings(record=True) as caught, op_check.count_syncs() as syncs:
            warnings.simplefilter("always")
            t.fit(module, loader(VectorData(n=21)))
        assert not [w for w in caught if "attribute" in str(w.message)], strategy
        if strategy == "roundpipe":  # the statistics epoch: 3 batches
            assert syncs.total == 3 and all(what == "`float()`" for _, what, _ in syncs.sites), syncs.report()
        assert module.model[1].momentum == 0.1  # restored by the callback at the end of fit
        results[strategy] = {k: v.float() for k, v in module.state_dict().items()}
    assert results["roundpipe"]["model.1.num_batches_tracked"] == results["auto"]["model.1.num_batches_tracked"]
    assert max_diff(results["roundpipe"], results["auto"]) <= TOL
