"""CUDA path (marked `gpu`, skipped without a GPU): run by `scripts/gpu_check.sh` on a GPU machine.

The workers come from ``ROUNDPIPE_GPU_TEST_DEVICES``: ``all`` (default: every GPU) or a comma list
of CUDA devices, where one GPU may appear several times (``cuda:0,cuda:0,cuda:0,cuda:0``: four
logical workers on one GPU, each with its own streams, so stages go round-robin and waits cross
streams even on a one-GPU machine).
"""

import os

import pytest
import torch

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, fit_params, max_diff, tiny_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

#: Trainer arguments of every RoundPipe run here: the workers are the strategy's ``parallel_devices``.
CUDA = dict(accelerator="cuda", devices="auto")


def _devices() -> list[torch.device]:
    spec = os.environ.get("ROUNDPIPE_GPU_TEST_DEVICES", "all").strip()
    if spec in ("", "all"):
        return [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    return [torch.device(d.strip()) for d in spec.split(",") if d.strip()]


def _roundpipe(**kw) -> lightning_roundpipe.RoundPipeStrategy:
    return lightning_roundpipe.RoundPipeStrategy(parallel_devices=_devices(), **kw)


def test_cuda_parity_fp32():
    kw = dict(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
    ref = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(), **kw)  # CPU reference
    got = fit_params(lambda: CausalLMModule(tiny_hf("llama")), TokenData(),
                     strategy=_roundpipe(num_microbatches=3), **CUDA, **kw)
    assert max_diff(ref, got) <= 1e-4  # CUDA vs CPU kernels differ slightly
    assert all(p.device.type == "cpu" for p in got.values())


def test_cuda_bf16_mixed_trains():
    module = CausalLMModule(tiny_hf("qwen3"))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    from _helpers import loader, trainer

    t = trainer(_roundpipe(), precision="bf16-mixed", max_steps=3, **CUDA)
    t.fit(module, loader(TokenData()))
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in module.parameters())
    assert any(not torch.equal(before[n], p) for n, p in module.named_parameters())


def test_cuda_bf16_mixed_parity_with_plain_single_gpu_training():
    """bf16-mixed RoundPipe vs Lightning's own bf16-mixed on one GPU: the same updates up to bf16 noise."""
    kw = dict(max_steps=3, precision="bf16-mixed", accelerator="cuda")
    make = lambda: CausalLMModule(tiny_hf("llama"), lr=0.05)  # noqa: E731
    start = fit_params(make, TokenData(), max_steps=0)
    ref = fit_params(make, TokenData(), devices=1, **kw)
    got = fit_params(make, TokenData(), strategy=_roundpipe(num_microbatches=3), **{**kw, **CUDA})
    update_ref = {k: ref[k].cpu() - start[k] for k in start}
    update_got = {k: got[k] - start[k] for k in start}
    num = sum(((update_ref[k] - update_got[k]) ** 2).sum().item() for k in start) ** 0.5
    den = sum((update_ref[k] ** 2).sum().item() for k in start) ** 0.5
    assert den > 0 and num / den < 0.05  # relative error of the whole update; bf16 has ~3 significant digits


def test_cuda_weight_chunks_finish_before_their_stage_computes():
    """From CUDA events, per worker: no weight chunk of a stage is still uploading when that stage starts
    computing there (the LOAD -> compute event edge), and the uploads share the step with compute.
    How much upload time is hidden under compute is measured on a real-sized model by
    ``benchmarks/gpu_check.py throughput`` (a hidden-32 model is launch-bound: no overlap to assert)."""
    seen = []

    class Spy(lightning_roundpipe.RoundPipeMetricsCallback):
        def on_train_batch_end(self, trainer, *args, **kwargs):
            seen.extend(trainer.strategy.engine._timelines)
            super().on_train_batch_end(trainer, *args, **kwargs)

    fit_params(lambda: CausalLMModule(tiny_hf("llama", layers=8)), TokenData(), max_steps=2, callbacks=[Spy()],
               strategy=_roundpipe(num_microbatches=4, partition="default"), **CUDA)
    assert seen
    used = set()
    for tl in seen:
        for d in range(tl.num_devices):
            loads = [i for i in tl.intervals if i.device_index == d and i.stream == "weights" and i.nbytes]
            computes = [i for i in tl.intervals if i.device_index == d and i.is_compute]
            if computes:
                used.add(d)
                assert loads, f"device {d} computed without a weight upload"
            for c in computes:
                late = [w.label for w in loads if w.stage_index == c.stage_index and w.start_s < c.start_s
                        and w.end_s > c.start_s + 5e-5]  # 50 us: CUDA event timer resolution with margin
                assert not late, f"device {d}: {late} still uploading when {c.label} started"
    assert used == set(range(len(_devices())))  # round-robin reached every worker


def test_cuda_bf16_mixed_gradient_error_does_not_grow_with_microbatches():
    from test_numerics import _grad_errors

    (one, sixteen), _ = _grad_errors("mlp", [1, 16], _devices())
    assert 0 < one < 5e-2 and sixteen <= 1.1 * one, (one, sixteen)


def test_cuda_in_place_ops_parity():
    from test_numerics import InPlaceMLP
    from _helpers import VectorData

    kw = dict(max_steps=3, accumulate_grad_batches=2)
    ref = fit_params(InPlaceMLP, VectorData(), **kw)  # CPU reference
    got = fit_params(InPlaceMLP, VectorData(), strategy=_roundpipe(num_microbatches=3), **CUDA, **kw)
    assert max_diff(ref, got) <= 1e-4


def test_cuda_lora_frozen_base_is_pinned_bf16_during_fit():
    from peft import LoraConfig, get_peft_model
    from _helpers import loader, trainer

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

    trainer(_roundpipe(), precision="bf16-mixed", max_steps=2, callbacks=[Spy()], **CUDA).fit(module, loader(TokenData()))
    assert seen == [True, True]
    assert all(p.dtype == torch.float32 and not p.is_pinned() and p.device.type == "cpu" for p in module.parameters())


def test_cuda_moe_parity_with_routing_replay_and_aux_loss():
    """Qwen3-MoE and GPT-OSS with the load-balancing loss on CUDA: routing recorded into pinned host
    memory without blocking the compute stream, replayed on the recomputing GPU."""
    from test_moe import tiny_moe

    kw = dict(max_steps=2, accumulate_grad_batches=2, gradient_clip_val=0.5)
    for kind in ("qwen3_moe", "gpt_oss"):
        ref = fit_params(lambda: CausalLMModule(tiny_moe(kind)), TokenData(n=28), **kw)  # CPU reference
        got = fit_params(lambda: CausalLMModule(tiny_moe(kind)), TokenData(n=28), strategy=_roundpipe(num_microbatches=3),
                         **CUDA, **kw)
        assert max_diff(ref, got) <= 1e-4, kind  # CUDA vs CPU kernels differ slightly


def test_cuda_step_trace_and_mfu(tmp_path):
    """The CUDA timeline (CUDA-event spans) gives a valid trace, and MFU is logged for a GPU of the table."""
    import json

    from lightning.pytorch.loggers import CSVLogger

    from _helpers import loader, trainer
    from _trace_check import check_trace
    from lightning_roundpipe.runtime.flops import PEAK_FLOPS

    strategy = _roundpipe(num_microbatches=3, profile_steps=2, trace_every_n_steps=1)
    t = trainer(strategy, precision="bf16-mixed", max_steps=3, logger=CSVLogger(tmp_path), log_every_n_steps=1, **CUDA)
    t.fit(CausalLMModule(tiny_hf("llama")), loader(TokenData(), batch_size=8))
    traces = sorted((tmp_path / "lightning_logs" / "version_0" / "roundpipe").glob("trace_step*.json"))
    assert [p.name for p in traces] == ["trace_step000003.json"]
    check_trace(json.loads(traces[0].read_text()), num_devices=len(_devices()))
    if any(fragment in torch.cuda.get_device_name(0) for fragment in PEAK_FLOPS):
        assert 0 < float(t.callback_metrics["roundpipe/mfu(%)"]) < 100
