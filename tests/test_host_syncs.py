"""Host syncs inside device ops and the placement check (issue 30, DESIGN.md section 4 (b), (c)).

The checking mode of CPU virtual devices fails where a GPU would: a device op that turns a device
tensor into a Python value (a host sync, as ``torch.cuda.set_sync_debug_mode("error")`` raises), or
that reads a tensor never uploaded to its device (CUDA's "Expected all tensors to be on the same
device"). Every supported Hugging Face family runs a training step without a host sync inside any
device op, padded, packed (position ids restarting inside a row, as ``DataCollatorWithFlattening``
makes) and unpadded; the counts print with ``pytest -s tests/test_host_syncs.py -k per_family``.
"""

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.runtime.backends import op_check
from lightning_roundpipe.runtime.execution.engine import RoundPipeEngine
from _helpers import SEQ, VOCAB, TokenData, tiny_family_model

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "olmo",
            "qwen3_moe", "gpt_oss"]
LAYOUTS = ["padded", "packed", "unpadded"]


def tiny_model(kind: str, attention: str = "sdpa", use_cache: bool = True, layers: int = 4) -> nn.Module:
    """A tiny random causal LM of ``kind`` (fp32) with ``attention`` as its attention implementation."""
    return tiny_family_model(kind, attention, use_cache, layers)


def packed_positions(rows: int, seed: int = 3) -> torch.Tensor:
    """Position ids of rows that each hold 2-3 sequences packed end to end (as HF's flattening
    collators make them): ``(rows, SEQ)`` int64, restarting at 0 at every sequence start."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, SEQ, dtype=torch.int64)
    for row in range(rows):
        cuts = sorted(torch.randperm(SEQ - 1, generator=g)[:2].add(1).tolist())
        starts = [0] + cuts
        for index, start in enumerate(starts):
            stop = starts[index + 1] if index + 1 < len(starts) else SEQ
            out[row, start:stop] = torch.arange(stop - start)
    return out


def batch_of(layout: str, rows: int = 6) -> dict:
    data = TokenData(n=rows)
    if layout == "padded":
        return {"input_ids": data.ids, "attention_mask": data.mask, "labels": data.labels}
    labels = data.ids.clone()
    if layout == "packed":
        return {"input_ids": data.ids, "position_ids": packed_positions(rows), "labels": labels}
    return {"input_ids": data.ids, "labels": labels}


def _engine(model: nn.Module, devices: int = 2, num_microbatches: int = 3, check: bool = True) -> RoundPipeEngine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seq = make_layer_sequence(model)
    engine = RoundPipeEngine(seq, [torch.device("cpu")] * devices, num_microbatches=num_microbatches,
                             check_streams=check)
    engine.install()
    return engine


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", FAMILIES)
def test_no_host_sync_per_family(kind, layout):
    """2 CPU virtual devices, 3 microbatches, one training step (forward, fused tail, recompute and
    backward): no device op of any supported family turns a device tensor into a Python value.
    Packed batches run without a KV cache (``use_cache=False``), where the model's forward isolates
    the packed sequences."""
    model = tiny_model(kind, use_cache=layout != "packed")
    engine = _engine(model)
    try:
        with op_check.count_syncs() as counter:
            model(**batch_of(layout)).loss.backward()
    finally:
        engine.close()
    print(f"{kind:12s} {layout:9s} " + counter.report())
    assert counter.total == 0, counter.report()


class PackedData(torch.utils.data.Dataset):
    """Rows of 2-3 sequences packed end to end: ``input_ids``, ``position_ids`` restarting at every
    sequence start, ``labels`` (-100 on each sequence's first token, as HF's flattening collators
    set them), no attention mask."""

    def __init__(self, n: int = 28, seed: int = 1) -> None:
        self.ids = TokenData(n=n, seed=seed).ids
        self.pos = packed_positions(n, seed)
        self.labels = self.ids.masked_fill(self.pos == 0, -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "position_ids": self.pos[i], "labels": self.labels[i]}


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_batches_train_exactly_as_the_default_strategy(use_cache):
    """Packed rows, 2 CPU virtual devices, 3 microbatches, 3 SGD steps with accumulation: the same
    parameters as Lightning's default strategy (fp32, 1e-5). Without a KV cache (``use_cache=False``)
    the model's forward isolates the packed sequences (the host decides "packed"); with the config's
    cache on, it does not (one causal mask per row), and neither does the pipeline."""
    import lightning_roundpipe
    from _helpers import CausalLMModule, fit_params, max_diff

    def make():
        return CausalLMModule(tiny_model("llama", attention="eager", use_cache=use_cache, layers=3))

    kw = dict(max_steps=3, accumulate_grad_batches=2)
    ref = fit_params(make, PackedData(), **kw)
    got = fit_params(make, PackedData(), strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=3),
                     devices=2, **kw)
    diff = max_diff(ref, got)
    print(f"packed use_cache={use_cache}: max abs diff {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("kind,attention", [("llama", "sdpa"), ("qwen3", "eager"), ("gemma3_text", "sdpa"),
                                            ("mistral", "sdpa"), ("qwen3_moe", "sdpa")])
def test_packed_batches_match_the_models_own_forward(kind, attention):
    """The loss and every gradient of a packed batch (no KV cache) equal the model's own forward
    (fp32, 1e-5), which isolates the packed sequences; the oracle is not trivial: the same batch with
    the cache on (no isolation) gives another loss."""
    model = tiny_model(kind, attention=attention, use_cache=False)
    ref = copy.deepcopy(model)
    data = PackedData(n=7)
    batch = {"input_ids": data.ids, "position_ids": data.pos, "labels": data.labels}
    engine = _engine(model)
    try:
        out = model(**batch)
        out.loss.backward()
    finally:
        engine.close()
    expected = ref(**batch)
    expected.loss.backward()
    with torch.no_grad():
        unisolated = ref(**batch, use_cache=True).loss
    assert abs(unisolated.item() - expected.loss.item()) > 1e-3  # packing changes the loss
    grads = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    diff = max(grads, abs(out.loss.item() - expected.loss.item()))
    print(f"packed {kind} ({attention}): max abs diff {diff:.2e}")
    assert diff <= 1e-5


class _Block(nn.Module):
    """A layer of an ``nn.Sequential`` that does one GPU-hostile thing (``mode``)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.mode = mode
        self.scale = torch.ones(8)  # a plain attribute: neither a parameter nor a buffer
        self.register_buffer("uploaded", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.mode == "if":
            if y.sum() > 0:  # bool() of a device tensor
                y = y * 2
        elif self.mode == "item":
            y = y * y.abs().max().item()
        elif self.mode == "nonzero":
            y = y[y > 0].sum() + y
        elif self.mode == "host_attribute":
            y = y * self.scale
        elif self.mode == "moved_attribute":
            y = y * self.scale.to(y.device)  # an upload inside the op: fine on a GPU
        elif self.mode == "host_scalar":
            y = y * torch.tensor(0.5) + self.uploaded  # CPU 0-dim tensors are allowed, as on CUDA
        elif self.mode == "host_value":
            y = y * torch.tensor([0.5, 2.0]).sum().item()  # a host tensor's value: no device sync
        return y


def _run_sequential(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Block(mode), nn.Tanh(), nn.Linear(8, 4))
    engine = _engine(model, num_microbatches=2)
    try:
        model(torch.randn(6, 8)).pow(2).sum().backward()
    finally:
        engine.close()


@pytest.mark.parametrize("mode,what", [("if", "`bool()`"), ("item", "`.item()`"), ("nonzero", "boolean-mask indexing")])
def test_host_sync_inside_a_device_op_raises(mode, what):
    """Checking mode: the op, the layer and the Python line are named."""
    with pytest.raises(op_check.HostSyncError) as caught:
        _run_sequential(mode)
    message = str(caught.value)
    assert what in message and "host sync inside device op `F(stage 0, mb 0)`" in message, message
    assert "in `SequentialLayer` > `_Block`" in message and "test_host_syncs.py:" in message, message


def test_host_sync_counting_mode_counts_instead():
    with op_check.count_syncs() as counter:
        _run_sequential("item")
    # the item() runs in the forward of both microbatches and in their recomputation
    assert counter.total == 4 and {kind for kind, _, _ in counter.sites} == {"F", "R"}, counter.report()


def test_placement_check_raises_for_a_plain_host_attribute():
    """``self.scale = torch.ones(8)`` is not uploaded with the stage: on a GPU the multiplication
    fails ("Expected all tensors to be on the same device"); here the checking mode raises, naming
    the tensor, the attribute, the layer and the op."""
    with pytest.raises(op_check.PlacementError) as caught:
        _run_sequential("host_attribute")
    message = str(caught.value)
    assert "a (8,) float32 tensor (`_Block.scale (a plain attribute" in message, message
    assert "`F(stage 0, mb 0)`" in message and "aten.mul.Tensor" in message, message


@pytest.mark.parametrize("mode", ["moved_attribute", "host_scalar", "host_value"])
def test_placement_check_allows_what_a_gpu_allows(mode):
    _run_sequential(mode)
