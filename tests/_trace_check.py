"""The checks a Chrome/Perfetto trace file must pass (shared by the trace tests)."""

from __future__ import annotations

import json
from collections import defaultdict


def check_trace(doc: dict, num_devices: int) -> dict[tuple[int, int], list[dict]]:
    """The schema checks Perfetto's JSON importer needs; returns the X spans per (pid, tid)."""
    json.loads(json.dumps(doc))  # plain JSON values only
    assert set(doc) >= {"traceEvents", "displayTimeUnit"} and doc["displayTimeUnit"] in ("ms", "ns")
    events = doc["traceEvents"]
    assert events
    for event in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= set(event), event
        assert event["ph"] in ("X", "M", "C"), event
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
        if event["ph"] == "X":
            assert event["dur"] >= 0
        if event["ph"] == "C":
            assert event["args"] and all(isinstance(v, (int, float)) for v in event["args"].values())
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    device_pids = [pid for pid, name in processes.items() if "host" not in name]
    assert sorted(device_pids) == list(range(num_devices)), processes  # one process row per device
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    rows: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            assert (event["pid"], event["tid"]) in threads, event  # every span is on a named row
            rows[(event["pid"], event["tid"])].append(event)
    for key, spans in rows.items():
        spans.sort(key=lambda e: e["ts"])
        for before, after in zip(spans, spans[1:]):
            assert before["ts"] + before["dur"] <= after["ts"] + 1e-6, (threads[key], before, after)
    return rows
