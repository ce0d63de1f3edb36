"""CUDA path (marked `gpu`, skipped without a GPU): run by `scripts/gpu_check.sh` on a GPU machine.

The RoundPipe workers are ``ROUNDPIPE_GPU_TEST_DEVICES``: ``all`` (the default: every GPU), a count
of GPUs, or a comma list of CUDA devices where one GPU may appear several times
(``cuda:0,cuda:0,cuda:0,cuda:0``: four logical workers on one GPU, each with its own streams, so
round-robin dispatch and cross-stream event waits run on a single GPU). They reach the strategy as
``RoundPipeStrategy(parallel_devices=...)`` with ``Trainer(devices="auto")``.
"""

import contextlib
import importlib.util
import os
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, fit_params, loader, max_diff, tiny_hf, trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICES_ENV = "ROUNDPIPE_GPU_TEST_DEVICES"


def _devices() -> list[torch.device]:
    """The RoundPipe workers of these tests (``ROUNDPIPE_GPU_TEST_DEVICES``, see the module docstring)."""
    spec = os.environ.get(DEVICES_ENV, "").strip()
    count = torch.cuda.device_count()
    if spec in ("", "all"):
        return [torch.device(f"cuda:{i}") for i in range(count)]
    if spec.isdigit():
        n = int(spec)
        if not 1 <= n <= count:
            raise ValueError(f"{DEVICES_ENV}={spec!r}: this machine has {count} GPU(s).")
        return [torch.device(f"cuda:{i}") for i in range(n)]
    devices = [torch.device(s.strip()) for s in spec.split(",") if s.strip()]
    bad = [str(d) for d in devices if d.type != "cuda" or d.index is None or d.index >= count]
    if not devices or bad:
        raise ValueError(f"{DEVICES_ENV}={spec!r}: {bad or 'no device'} is not a CUDA device of this machine"
                         f" ({count} GPU(s)). HINT: e.g. {DEVICES_ENV}=cuda:0,cuda:0,cuda:0,cuda:0.")
    return devices


@contextlib.contextmanager
def _sync_errors():
    """CUDA's own host-sync check (``torch.cuda.set_sync_debug_mode("error")``) around a RoundPipe fit:
    a synchronising CUDA call anywhere (``.item()`` or a blocking copy of a CUDA tensor,
    ``Stream.synchronize``) raises, as the CPU driver's checking mode raises for a host sync inside a
    device op (:mod:`lightning_roundpipe.runtime.backends.op_check`). torch keeps one setting for the
    whole process, not per thread, so the driver cannot scope it to its device ops: it is on for the
    RoundPipe fits of these tests only, not for the plain single-GPU references."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _strategy(**kw) -> lightning_roundpipe.RoundPipeStrategy:
    return lightning_roundpipe.RoundPipeStrategy(parallel_devices=_devices(), **kw)


def _gpu_check_timeline():
    """``benchmarks/gpu_check_timeline.py`` as a module (the timeline analysis of ``benchmarks/gpu_check.py``,
    shared with these tests)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check_timeline.py"
    spec = importlib.util.spec_from_file_location("roundpipe_gpu_check_timeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cuda_parity_fp32():
    kw = dict(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), **kw)  # CPU reference
    with _sync_errors():
        got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), strategy=_strategy(num_microbatches=3),
                         accelerator="cuda", devices="auto", **kw)
    assert max_diff(ref, got) <= 1e-4  # CUDA vs CPU kernels differ slightly
    assert all(p.device.type == "cpu" for p in got.values())


def test_cuda_logical_workers_on_one_gpu():
    """cuda:0 given three times: three workers with their own streams, round-robin, on one GPU."""
    seen = []

    class Spy(lightning_roundpipe.RoundPipeMetricsCallback):
        def on_train_batch_end(self, trainer, *args, **kwargs):
            backends = trainer.strategy.engine.backends
            seen.append((len(backends), len({id(b.streams["compute"]) for b in backends}),
                         {str(b.device) for b in backends}))
            super().on_train_batch_end(trainer, *args, **kwargs)

    kw = dict(max_steps=2, gradient_clip_val=0.5)
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), **kw)  # CPU reference
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=4, parallel_devices=[torch.device("cuda:0")] * 3)
    with _sync_errors():
        got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), strategy=strategy, accelerator="cuda",
                         devices="auto", callbacks=[Spy()], **kw)
    assert seen == [(3, 3, {"cuda:0"})] * 2
    assert max_diff(ref, got) <= 1e-4


def test_cuda_bf16_mixed_trains():
    module = CausalLMModule(tiny_hf("qwen3"))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    t = trainer(_strategy(), devices="auto", accelerator="cuda", precision="bf16-mixed", max_steps=3)
    with _sync_errors():
        t.fit(module, loader(TokenData()))
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in module.parameters())
    assert any(not torch.equal(before[n], p) for n, p in module.named_parameters())


def test_cuda_bf16_mixed_parity_with_plain_single_gpu_training():
    """bf16-mixed RoundPipe vs Lightning's own bf16-mixed on one GPU: the same updates up to bf16 noise."""
    kw = dict(max_steps=3, precision="bf16-mixed", accelerator="cuda")
    make = lambda: CausalLMModule(tiny_hf("llama"), lr=0.05)  # noqa: E731
    start = fit_params(make, TokenData(), max_steps=0)
    ref = fit_params(make, TokenData(), devices=1, **kw)
    with _sync_errors():
        got = fit_params(make, TokenData(), strategy=_strategy(num_microbatches=3), devices="auto", **kw)
    update_ref = {k: ref[k].cpu() - start[k] for k in start}
    update_got = {k: got[k] - start[k] for k in start}
    num = sum(((update_ref[k] - update_got[k]) ** 2).sum().item() for k in start) ** 0.5
    den = sum((update_ref[k] ** 2).sum().item() for k in start) ** 0.5
    assert den > 0 and num / den < 0.05  # relative error of the whole update; bf16 has ~3 significant digits


def test_cuda_weight_uploads_end_before_their_stage_computes():
    """From CUDA events: on every worker, each stage's compute starts after an upload of all its weight
    chunks ended (the LOAD -> compute edge); the hidden fraction is a fraction. How much of the upload
    is hidden under compute is measured on a real-sized model by ``scripts/gpu_check.sh``: a model this
    small is bound by kernel launches, where no overlap can be promised."""
    seen = []

    class Spy(lightning_roundpipe.RoundPipeMetricsCallback):
        def on_train_batch_end(self, trainer, *args, **kwargs):
            seen.extend(trainer.strategy.engine._timelines)
            super().on_train_batch_end(trainer, *args, **kwargs)

    fit_params(lambda: CausalLMModule(tiny_hf("llama", layers=8)), TokenData(), accelerator="cuda", devices="auto",
               max_steps=2, callbacks=[Spy()], strategy=_strategy(num_microbatches=4, partition="default"))
    overlap = _gpu_check_timeline().upload_overlap(seen)
    assert overlap["weight_chunks"] > 0 and overlap["computes"] > 0, overlap
    workers = {i.device_index for tl in seen for i in tl.intervals if i.is_compute}
    assert workers == set(range(len(_devices())))  # round-robin reached every worker
    assert overlap["computes_before_their_upload"] == 0, overlap
    assert 0.0 <= overlap["hidden_upload_fraction"] <= 1.0, overlap


def test_cuda_bf16_mixed_gradient_error_does_not_grow_with_microbatches():
    from test_numerics import _grad_errors

    (one, sixteen), _ = _grad_errors("mlp", [1, 16], _devices())
    assert 0 < one < 5e-2 and sixteen <= 1.1 * one, (one, sixteen)


def test_cuda_in_place_ops_parity():
    from test_numerics import InPlaceMLP
    from _helpers import VectorData

    kw = dict(max_steps=3, accumulate_grad_batches=2)
    ref = fit_params(InPlaceMLP, VectorData(), **kw)  # CPU reference
    with _sync_errors():
        got = fit_params(InPlaceMLP, VectorData(), strategy=_strategy(num_microbatches=3), accelerator="cuda",
                         devices="auto", **kw)
    assert max_diff(ref, got) <= 1e-4


def test_cuda_lora_frozen_base_is_pinned_bf16_during_fit():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_hf("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    module = CausalLMModule(model)
    seen = []
    # the frozen matmul weights (nn.Linear weights; the LM head's is the embedding's: fp32) are held in bf16
    # only; the frozen norms and the embedding keep fp32 (DESIGN.md section 5); every one pinned in place
    tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    matmul = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)} - tied

    class Spy(lightning_roundpipe.RoundPipeMetricsCallback):
        def on_train_batch_end(self, trainer, pl_module, *args, **kwargs):
            frozen = [p for p in pl_module.parameters() if not p.requires_grad]
            seen.append(all(p.dtype == (torch.bfloat16 if id(p) in matmul else torch.float32) and p.is_pinned()
                            and p.grad is None for p in frozen))
            super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    trainer(_strategy(), devices="auto", accelerator="cuda", precision="bf16-mixed", max_steps=2,
            callbacks=[Spy()]).fit(module, loader(TokenData()))
    assert seen == [True, True]
    assert all(p.dtype == torch.float32 and not p.is_pinned() and p.device.type == "cpu" for p in module.parameters())


def test_cuda_moe_parity_with_routing_replay_and_aux_loss():
    """Qwen3-MoE and GPT-OSS with the load-balancing loss on CUDA: routing recorded into pinned host
    memory without blocking the compute stream, replayed on the recomputing GPU."""
    from test_moe import tiny_moe

    kw = dict(max_steps=2, accumulate_grad_batches=2, gradient_clip_val=0.5)
    for kind in ("qwen3_moe", "gpt_oss"):
        ref = fit_params(lambda: CausalLMModule(tiny_moe(kind)), TokenData(n=28), **kw)  # CPU reference
        with _sync_errors():
            got = fit_params(lambda: CausalLMModule(tiny_moe(kind)), TokenData(n=28), accelerator="cuda", devices="auto",
                             strategy=_strategy(num_microbatches=3), **kw)
        assert max_diff(ref, got) <= 1e-4, kind  # CUDA vs CPU kernels differ slightly


def test_cuda_step_trace_and_mfu(tmp_path):
    """The CUDA timeline (CUDA-event spans) gives a valid trace, and MFU is logged for a GPU of the table."""
    import json

    from lightning.pytorch.loggers import CSVLogger

    from _trace_check import check_trace
    from lightning_roundpipe.runtime.tuning.flops import PEAK_FLOPS

    strategy = _strategy(num_microbatches=3, profile_steps=2, trace_every_n_steps=1)
    t = trainer(strategy, devices="auto", accelerator="cuda", precision="bf16-mixed", max_steps=3,
                logger=CSVLogger(tmp_path), log_every_n_steps=1)
    t.fit(CausalLMModule(tiny_hf("llama")), loader(TokenData(), batch_size=8))
    traces = sorted((tmp_path / "lightning_logs" / "version_0" / "roundpipe").glob("trace_step*.json"))
    assert [p.name for p in traces] == ["trace_step000003.json"]
    check_trace(json.loads(traces[0].read_text()), num_devices=len(_devices()))
    if any(fragment in torch.cuda.get_device_name(0) for fragment in PEAK_FLOPS):
        assert 0 < float(t.strategy.step_metrics["roundpipe/mfu(%)"]) < 100


# ---------------------------------------------------------------------------------------- issue 30 on CUDA
def _lora_dropout(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return CausalLMModule(get_peft_model(tiny_hf("llama"), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "gate_proj"])))


@pytest.mark.parametrize("optimizer,accumulate", [("sync", 2), ("async", 1)])
def test_cuda_lora_dropout_with_overlapped_runs(optimizer, accumulate):
    """LoRA dropout 0.1 while a previous run is still in flight (overlapped accumulation in sync mode,
    the steady state in async mode): no RNG guard error, and the same parameters as the same run with
    ``overlap_batches=False`` (the overlap changes when work runs, not the numbers drawn)."""
    kw = dict(max_steps=3, accumulate_grad_batches=accumulate, accelerator="cuda", devices="auto")
    got = {}
    for overlap in (True, False):
        strategy = _strategy(num_microbatches=3, optimizer=optimizer, overlap_batches=overlap)
        got[overlap] = fit_params(_lora_dropout, TokenData(n=42), strategy=strategy, **kw)
    start = fit_params(_lora_dropout, TokenData(), max_steps=0)
    assert max_diff(got[True], start) > 1e-4  # trained
    assert max_diff(got[True], got[False]) <= 1e-5


def test_cuda_no_host_sync_inside_device_ops():
    """``torch.cuda.set_sync_debug_mode("warn")`` around the steps after the first (process-global: armed
    in "warn", so a sync raises nowhere and is attributed to its thread): no synchronizing CUDA call on
    any of RoundPipe's device stream threads (a layer turning a device tensor into a Python value
    blocks its issuing thread until the GPU catches up). Padded batches (the mask path) and Qwen3."""
    import threading
    import warnings

    syncs: list[tuple[str, str]] = []

    class Armed(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:  # the first step warms up (allocations, cuBLAS handles)
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_end(self, trainer, pl_module):
            torch.cuda.set_sync_debug_mode("default")

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            syncs.append((threading.current_thread().name, f"{filename}:{lineno}"))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        try:
            trainer(_strategy(num_microbatches=3), devices="auto", accelerator="cuda", precision="bf16-mixed",
                    max_steps=3, callbacks=[Armed()]).fit(CausalLMModule(tiny_hf("qwen3")), loader(TokenData()))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    inside = [(thread, where) for thread, where in syncs if thread.startswith("roundpipe-device")]
    assert inside == [], inside


def test_cuda_device_peak_memory_against_the_planner():
    """Per GPU, ``torch.cuda.max_memory_allocated`` during a step (the allocator's own view: pools, banks,
    transfer slots, accumulators, activations, workspaces) against the planner's modelled per-device
    peak (:func:`~lightning_roundpipe.partition.seqlen.peak_device_memory_bytes`, summed over the
    logical devices sharing the GPU): within 10 %, never below the measured peak by more than 5 %
    (DESIGN.md section 4, "one memory model")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_roundpipe.partition.costmodel import ModelShape, model_profiles
    from lightning_roundpipe.partition.profile import HardwareModel
    from lightning_roundpipe.partition.seqlen import peak_device_memory_bytes

    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    devices = _devices()
    gpus = sorted({d.index for d in devices})
    measured: dict[int, int] = {}
    stages: list = []

    class Peaks(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            for i in gpus:
                torch.cuda.synchronize(i)
                torch.cuda.reset_peak_memory_stats(i)

        def on_train_batch_end(self, trainer, *args):
            for i in gpus:
                torch.cuda.synchronize(i)
                measured[i] = max(measured.get(i, 0), int(torch.cuda.max_memory_allocated(i)))
            stages[:] = [("fused" if s.fused else s.kind, s.layers) for s in trainer.strategy.engine.fused_stages]

    seq_len, batch, microbatches = 256, 8, 4
    data = torch.utils.data.DataLoader(
        [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 8192, (batch * 3, seq_len))], batch_size=batch)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    trainer(_strategy(num_microbatches=microbatches, partition="default"), devices="auto", accelerator="cuda",
            max_steps=3, callbacks=[Peaks()]).fit(Module(), data)
    hardware = HardwareModel(flops_per_s=1e12, h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10)
    modelled = model_profiles(ModelShape.from_config(config), hardware, seq_len=seq_len,
                              microbatch_size=batch // microbatches, compute_dtype_bytes=4)
    planned = peak_device_memory_bytes(modelled, stages, len(devices), microbatches)
    for i in gpus:
        sharing = sum(d.index == i for d in devices)
        expected = planned * sharing
        assert 0.95 * measured[i] <= expected <= 1.10 * measured[i], (i, measured[i], expected)
