"""The Python steps of ``scripts/gpu_check.sh``: parity, throughput, a CUDA sanitizer run, and the mode
steps of :mod:`gpu_check_modes` (``dropout_accum``, ``async_steady``, ``fp8_lora``).

    python benchmarks/gpu_check.py parity     --json out/parity.json       # bf16-mixed parity with plain Lightning
    python benchmarks/gpu_check.py throughput --json out/throughput.json   # tokens/s, MFU, predicted step, memory
    TORCH_CUDA_SANITIZER=1 python benchmarks/gpu_check.py sanitizer --tiny --json out/sanitizer.json
    python benchmarks/gpu_check.py throughput --accelerator cpu --tiny      # the same code on 2 CPU virtual devices

The default model is Qwen3-1.7B-shaped with random weights (``transformers.Qwen3Config``: 28 layers,
hidden 2048, MLP 6144, 16 heads, 8 KV heads, head dim 128, vocab 151936, tied embeddings, SDPA
attention; nothing from the hub; initialised on the first GPU, then moved to the host), sequences of
2048 tokens, batch 4: large enough that a step is bound by compute and weight streaming, not by
kernel launches. ``--tiny`` is a 4-layer, hidden-64 model with 32-token sequences (the CPU tests run
this file with it on CPU virtual devices, so a GPU run cannot die for a trivial reason).

- ``parity``: plain single-device Lightning (``strategy="auto"``, ``devices=1``) and RoundPipe, both
  ``bf16-mixed``, the same initial weights and batches, SGD with momentum and gradient clipping, a
  few steps. Compared: the per-step losses (relative difference <= ``--loss-tol``, default 1e-2) and
  the whole parameter update (``||dW_roundpipe - dW_plain|| / ||dW_plain|| <= --update-tol``, default
  5e-2): bf16 keeps about 3 significant digits and the two runs sum the microbatches' gradients in
  another order, so they agree to bf16 noise, not bitwise.
- ``throughput``: the same model and batch, fused AdamW, no clipping. Every step is timed between
  ``torch.cuda.synchronize()`` calls on every GPU at batch start and batch end (the plain run and
  RoundPipe alike). Reported: tokens/s of both runs and their ratio; MFU (model FLOPs of
  :mod:`lightning_roundpipe.runtime.tuning.flops` / step time / (peak x physical GPUs)) against the datasheet
  peak (``PEAK_FLOPS``) and against a measured bf16 matmul peak; RoundPipe's measured step beside
  ``roundpipe/predicted_step(s)`` (the simulator on the measured layer times); peak memory per GPU
  (``torch.cuda.max_memory_allocated``, read before the strategy resets it at each step end) and the
  logged ``roundpipe/device{i}/peak_memory(GiB)``; the fraction of weight-upload time hidden under
  compute, from the measured Timeline (CUDA events on a GPU): per logical device and timed step, the
  union of the ``weights`` stream's spans intersected with the union of the ``compute`` spans, over
  the union of the ``weights`` spans; and the computes that started before a complete upload of
  their stage's weights had ended on that device (must be 0: the LOAD -> compute edge).
- ``sanitizer``: a small model, 2 steps of RoundPipe; run it under ``TORCH_CUDA_SANITIZER=1``.
  Torch enables the sanitizer (a dispatch mode, thread-local) in the main thread only, and RoundPipe
  launches its kernels from one issuing thread per (device, stream): this check also enters the
  sanitizer's mode in every CUDA stream thread of the runtime, and first proves that a race in such
  a thread is caught (a positive control: two streams writing one tensor without an event).

``--devices`` is a count, ``all``, or a comma list (``cuda:0,cuda:0,cuda:0,cuda:0``: four logical
workers on one GPU, given to the strategy as ``parallel_devices``); default every GPU, or 2 CPU
virtual devices. Each check writes its JSON (``--json``) after every phase, so a step killed by its
timeout still leaves what it measured; the exit code is 1 when a check fails (parity out of
tolerance, a non-finite value, a compute started before its weights were uploaded, the sanitizer
not active in the runtime's threads).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import lightning_roundpipe  # noqa: E402

QWEN3_1_7B = dict(layers=28, hidden=2048, intermediate=6144, heads=16, kv_heads=8, head_dim=128, vocab=151936,
                  seq_len=2048, batch_size=4)
TINY = dict(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=512, seq_len=32,
            batch_size=4)
GIB = float(2**30)


# ------------------------------------------------------------------------------------------ model
class RandomTokens(Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    """A random-weight Qwen3 causal LM of ``args``' shape, fp32 on the host, SDPA attention. On a GPU
    the weights are initialised there (seconds instead of a minute on the host), then moved."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      head_dim=args.head_dim, max_position_embeddings=max(args.seq_len, 64), tie_word_embeddings=True,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    if args.accelerator != "cuda":
        return Qwen3ForCausalLM(cfg)
    with torch.device(args.device_list[0]):
        model = Qwen3ForCausalLM(cfg)
    model = model.to("cpu")
    torch.cuda.empty_cache()
    return model


class LM(L.LightningModule):
    """``loss = model(**batch).loss``; keeps each step's loss (a detached tensor) in :attr:`losses`."""

    def __init__(self, model: torch.nn.Module, optimizer: str, lr: float) -> None:
        super().__init__()
        self.model = model
        self.optimizer_name = optimizer
        self.lr = lr
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]  # LoRA: the adapters only
        if self.optimizer_name == "adamw":  # fused: one kernel over all parameters, on the GPU or the host
            try:
                return torch.optim.AdamW(trainable, lr=self.lr, fused=True)
            except RuntimeError:  # a torch without the fused kernel for these parameters' device
                return torch.optim.AdamW(trainable, lr=self.lr)
        return torch.optim.SGD(trainable, lr=self.lr, momentum=0.9)


# ------------------------------------------------------------------------------------------ timing
def _sync(accelerator: str) -> None:
    if accelerator == "cuda":
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def _gpu_indices(devices: list[torch.device]) -> list[int]:
    return sorted({torch.cuda.current_device() if d.index is None else d.index for d in devices if d.type == "cuda"})


class PlainTimer(L.Callback):
    """Per-step wall time between synchronizes (plain Lightning training)."""

    def __init__(self, accelerator: str) -> None:
        self.accelerator = accelerator
        self.times: list[float] = []
        self._start = 0.0

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.accelerator == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, *args) -> None:
        _sync(self.accelerator)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        _sync(self.accelerator)
        self.times.append(time.perf_counter() - self._start)


class RoundPipeRecorder(lightning_roundpipe.RoundPipeMetricsCallback):
    """Per-step wall time between synchronizes, the step's measured timelines, the per-GPU
    ``max_memory_allocated`` (read before the strategy resets it at the end of each step) and the
    ``roundpipe/`` metrics logged at each step (this replaces the metrics callback the strategy
    would add, and does all it does)."""

    def __init__(self, accelerator: str) -> None:
        super().__init__()
        self.accelerator = accelerator
        self.times: list[float] = []
        self.timelines: list[list[Any]] = []
        self.gpu_peaks: list[dict[int, int]] = []
        self.logged: list[dict[str, float]] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, *args, **kwargs) -> None:
        _sync(self.accelerator)
        super().on_train_batch_start(trainer, *args, **kwargs)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _sync(self.accelerator)
        self.times.append(time.perf_counter() - self._start)
        engine = trainer.strategy.engine
        self.timelines.append(list(engine._timelines))  # the parent pops them below
        gpus = _gpu_indices(list(engine.devices))
        self.gpu_peaks.append({i: int(torch.cuda.max_memory_allocated(i)) for i in gpus})
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.logged.append(dict(self.last_metrics))  # this step's keys, as the parent logged them


# ------------------------------------------------------------------------------------------ analysis
def peak_flops(accelerator: str, devices: list[torch.device]) -> dict[str, float | None]:
    """The datasheet bf16 peak of the first device (``PEAK_FLOPS``; ``None`` if not listed or on the
    CPU) and a measured bf16 matmul peak (8192^3 GEMMs timed with CUDA events; 512^3 on the CPU)."""
    from lightning_roundpipe.runtime.tuning.flops import peak_flops_per_s

    if accelerator == "cuda":
        n, reps = 8192, 20
        a = torch.randn(n, n, device=devices[0], dtype=torch.bfloat16)
        b = torch.randn(n, n, device=devices[0], dtype=torch.bfloat16)
        with torch.cuda.device(devices[0]):
            for _ in range(3):
                a @ b
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                a @ b
            end.record()
            end.synchronize()
        measured = 2 * n**3 * reps / (start.elapsed_time(end) / 1e3)
        del a, b
        torch.cuda.empty_cache()
    else:
        n, reps = 512, 5
        a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
        a @ b
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        measured = 2 * n**3 * reps / (time.perf_counter() - t0)
    return {"datasheet": peak_flops_per_s(devices[0], torch.bfloat16), "measured_matmul": measured}


def model_flops_per_step(model: torch.nn.Module, tokens: int, seq_len: int) -> float:
    from lightning_roundpipe.adapters import make_layer_sequence
    from lightning_roundpipe.runtime.tuning.flops import layer_flops, step_model_flops

    return step_model_flops(layer_flops(make_layer_sequence(model).layers), tokens, seq_len)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _median(values: list[float]) -> float | None:
    values = [v for v in values if _finite(v)]
    return statistics.median(values) if values else None


# ------------------------------------------------------------------------------------------ runs
def parse_devices(spec: str | None, accelerator: str) -> list[torch.device]:
    """``None``/``"all"``: every GPU (2 CPU virtual devices on the CPU); a count; or a comma list."""
    if spec is None or spec == "all":
        if accelerator == "cuda":
            return [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")] * 2
    if spec.isdigit():
        n = int(spec)
        return [torch.device(f"cuda:{i}") for i in range(n)] if accelerator == "cuda" else [torch.device("cpu")] * n
    return [torch.device(s.strip()) for s in spec.split(",") if s.strip()]


def fit(args: argparse.Namespace, model: torch.nn.Module, roundpipe: bool, steps: int, optimizer_name: str, lr: float,
        clip: float | None = None, batch_size: int | None = None, accumulate_grad_batches: int = 1,
        **strategy_kw: Any) -> tuple[LM, Any]:
    """One ``bf16-mixed`` fit of ``steps`` optimizer steps of ``accumulate_grad_batches`` batches of
    ``batch_size`` rows (default ``args.batch_size``; ``gradient_clip_val=clip``); returns the module
    (moved to the host) and its recorder. A fit that raises (a CUDA OOM) leaves its module on the host
    and the caching allocator emptied before the error goes on."""
    module = LM(model, optimizer_name, lr)
    batch_size = batch_size or args.batch_size
    if roundpipe:
        recorder: Any = RoundPipeRecorder(args.accelerator)
        strategy: Any = lightning_roundpipe.RoundPipeStrategy(
            num_microbatches=args.num_microbatches, parallel_devices=args.device_list, trace_every_n_steps=0,
            device_memory_bytes=args.device_memory_bytes, **strategy_kw)
        devices: Any = "auto"  # the strategy's parallel_devices (one GPU may be given several times)
    else:
        recorder, strategy, devices = PlainTimer(args.accelerator), "auto", 1
    trainer = L.Trainer(accelerator=args.accelerator, devices=devices, strategy=strategy, precision="bf16-mixed",
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder],
                        gradient_clip_val=clip, log_every_n_steps=1, default_root_dir=args.root_dir,
                        accumulate_grad_batches=accumulate_grad_batches)
    data = DataLoader(RandomTokens(batch_size * steps * accumulate_grad_batches, args.seq_len, args.vocab),
                      batch_size=batch_size)
    try:
        trainer.fit(module, data)
    finally:
        module.cpu()
        del trainer
        gc.collect()
        if args.accelerator == "cuda":
            torch.cuda.empty_cache()
    return module, recorder


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a device out-of-memory error (``torch.OutOfMemoryError`` or CUDA's message)."""
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(error, oom) or (isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def plain_fit(args: argparse.Namespace, make: Any, steps: int, optimizer: str, lr: float,
              clip: float | None = None) -> tuple[LM, PlainTimer, int, str | None]:
    """The plain single-device baseline at ``args.batch_size``, halved after each out-of-memory error
    (down to 1 row): the Qwen3-1.7B-shaped baseline without activation checkpointing peaks around
    70-75 GiB at batch 4, more than a GPU below 80 GB holds. ``make()`` gives a fresh model copy.

    Returns:
        ``(module, timer, batch size run, fallback)``: ``fallback`` says what was lowered (``None``:
        nothing).

    Raises:
        What the fit raised, when it is not an OOM or the batch is 1 already.
    """
    batch, failed = args.batch_size, []
    while True:
        try:
            module, timer = fit(args, make(), False, steps, optimizer, lr, clip, batch_size=batch)
        except BaseException as error:  # noqa: BLE001 - re-raised unless an OOM with a smaller batch left
            if batch <= 1 or not is_out_of_memory(error):
                raise
            failed.append(batch)
            batch //= 2
            continue
        note = None if not failed else (f"plain single-device run out of memory at batch {', '.join(map(str, failed))};"
                                        f" ran at batch {batch}")
        return module, timer, batch, note


class Report:
    """The check's JSON, rewritten after every phase (a killed step still leaves what it measured)."""

    def __init__(self, path: str | None, check: str, args: argparse.Namespace) -> None:
        import transformers

        self.path = path
        self.data: dict[str, Any] = {
            "check": check, "ok": None, "accelerator": args.accelerator,
            "devices": [str(d) for d in args.device_list],
            "model": {k: getattr(args, k) for k in QWEN3_1_7B}, "tiny": args.tiny,
            "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "lightning": L.__version__,
                         "transformers": transformers.__version__, "python": sys.version.split()[0]}}
        if args.accelerator == "cuda":
            self.data["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        self.write()

    def write(self) -> None:
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=2, default=str)
            os.replace(tmp, self.path)

    def update(self, **kw: Any) -> None:
        self.data.update(kw)
        self.write()


def check_parity(args: argparse.Namespace, report: Report) -> bool:
    base = make_model(args)
    start = {k: v.detach().clone() for k, v in base.state_dict().items()}
    report.update(parameters=sum(p.numel() for p in base.parameters()), steps=args.parity_steps, optimizer="sgd",
                  lr=args.lr, gradient_clip_val=args.clip)
    t0 = time.perf_counter()
    plain, _, batch, fallback = plain_fit(args, lambda: copy.deepcopy(base), args.parity_steps, "sgd", args.lr, args.clip)
    args = copy.copy(args)
    args.batch_size = batch  # RoundPipe on the batches the baseline ran
    report.update(plain_losses=[float(x) for x in plain.losses], plain_fit_s=time.perf_counter() - t0,
                  batch_size=batch, plain_fallback=fallback)
    ref = {k: v.detach().clone() for k, v in plain.model.state_dict().items()}
    del plain
    t0 = time.perf_counter()
    rp, _ = fit(args, base, True, args.parity_steps, "sgd", args.lr, args.clip, partition="default")
    report.update(roundpipe_losses=[float(x) for x in rp.losses], roundpipe_fit_s=time.perf_counter() - t0)
    got = rp.model.state_dict()
    num = den = 0.0
    max_abs = 0.0
    for k, s in start.items():
        d_ref, d_got = ref[k].double() - s.double(), got[k].detach().double() - s.double()
        num += float(((d_ref - d_got) ** 2).sum())
        den += float((d_ref ** 2).sum())
        max_abs = max(max_abs, float((ref[k] - got[k]).abs().max()))
    losses = list(zip(report.data["plain_losses"], report.data["roundpipe_losses"]))
    loss_rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in losses]
    update_rel = math.sqrt(num) / math.sqrt(den) if den > 0 else float("nan")
    ok = (len(losses) == args.parity_steps and all(_finite(a) and _finite(b) for a, b in losses)
          and max(loss_rel, default=math.inf) <= args.loss_tol and den > 0 and update_rel <= args.update_tol)
    report.update(loss_rel_diff=loss_rel, loss_tol=args.loss_tol, update_rel_error=update_rel,
                  update_tol=args.update_tol, param_max_abs_diff=max_abs, ok=ok)
    return ok


def check_throughput(args: argparse.Namespace, report: Report) -> bool:
    devices = args.device_list
    peaks = peak_flops(args.accelerator, devices)
    physical = len(_gpu_indices(devices)) if args.accelerator == "cuda" else 1
    base = make_model(args)
    tokens = args.batch_size * args.seq_len
    flops = model_flops_per_step(base, tokens, args.seq_len)
    report.update(peak_flops=peaks, physical_devices=physical, tokens_per_step=tokens, model_flops_per_step=flops,
                  parameters=sum(p.numel() for p in base.parameters()), optimizer="adamw (fused)",
                  timed_steps=args.steps)

    def mfu(step_s: float, n: int) -> dict[str, float | None]:
        return {k: (flops / step_s / (v * n) if v else None) for k, v in peaks.items()}

    _, timer, plain_batch, fallback = plain_fit(args, lambda: copy.deepcopy(base), args.warmup + args.steps, "adamw",
                                                args.lr)
    plain_step = statistics.median(timer.times[args.warmup:])
    plain_tokens = plain_batch * args.seq_len
    plain_flops = model_flops_per_step(base, plain_tokens, args.seq_len)
    plain_peak = torch.cuda.max_memory_allocated(devices[0]) / GIB if args.accelerator == "cuda" else None
    report.update(plain={"step_s": timer.times, "median_step_s": plain_step, "tokens_per_s": plain_tokens / plain_step,
                         "batch_size": plain_batch, "fallback": fallback,
                         "mfu": {k: (v * plain_flops / flops if v is not None else None)
                                 for k, v in mfu(plain_step, 1).items()},
                         "peak_memory_gib": plain_peak})
    if args.accelerator == "cuda":
        for i in _gpu_indices(devices):
            torch.cuda.reset_peak_memory_stats(i)

    skip = args.profile_steps + args.warmup
    _, rec = fit(args, base, True, skip + args.steps, "adamw", args.lr, partition="auto",
                 profile_steps=args.profile_steps)
    timed = slice(skip, None)
    rp_step = statistics.median(rec.times[timed])
    logged = rec.logged[timed]

    def logged_median(key: str) -> float | None:
        return _median([r[key] for r in logged if key in r])

    pred = logged_median("roundpipe/predicted_step(s)")
    n = len(devices)
    logged_peaks = {i: max((r[f"roundpipe/device{i}/peak_memory(GiB)"] for r in logged
                            if f"roundpipe/device{i}/peak_memory(GiB)" in r), default=None) for i in range(n)}
    gpu_peaks = {i: max(p.get(i, 0) for p in rec.gpu_peaks[timed]) / GIB for i in _gpu_indices(devices)} or None
    overlap = upload_overlap([tl for step in rec.timelines[timed] for tl in step])
    roundpipe = {"step_s": rec.times, "median_step_s": rp_step, "tokens_per_s": tokens / rp_step,
                 "mfu": mfu(rp_step, physical),
                 "logged_step_s": logged_median("roundpipe/step(s)"),
                 "logged_optimizer_s": logged_median("roundpipe/optimizer(s)"),
                 "logged_bubble_pct": logged_median("roundpipe/bubble(%)"),
                 "predicted_step_s": pred,
                 "predicted_vs_measured": (pred - rp_step) / rp_step if pred is not None else None,
                 "logged_tokens_per_s": logged_median("roundpipe/tokens_per_s"),
                 "logged_mfu_pct": logged_median("roundpipe/mfu(%)"),
                 "peak_memory_gib_per_gpu": gpu_peaks, "logged_peak_memory_gib_per_device": logged_peaks,
                 **overlap}
    report.update(roundpipe=roundpipe,
                  ratio_roundpipe_over_plain=roundpipe["tokens_per_s"] / report.data["plain"]["tokens_per_s"])
    frac = overlap["hidden_upload_fraction"]
    problems = []
    if not (_finite(plain_tokens / plain_step) and _finite(tokens / rp_step)):
        problems.append("a non-finite step time")
    if pred is None:
        problems.append("no roundpipe/predicted_step(s) logged in the timed steps")
    if frac is None or not 0.0 <= frac <= 1.0:
        problems.append(f"hidden upload fraction {frac!r} (no weight upload measured?)")
    if overlap["computes"] == 0 or overlap["computes_before_their_upload"]:
        problems.append(f"{overlap['computes_before_their_upload']} of {overlap['computes']} computes started"
                        " before their stage's weights were uploaded")
    if not all(_finite(v) and v > 0 for v in logged_peaks.values()):
        problems.append(f"per-device peak memory not logged: {logged_peaks}")
    report.update(problems=problems, ok=not problems)
    return not problems


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_modes import mode_checks  # noqa: E402
from gpu_check_sanitizer import check_sanitizer  # noqa: E402
from gpu_check_timeline import upload_overlap  # noqa: E402


class _ThisModule:
    """This module's globals as attributes, read at call time (also when it is loaded from its file path)."""

    def __getattr__(self, name: str) -> Any:
        return globals()[name]


CHECKS = {"parity": check_parity, "throughput": check_throughput,
          "sanitizer": lambda args, report: check_sanitizer(_ThisModule(), args, report), **mode_checks(_ThisModule())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("check", choices=sorted(CHECKS))
    p.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--devices", default=None,
                   help="a count, 'all', or a comma list such as cuda:0,cuda:0 (logical workers on one GPU)")
    p.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 model, 32 tokens")
    for k, v in QWEN3_1_7B.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v} (--tiny: {TINY[k]})")
    p.add_argument("--num-microbatches", type=int, default=None)
    p.add_argument("--parity-steps", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=2, help="RoundPipe's profiled steps (throughput; not timed)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after those (and of the plain run)")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--lr", type=float, default=None, help="default: 1e-2 (parity, SGD), 1e-5 (AdamW)")
    p.add_argument("--clip", type=float, default=1.0, help="parity: gradient_clip_val (throughput: none; Lightning"
                   " does not clip with a fused optimizer under mixed precision)")
    p.add_argument("--loss-tol", type=float, default=1e-2)
    p.add_argument("--mode-loss-tol", type=float, default=1e-2, help="dropout_accum, async_steady: loss tolerance")
    p.add_argument("--fp8-loss-tol", type=float, default=5e-2, help="fp8_lora: fp8 vs compute-dtype frozen weights")
    p.add_argument("--mode-steps", type=int, default=3, help="optimizer steps of dropout_accum, async_steady, fp8_lora")
    p.add_argument("--update-tol", type=float, default=5e-2)
    p.add_argument("--device-memory-bytes", type=int, default=None,
                   help="RoundPipe's device memory budget (CPU virtual devices: enables the peak memory metric)")
    p.add_argument("--json", default=None, help="write the check's results here")
    p.add_argument("--root-dir", default=None, help="Trainer default_root_dir (default: a temporary folder)")
    args = p.parse_args(argv)
    preset = TINY if args.tiny else QWEN3_1_7B
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.lr is None:
        args.lr = 1e-2 if args.check == "parity" else 1e-5
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        p.error("--accelerator cuda: CUDA is not available (torch.cuda.is_available() is False); use --accelerator cpu")
    try:
        args.device_list = parse_devices(args.devices, args.accelerator)
    except RuntimeError as error:
        p.error(f"--devices {args.devices!r}: {error}")
    if not args.device_list or any(d.type != args.accelerator for d in args.device_list):
        p.error(f"--devices {args.devices!r}: give {args.accelerator} devices")
    if args.root_dir is None:
        import tempfile

        args.root_dir = tempfile.mkdtemp(prefix="roundpipe-gpu-check-")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report(args.json, args.check, args)
    t0 = time.perf_counter()
    try:
        ok = CHECKS[args.check](args, report)
    except BaseException as e:
        report.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], wall_s=time.perf_counter() - t0)
        raise
    report.update(wall_s=time.perf_counter() - t0)
    print(json.dumps(report.data, indent=2, default=str))
    print(f"gpu_check {args.check}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
