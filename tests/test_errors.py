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
    with pytest.raises(DeviceMemoryError, match=r"LOAD.*2 slots of .*largest stage.*HINT: this device holds 2 slots of the"
                                                r" largest stage's weights .*: make that stage smaller"):
        run.fit(MLPModule(scheduler=False), loader(VectorData()))


def test_the_automatic_recut_names_layers_as_the_stage_table_and_prints_small_sizes():
    """The automatic partition's error for a layer over the per-stage budget names the layer as the stage
    table does (`2:Linear`, the sequence's `layer_names`, not `layer2`) and prints a small model's bytes in a
    unit that shows them (KiB here, never `0.00 GiB`). Oracle: the layer sequence's own names and sizes."""
    from lightning_roundpipe.partition import auto_partition

    seen = {}

    class Keep(L.Callback):
        def on_train_end(self, trainer, module):
            engine = trainer.strategy.engine
            seen["profiles"], seen["names"] = engine.measured_profiles, list(engine.seq.layer_names)

    run = trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=2, partition="auto", profile_steps=2),
                  devices=2, max_steps=3, callbacks=[Keep()])
    run.fit(MLPModule(scheduler=False), loader(VectorData()))
    profiles, names = seen["profiles"], seen["names"]
    assert [p.name for p in profiles] == names and names[2] == "2:Linear"
    with pytest.raises(ValueError) as info:
        auto_partition(profiles, 2, 12_000)  # Linear(32, 32): 4224 bytes of weights, as many of gradients
    message = str(info.value)
    assert "Layer 2 (`2:Linear`) alone needs" in message and "layer2" not in message
    assert "0.00 GiB" not in message and "weights 4.12 KiB" in message and "(12,000 bytes)" in message


@pytest.mark.parametrize("name,value", [("device_memory_bytes", 1.5e9), ("chunk_bytes", 6.4e7)])
def test_size_arguments_take_a_whole_float_as_its_int_and_refuse_others(name, value):
    """Every size argument (bytes) takes a float holding a whole number (`1.5e9`, as a command line writes it) as
    that int, deliberately and documented; a fractional float is a ValueError saying so, a non-number a TypeError
    (Lightning's style). Oracle: the int the float holds."""
    from lightning_roundpipe.config import DataParallel

    assert getattr(lightning_roundpipe.RoundPipeStrategy(**{name: value}), name) == int(value)
    assert type(getattr(lightning_roundpipe.RoundPipeStrategy(**{name: value}), name)) is int
    with pytest.raises(ValueError, match=rf"`{name}` must be a whole number of bytes.*HINT"):
        lightning_roundpipe.RoundPipeStrategy(**{name: value + 0.5})
    for bad in ("1e9", True, None if name == "chunk_bytes" else [1e9, "x"]):
        with pytest.raises(TypeError, match=rf"`{name}(\[1\])?` must be an int of bytes \(or a float holding a whole"):
            lightning_roundpipe.RoundPipeStrategy(**{name: bad})
    assert lightning_roundpipe.RoundPipeStrategy(device_memory_bytes=[1e9, 2**30]).device_memory_bytes == (10**9, 2**30)
    assert DataParallel(bucket_bytes=2.5e7).bucket_bytes == 25_000_000
    with pytest.raises(ValueError, match=r"bucket_bytes.*whole number"):
        DataParallel(bucket_bytes=2.5e7 + 0.5)
    with pytest.raises(TypeError, match=r"bucket_bytes.*int of bytes"):
        DataParallel(bucket_bytes="25MB")


def test_pool_messages_say_the_slots_that_were_reserved():
    """The memory check's error names the stage weight slots the plan reserves (`pool_slots`): one slot when
    each device runs one stage (the whole model as one fused stage), two otherwise; its HINT says the same count
    and suggests only what applies (`partition='auto'` unless it is automatic already, `overlap_batches=False`
    only with two pool banks). Oracle: the error's own `peak.slots`, from the program's slot assignment."""
    from lightning_roundpipe.partition.memory import DevicePeak
    from lightning_roundpipe.runtime.tuning.device_memory import PlanMemoryError

    one = dict(num_microbatches=2, device_memory_bytes=1000, forward_stages=[(0, 7)], backward_stages=[(0, 7)])
    with pytest.raises(PlanMemoryError) as info:
        trainer(lightning_roundpipe.RoundPipeStrategy(**one), devices=2, max_steps=1).fit(
            MLPModule(scheduler=False), loader(VectorData()))
    message = str(info.value)
    assert info.value.peak.slots == 1
    assert "one pool bank with one slot of" in message and "HINT: this device holds one slot of the largest" in message
    assert "two slots" not in message and "slot(s)" not in message and "overlap_batches=False" not in message
    peak = DevicePeak(device_index=1, peak_bytes=900, pool_bytes=800, working_bytes=100, stage_index=3,
                      parts={"stage weights": 800}, pool_stage_index=3, slots=2, slot_bytes=200)
    two_banks = str(PlanMemoryError(peak, 500, "stage 3", banks=2, pool_stage="stage 3", auto_partition=False))
    assert "two pool banks (the overlapped modes), each with 2 slots of 200 bytes" in two_banks
    assert "holds 2 slots of the largest stage's weights per bank (the stage computing and the one prefetched)" in two_banks
    assert "`partition='auto'`" in two_banks and "`overlap_batches=False` keeps one pool bank" in two_banks
    automatic = str(PlanMemoryError(peak, 500, "stage 3", banks=1, pool_stage="stage 3", auto_partition=True))
    assert "partition='auto'" not in automatic and "overlap_batches" not in automatic


def test_out_of_memory_hints_suggest_only_what_applies():
    """A GPU out-of-memory error in an op: its HINT suggests `partition='auto'` only when the partition is not
    automatic already, and claims no slot count it does not know."""
    from lightning_roundpipe.runtime.execution.errors import oom_hint

    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "`partition='auto'`" in oom_hint(error, auto_partition=False)
    assert "partition='auto'" not in oom_hint(error, auto_partition=True) and "forward_stages" in oom_hint(error, True)
    assert "two slots" not in oom_hint(error)
