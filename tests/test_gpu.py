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


def _gpu_check():
    """``benchmarks/gpu_check.py`` as a module (its timeline analysis is shared with these tests)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("roundpipe_gpu_check", path)
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
    overlap = _gpu_check().upload_overlap(seen)
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
