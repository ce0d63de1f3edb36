"""Bad input gets a clear error; a failing worker makes `fit` raise fast and leaves nothing behind."""

import threading

import lightning as L
import pytest
import torch
from torch import nn

import lightning_roundpipe
from lightning_roundpipe.runtime.backends import op_check
from _helpers import MLPModule, VectorData, loader, trainer


class Boom(Exception):
    pass


class ThrowOnMarker(nn.Module):
    """Raises `Boom` when its input holds the marker value (a chosen sample, so a chosen microbatch)."""

    armed = True

    def forward(self, x):
        with op_check.unchecked():  # reading the data is this test's instrument (a host sync on a GPU)
            marked = ThrowOnMarker.armed and bool((x == 1234.0).any())
        if marked:
            raise Boom("marker seen")
        return x


class Failing(MLPModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Identity(), nn.Linear(8, 8), ThrowOnMarker(), nn.Linear(8, 4))


def _roundpipe_threads():
    return [t for t in threading.enumerate() if t.name.startswith("roundpipe-")]


def test_worker_exception_reaches_fit_and_next_fit_works():
    data = VectorData(n=7)
    with torch.no_grad():
        data.x[5] = 1234.0  # sample 5 of 7 -> microbatch 2 of 4 (sizes 2, 2, 2, 1)
    lin = Failing()
    with torch.no_grad():
        lin.model[1].weight.copy_(torch.eye(8))
        lin.model[1].bias.zero_()
    with pytest.raises(Boom) as info:
        trainer("roundpipe", devices=3, max_steps=2).fit(lin, loader(data))
    assert str(info.value) == "marker seen"  # the original exception, its message untouched
    (note,) = info.value.__notes__
    assert "device" in note and "stage" in note and "microbatch 2" in note
    assert "layer `2` (ThrowOnMarker" in note  # the child's name in the nn.Sequential
    assert not _roundpipe_threads()
    ThrowOnMarker.armed = False
    try:
        module = Failing()
        trainer("roundpipe", devices=3, max_steps=2).fit(module, loader(data))
        assert module.trainer.global_step == 2
    finally:
        ThrowOnMarker.armed = True
    assert not _roundpipe_threads()


class CodedError(Exception):
    """A user exception whose constructor does not take a message: it cannot be rebuilt from one."""

    def __init__(self, code: int) -> None:
        super().__init__(f"failed with code {code}")
        self.code = code


def test_custom_exception_keeps_its_type_and_attributes_with_a_note():
    """Raised in decoder layer 2 of a tiny Llama (layer 3 of the layer sequence, after the embedding
    prefix) on microbatch 1: the same object arrives, with a note naming device, stage, microbatch and
    the layer's name in the model."""
    from _helpers import CausalLMModule, TokenData, tiny_hf

    model = tiny_hf("llama")
    raised = []
    mlp = model.model.layers[2].mlp

    # a hook, not `mlp.forward = f.__get__(mlp)`: a forward bound to the original module would run on its
    # host master weights in every device's replica (the checking mode's placement check refuses that)
    def raise_on_microbatch_1(module, args):
        if args[0].shape[0] == 2 and not raised and torch.is_grad_enabled() is False:  # forward stage, microbatch 1
            raised.append(CodedError(42))
            raise raised[-1]

    mlp.register_forward_pre_hook(raise_on_microbatch_1)
    data = TokenData(n=5)  # microbatches of 3 and 2 rows
    with pytest.raises(CodedError) as info:
        trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=2), devices=2, max_steps=1).fit(
            CausalLMModule(model), loader(data, batch_size=5))
    assert info.value is raised[0] and info.value.code == 42 and str(info.value) == "failed with code 42"
    (note,) = info.value.__notes__
    print(note)
    assert "RoundPipe: device" in note and "stage" in note and "microbatch 1" in note
    assert "layer `model.layers.2` (layer 3 of the layer sequence), in `model.layers.2.mlp` (LlamaMLP)" in note
    assert not _roundpipe_threads()


def test_unsupported_model_names_families():
    class Odd(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 4)

        def training_step(self, batch, i):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match="module="):
        trainer("roundpipe", devices=2, max_steps=1).fit(Odd(), loader(VectorData()))
    with pytest.raises(TypeError, match="nn.Sequential"):
        trainer(lightning_roundpipe.RoundPipeStrategy(module="net"), devices=2, max_steps=1).fit(Odd(), loader(VectorData()))
    with pytest.raises(ValueError, match="no submodule"):
        trainer(lightning_roundpipe.RoundPipeStrategy(module="nope"), devices=2, max_steps=1).fit(Odd(), loader(VectorData()))
    assert not _roundpipe_threads()


def test_several_candidates_need_module_argument():
    class Two(MLPModule):
        def __init__(self):
            super().__init__()
            self.other = nn.Sequential(nn.Linear(4, 4))

    with pytest.raises(ValueError, match="several"):
        trainer("roundpipe", devices=2, max_steps=1).fit(Two(), loader(VectorData()))
    module = Two()
    trainer(lightning_roundpipe.RoundPipeStrategy(module="model"), devices=2, max_steps=1).fit(module, loader(VectorData()))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(num_microbatches=0), ValueError, "num_microbatches"),
    (dict(num_microbatches=2.5), ValueError, "num_microbatches"),
    (dict(module=3), TypeError, "module"),
    (dict(forward_stages=[(0, 3)]), ValueError, "backward_stages"),
    (dict(forward_stages=["a"], backward_stages=[(0, 1)]), TypeError, "forward_stages"),
    (dict(debug_copy_delay_s=float("inf")), ValueError, "finite number of seconds"),
    (dict(debug_copy_delay_s=-1.0), ValueError, "debug_copy_delay_s"),
    (dict(fused_loss="yes"), TypeError, "fused_loss"),
])
def test_bad_strategy_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        lightning_roundpipe.RoundPipeStrategy(**kwargs)


def test_bad_partition_is_reported():
    strategy = lightning_roundpipe.RoundPipeStrategy(forward_stages=[(0, 2), (3, 7)], backward_stages=[(0, 7)])
    with pytest.raises(ValueError, match="tile"):
        trainer(strategy, devices=2, max_steps=1).fit(MLPModule(), loader(VectorData()))


def test_ascending_backward_stages_are_quoted_as_given():
    """Backward stages run tail first; an ascending list is refused, quoting the user's own list (not the
    reversed one the check walks) and saying which order works."""
    strategy = lightning_roundpipe.RoundPipeStrategy(forward_stages=[(0, 3), (3, 7)], backward_stages=[(0, 3), (3, 7)])
    with pytest.raises(ValueError) as err:
        trainer(strategy, devices=2, max_steps=1).fit(MLPModule(), loader(VectorData()))
    msg = str(err.value)
    assert "`backward_stages`" in msg and "(reversed)" not in msg
    assert "got [range(0, 3), range(3, 7)]" in msg
    assert "HINT:" in msg and "`backward_stages=[range(3, 7), range(0, 3)]`" in msg


@pytest.mark.parametrize("precision", ["transformer-engine", "transformer-engine-float16", "8-mixed"])
def test_unsupported_precision(precision):
    # Lightning builds no plugin RoundPipe could wrap for these (transformer-engine needs its package)
    with pytest.raises(ValueError, match=r"RoundPipePrecision.*Valid options.*16-mixed.*HINT"):
        lightning_roundpipe.RoundPipePrecision(precision)


def test_unsupported_precision_plugin():
    from lightning.pytorch.plugins.precision import Precision

    class Custom(Precision):
        pass

    with pytest.raises(TypeError, match="RoundPipePrecision"):
        trainer("roundpipe", devices=2, plugins=[Custom()])


def test_bf16_mixed_trains():
    module = MLPModule()
    t = trainer("roundpipe", devices=2, precision="bf16-mixed", max_steps=3)
    assert isinstance(t.precision_plugin, lightning_roundpipe.RoundPipePrecision)
    t.fit(module, loader(VectorData()))
    assert all(p.dtype == torch.float32 for p in module.parameters())  # fp32 masters
    assert t.global_step == 3


def test_multi_node_without_a_launch_says_how(monkeypatch):
    """`num_nodes=2` is one process per node (tests/test_data_parallel.py); started alone, without
    `MASTER_PORT`, the run says how to launch it instead of waiting for peers."""
    for key in ("MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    t = trainer("roundpipe", devices=2, num_nodes=2, max_steps=1)
    assert t.world_size == 2 and t.num_devices == 2
    with pytest.raises(ValueError, match="MASTER_PORT.*NODE_RANK=k"):
        t.fit(MLPModule(), loader(VectorData(n=7)))


def test_a_batch_smaller_than_num_microbatches_warns_with_a_hint():
    """2 rows cannot make 3 microbatches: the run says so once, with what to change, and trains."""
    module = MLPModule(scheduler=False)
    run = trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), devices=2, max_steps=2)
    with pytest.warns(UserWarning, match=r"a batch of 2 rows is cut into 2 microbatches instead of 3 "
                                         r"\(`num_microbatches=3`; .*HINT: a `batch_size` of at least 3"):
        run.fit(module, loader(VectorData(), batch_size=2))
    assert run.global_step == 2


def test_weights_that_do_not_fit_get_a_hint_about_stages():
    """A budget smaller than a stage's weights fails at the LOAD; the HINT is about stages, not sequences."""
    from lightning_roundpipe.runtime.backends import DeviceMemoryError

    run = trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=2, partition="default",
                                                        device_memory_bytes=1000), devices=2, max_steps=1)
    with pytest.raises(DeviceMemoryError, match=r"LOAD.*largest stage.*HINT: every device holds two slots of the largest"
                                                r" stage's weights .*: make that stage smaller"):
        run.fit(MLPModule(scheduler=False), loader(VectorData()))
