"""The host cost of each staleness correction of ``optimizer="async"``, per trainable parameter.

What ``RoundPipeStrategy(optimizer="async", staleness_correction=...)`` adds to the host's ``OPT``
op (DESIGN.md section 11; ``runtime/host/staleness.py``), measured against that op itself: an
``AdamW(fused=True)`` step (the main job's optimizer) with ``clip_grad_norm_`` and the compute-copy
refresh (the fp32 masters copied into bf16 shadows), on ``--params`` fp32 parameters in
``--tensors`` tensors. Per correction, the work it adds to a stale step:

- ``weight_prediction``: ``W_prev = W`` before the update, and the snapshot written as
  ``W + (W - W_prev)`` instead of ``W`` (the difference of the two refreshes);
- ``delay_compensation``: ``W_prev = W`` before the update, ``g += lambda * g * g * (W - W_prev)``;
- ``gradient_extrapolation``: ``g += g - g_prev`` and keeping ``g`` as ``g_prev``.

Printed: milliseconds per step (median of ``--repeats``), nanoseconds per parameter, the share of
the ``OPT`` op, and that share as bytes per trainable parameter in the unit the simulator's optimizer
rate counts (fp32 Adam: 12 bytes per parameter, ``partition.profile.optimizer_step_bytes``); these
are the figures of ``partition.profile.STALENESS_CORRECTION_BYTES_PER_PARAM``. ``--threads``: torch
intra-op threads (default 1, as the optimizer thread on CPU virtual devices runs).

Run: ``python benchmarks/staleness_cost.py [--params 16e6] [--tensors 16] [--repeats 7] [--threads 1]``
(about 20 s on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_roundpipe.partition.profile import ADAM_COUNTED_BYTES_PER_PARAM
from lightning_roundpipe.runtime.host.staleness import CORRECTIONS, StalenessCorrection


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up (allocations, the optimizer state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=16e6)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    size = int(args.params) // args.tensors
    params = [torch.nn.Parameter(torch.randn(size, generator=generator) * 0.02) for _ in range(args.tensors)]
    for param in params:
        param.grad = torch.randn(size, generator=generator) * 1e-3
    shadows = [torch.empty(size, dtype=torch.bfloat16) for _ in params]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    names = [f"p{i}" for i in range(len(params))]

    def opt_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        with torch.no_grad():
            for shadow, param in zip(shadows, params):
                shadow.copy_(param)

    opt_s = _median_s(opt_step, args.repeats)
    numel = size * len(params)
    print(f"staleness corrections' host cost: {numel / 1e6:.1f} M fp32 parameters in {len(params)} tensors,"
          f" {args.threads} thread(s)")
    print(f"  OPT (clip + AdamW(fused=True) + bf16 snapshot refresh): {opt_s * 1e3:8.1f} ms"
          f" ({opt_s / numel * 1e9:.2f} ns/param)")
    saved = [p.grad.clone() for p in params]
    for kind in CORRECTIONS:
        correction = StalenessCorrection(kind, params, names, dc_lambda=0.04)

        def work() -> None:
            for param, grad in zip(params, saved):
                param.grad.copy_(grad)  # the same gradient each time (not timed apart: subtracted below)
            correction.before_update()
            correction.correct_gradients(stale=True)
            correction.commit(True)
            if correction.predicts_weights:
                with torch.no_grad():
                    for shadow, param in zip(shadows, params):
                        shadow.copy_(correction.predicted(param))

        def baseline() -> None:
            for param, grad in zip(params, saved):
                param.grad.copy_(grad)
            if correction.predicts_weights:
                with torch.no_grad():
                    for shadow, param in zip(shadows, params):
                        shadow.copy_(param)

        extra_s = max(0.0, _median_s(work, args.repeats) - _median_s(baseline, args.repeats))
        share = extra_s / opt_s
        print(f"  {kind:24s} +{extra_s * 1e3:7.1f} ms  ({extra_s / numel * 1e9:5.2f} ns/param, {share * 100:5.1f} % of OPT,"
              f" {share * ADAM_COUNTED_BYTES_PER_PARAM:4.1f} counted bytes/param; state"
              f" {correction.state_bytes() / numel:.0f} bytes/param)")


if __name__ == "__main__":
    main()
