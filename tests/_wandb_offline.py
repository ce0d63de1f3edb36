"""Read an offline W&B run (``offline-run-*/run-<id>.wandb``) back in a test.

wandb >= 0.19 (``wandb-core``) writes no ``files/config.yaml`` or ``wandb-summary.json`` in offline
mode (they appear only after ``wandb sync``), ``wandb.Api`` needs the server, and the Python
``wandb.sdk.internal.datastore`` reader is gone. The ``.wandb`` file is W&B's transaction log: a
7-byte header (``:W&B``, magic ``0xBEE1``, version 0), then LevelDB-log records (32 KiB blocks;
7-byte record headers: CRC32C, length, type FULL/FIRST/MIDDLE/LAST), each one serialised
``wandb.proto.wandb_internal_pb2.Record``. This module walks that framing (CRCs are not checked)
and decodes the records with the wandb package's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

HEADER = b":W&B"
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator[Any]:
    """The ``wandb_internal_pb2.Record`` s of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != HEADER:
        raise ValueError(f"{path} is not a W&B transaction log (header {data[:7]!r})")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding up to the block end
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield pb.Record.FromString(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pb.Record.FromString(pending + chunk)
            pending = b""


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class OfflineRun:
    """What an offline run recorded: its id, name, group, config, summary, history rows and exit code."""

    run_id: str = ""
    name: str = ""
    group: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    exit_code: int | None = None


def read_run(path: str | Path) -> OfflineRun:
    """Decode ``path`` (a ``run-<id>.wandb`` file or the ``offline-run-*`` folder holding one)."""
    path = Path(path)
    if path.is_dir():
        (path,) = path.glob("run-*.wandb")
    run = OfflineRun()
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.name, run.group = record.run.run_id, record.run.display_name, record.run.run_group
            run.config.update({_key(u): json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            run.config.update({_key(u): json.loads(u.value_json) for u in record.config.update})
            for item in record.config.remove:
                run.config.pop(_key(item), None)
        elif kind == "summary":
            run.summary.update({_key(u): json.loads(u.value_json) for u in record.summary.update})
        elif kind == "history":
            run.history.append({_key(u): json.loads(u.value_json) for u in record.history.item})
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run
