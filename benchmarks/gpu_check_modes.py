"""The mode steps of ``scripts/gpu_check.sh`` (DESIGN.md section 10: "its steps cover the modes users run,
not only the simplest"): the settings under which the review of issue 30 found failures a plain run
does not show. Each runs a small slice of the Qwen3-1.7B shape (``--layers``; the script passes 4) with
the check's batch and sequence, and reports per-step losses, the median step (s, timed between
synchronizes after ``--warmup`` steps), tokens/s and, on a GPU, ``torch.cuda.max_memory_allocated``
per GPU (GiB).

- ``dropout_accum``: PEFT LoRA with ``lora_dropout=0.1``, ``accumulate_grad_batches=2``, the sync
  optimizer, so the accumulated batches overlap (``overlap_batches=True``, the default); the same run
  with ``overlap_batches=False`` is the oracle: the overlap changes when work runs, never what is
  computed, so both runs' losses agree within ``--mode-loss-tol`` (the RNG race of issue 30 raised
  ``ValueError`` here).
- ``async_steady``: full fine-tuning with ``optimizer="async"`` in its steady state (step ``j + 1``'s
  pipeline issued while step ``j``'s drains, the optimizer step on a host thread), beside the same
  run with ``optimizer="sync"``: the first step's loss (both on the initial weights) within
  ``--mode-loss-tol``, every loss finite, and the optimizer thread's busy and the main thread's wait
  seconds (``roundpipe/optimizer_thread(s)``, ``roundpipe/optimizer_wait(s)``).
- ``fp8_lora``: LoRA with ``frozen_weights="fp8"`` beside the same run with the frozen weights in
  the compute dtype: losses within ``--fp8-loss-tol`` (fp8 rounds the frozen weights to ~2 significant
  digits), the logged host bytes per frozen matmul parameter (about 1) and the peak memory per GPU
  (the dequantised copies the plan must count).

Run through ``benchmarks/gpu_check.py`` (``python benchmarks/gpu_check.py dropout_accum ...``).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from typing import Any, Callable

import torch

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODES = ("dropout_accum", "async_steady", "fp8_lora")


def lora(model: torch.nn.Module, dropout: float) -> torch.nn.Module:
    """``model`` with PEFT LoRA adapters (rank 8, alpha 16) on every attention and MLP projection."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=LORA_TARGETS))


def mode_checks(core: Any) -> dict[str, Callable[[argparse.Namespace, Any], bool]]:
    """The mode checks, built on ``core`` (the ``benchmarks/gpu_check.py`` module: its ``fit``,
    ``make_model``, ``Report`` helpers)."""

    def run(args: argparse.Namespace, model: torch.nn.Module, steps: int, torch_optimizer: str,
            accumulate: int = 1, **strategy_kw: Any) -> dict[str, Any]:
        """One RoundPipe fit from torch's seed 0 (dropout draws the same numbers in every run); its
        losses (one per batch), step times and memory figures."""
        t0 = time.perf_counter()
        torch.manual_seed(0)
        module, rec = core.fit(args, model, True, steps, torch_optimizer, args.lr, accumulate_grad_batches=accumulate,
                               partition="default", **strategy_kw)
        timed = rec.times[args.warmup:] or rec.times
        step_s = statistics.median(timed) if timed else None
        tokens = args.batch_size * args.seq_len

        def logged(key: str) -> float | None:
            return core._median([r[key] for r in rec.logged[args.warmup:] if key in r])

        gpus = {i: max(p.get(i, 0) for p in rec.gpu_peaks) / core.GIB for i in core._gpu_indices(args.device_list)}
        return {"losses": [float(x) for x in module.losses], "step_s": rec.times, "median_step_s": step_s,
                "tokens_per_s": tokens / step_s if step_s else None, "fit_s": time.perf_counter() - t0,
                "peak_memory_gib_per_gpu": gpus or None,
                "logged_optimizer_thread_s": logged("roundpipe/optimizer_thread(s)"),
                "logged_optimizer_wait_s": logged("roundpipe/optimizer_wait(s)"),
                "logged_frozen_matmul_host_bytes_per_param": logged("roundpipe/frozen_matmul_host_bytes_per_param(bytes)"),
                "logged_peak_memory_gib_per_device": {
                    i: max((r[f"roundpipe/device{i}/peak_memory(GiB)"] for r in rec.logged
                            if f"roundpipe/device{i}/peak_memory(GiB)" in r), default=None)
                    for i in range(len(args.device_list))}}

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-12)

    def finite(losses: list[float], count: int) -> bool:
        return len(losses) == count and all(math.isfinite(x) for x in losses)

    def dropout_accum(args: argparse.Namespace, report: Any) -> bool:
        torch.manual_seed(0)
        model = lora(core.make_model(args), 0.1)
        steps, batches = args.mode_steps, 2 * args.mode_steps
        report.update(lora_dropout=0.1, accumulate_grad_batches=2, optimizer="adamw", steps=steps)
        overlapped = run(args, copy.deepcopy(model), steps, "adamw", accumulate=2)
        report.update(overlapped=overlapped)
        drained = run(args, model, steps, "adamw", accumulate=2, overlap_batches=False)
        diffs = [rel(a, b) for a, b in zip(overlapped["losses"], drained["losses"])]
        problems = []
        if not (finite(overlapped["losses"], batches) and finite(drained["losses"], batches)):
            problems.append(f"losses {overlapped['losses']} / {drained['losses']}")
        if max(diffs, default=math.inf) > args.mode_loss_tol:
            problems.append(f"overlapped vs not: loss relative differences {diffs} above {args.mode_loss_tol}")
        report.update(not_overlapped=drained, loss_rel_diff=diffs, loss_tol=args.mode_loss_tol, problems=problems,
                      ok=not problems)
        return not problems

    def async_steady(args: argparse.Namespace, report: Any) -> bool:
        base = core.make_model(args)
        steps = args.mode_steps
        report.update(optimizer="adamw", steps=steps)
        stale = run(args, copy.deepcopy(base), steps, "adamw", optimizer="async")
        report.update(async_run=stale)
        exact = run(args, base, steps, "adamw", optimizer="sync")
        problems = []
        if not (finite(stale["losses"], steps) and finite(exact["losses"], steps)):
            problems.append(f"losses {stale['losses']} / {exact['losses']}")
        first = rel(stale["losses"][0], exact["losses"][0]) if stale["losses"] and exact["losses"] else math.inf
        if not first <= args.mode_loss_tol:
            problems.append(f"first step's loss async vs sync: relative difference {first} above {args.mode_loss_tol}")
        if not (stale["logged_optimizer_thread_s"] or 0) > 0:
            problems.append("no optimizer step ran on the asynchronous optimizer thread")
        report.update(sync_run=exact, first_loss_rel_diff=first, loss_tol=args.mode_loss_tol,
                      step_ratio_async_over_sync=(stale["median_step_s"] / exact["median_step_s"]
                                                  if stale["median_step_s"] and exact["median_step_s"] else None),
                      problems=problems, ok=not problems)
        return not problems

    def fp8_lora(args: argparse.Namespace, report: Any) -> bool:
        torch.manual_seed(0)
        model = lora(core.make_model(args), 0.0)
        steps = args.mode_steps
        report.update(frozen_weights="fp8", optimizer="adamw", steps=steps)
        fp8 = run(args, copy.deepcopy(model), steps, "adamw", frozen_weights="fp8")
        report.update(fp8=fp8)
        full = run(args, model, steps, "adamw")
        diffs = [rel(a, b) for a, b in zip(fp8["losses"], full["losses"])]
        per_param = fp8["logged_frozen_matmul_host_bytes_per_param"]
        problems = []
        if not (finite(fp8["losses"], steps) and finite(full["losses"], steps)):
            problems.append(f"losses {fp8['losses']} / {full['losses']}")
        if max(diffs, default=math.inf) > args.fp8_loss_tol:
            problems.append(f"fp8 vs compute-dtype frozen weights: loss relative differences {diffs} above"
                            f" {args.fp8_loss_tol}")
        if per_param is None or not per_param <= 1.1:
            problems.append(f"host bytes per frozen matmul parameter {per_param} (fp8: about 1)")
        report.update(compute_dtype=full, loss_rel_diff=diffs, loss_tol=args.fp8_loss_tol, problems=problems,
                      ok=not problems)
        return not problems

    return {"dropout_accum": dropout_accum, "async_steady": async_steady, "fp8_lora": fp8_lora}
