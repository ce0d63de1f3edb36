"""Timeline analysis of ``benchmarks/gpu_check.py``'s ``throughput`` check (and of ``tests/test_gpu.py``):
how much of the weight uploads measured on each device was hidden under compute, and whether any compute
started before its stage's upload had ended. Pure Python over
:class:`~lightning_roundpipe.metrics.timeline.Timeline` objects (their ``intervals``: ``start_s``/``end_s``
in seconds, ``nbytes`` in bytes); imports neither torch nor Lightning."""

from __future__ import annotations

import math
import re
from typing import Any

EPS_S = 5e-5  # timer resolution allowed when comparing spans of one device (CUDA events: ~0.5 us)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint span lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


_ROUND = re.compile(r"@(\d+)$")


def upload_overlap(timelines: list[Any]) -> dict[str, Any]:
    """From measured timelines (one per program): the weight-upload seconds (union of the ``weights``
    stream's spans that moved bytes, per logical device), the part of them under compute on the same
    device, their ratio, the number of chunks, and the computes that started before every chunk of
    one upload of their stage (a ``LOAD``: the chunks of one dispatch, ``"3LOAD.c1@2"``) had ended on
    that device: 0 when the program's LOAD -> compute edges held."""
    upload = hidden = 0.0
    chunks = violations = computes_seen = 0
    for tl in timelines:
        for d in range(tl.num_devices):
            mine = [i for i in tl.intervals if i.device_index == d]
            weights = [i for i in mine if i.stream == "weights"]
            computes = [i for i in mine if i.is_compute]
            w = _union([(i.start_s, i.end_s) for i in weights if i.nbytes])
            c = _union([(i.start_s, i.end_s) for i in computes])
            upload += _length(w)
            hidden += _intersection(w, c)
            chunks += sum(1 for i in weights if i.nbytes)
            loads: dict[tuple[int, int], float] = {}  # (stage, round) -> end of its last chunk
            for i in weights:
                match = _ROUND.search(i.label)
                key = (i.stage_index, int(match.group(1)) if match else 0)
                loads[key] = max(loads.get(key, -math.inf), i.end_s)
            for comp in computes:
                computes_seen += 1
                ends = [end for (stage, _), end in loads.items() if stage == comp.stage_index]
                if not any(end <= comp.start_s + EPS_S for end in ends):
                    violations += 1
    return {"weight_upload_s": upload, "weight_upload_hidden_s": hidden,
            "hidden_upload_fraction": hidden / upload if upload > 0 else None,
            "weight_chunks": chunks, "computes": computes_seen, "computes_before_their_upload": violations}
