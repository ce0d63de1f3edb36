"""`roundpipe plan`'s stage table: one row per stage, alike neighbours sharing a row. Pure formatting."""

from __future__ import annotations

from typing import Any

from lightning_roundpipe.partition.partitioner import StageSummary

GiB = 2**30


def stage_table(r: Any, full: bool = False) -> str:
    """One row per stage; runs of 3+ identical consecutive stages share a row (``x N``) unless ``full``."""
    head = (f"{'stage':>7} {'kind':<8} {'layers':<11} {'layers/stage':>12} {'weights GiB':>11} {'grads GiB':>9}"
            f" {'mem GiB':>7} {'compute ms':>10} {'upload ms':>9}")
    rows = [head, "-" * len(head)]
    L = len(r.modelled.profiles)
    groups: list[list[StageSummary]] = []
    for s in r.stages:
        key = (s.kind, len(s.layers), s.param_bytes, s.grad_bytes, s.memory_bytes, round(s.cost_s, 9))
        prev = groups[-1][-1] if groups else None
        same = prev is not None and key == (prev.kind, len(prev.layers), prev.param_bytes, prev.grad_bytes,
                                            prev.memory_bytes, round(prev.cost_s, 9))
        if same and not full:
            groups[-1].append(s)
        else:
            groups.append([s])
    for g in groups:
        if len(g) < 3:
            rows += [stage_row(r, [s], L) for s in g]
        else:
            rows.append(stage_row(r, g, L))
    rows.append("  (* holds the prefix (layer 0: embedding) or the tail (last layer: norm, LM head, loss); `a-b xN`: N stages"
                " alike; compute ms per stage and microbatch: forward, or recompute + backward, or the tail's forward + backward)")
    return "\n".join(rows)


def stage_row(r: Any, group: list[StageSummary], num_layers: int) -> str:
    s = group[0]
    lo = min(x.layers.start for x in group)
    hi = max(x.layers.stop for x in group) - 1
    label = f"{lo}..{hi}" if hi > lo else f"{lo}"
    if num_layers > 2 and (lo == 0 or hi == num_layers - 1):
        label += "*"
    idx = f"{group[0].stage_index}" if len(group) == 1 else f"{group[0].stage_index}-{group[-1].stage_index}"
    per = f"{len(s.layers)}" if len(group) == 1 else f"{len(s.layers)} x{len(group)}"
    upload_ms = 1e3 * s.param_bytes / r.hardware.h2d_bytes_per_s
    return (f"{idx:>7} {s.kind:<8} {label:<11} {per:>12} {s.param_bytes / GiB:>11.2f} {s.grad_bytes / GiB:>9.2f}"
            f" {s.memory_bytes / GiB:>7.2f} {1e3 * s.cost_s:>10.1f} {upload_ms:>9.1f}")
