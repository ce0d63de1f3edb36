"""Read an offline W&B run (``offline-run-*/run-<id>.wandb``) back in a test.

wandb >= 0.19 (``wandb-core``) writes no ``files/config.yaml`` or ``wandb-summary.json`` in offline
mode (they appear only after ``wandb sync``), ``wandb.Api`` needs the server, and the Python
``wandb.sdk.internal.datastore`` reader is gone. The ``.wandb`` file is W&B's transaction log: a
7-byte header (``:W&B``, magic ``0xBEE1``, version 0), then LevelDB-log records (32 KiB blocks;
7-byte record headers: CRC32C, length, type FULL/FIRST/MIDDLE/LAST), each one serialised
``wandb.proto.wandb_internal_pb2.Record``. This module walks that framing (CRCs are not checked)
and decodes the records with the wandb package's own protobuf classes.

The log is read only once no process holds it open (:func:`wait_until_closed`: wandb-core, its writer,
may still be appending after ``wandb.finish()`` returns or after the job that started it exited); a
log read mid-write fails to decode (``DecodeError: Wire format was corrupt``, seen on a loaded machine).
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

HEADER = b":W&B"
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _holders(path: Path) -> list[int]:
    """Process ids with ``path`` open (Linux ``/proc/<pid>/fd``; processes not ours are not readable, and
    skipped: the writer is this test's child or grandchild, ours)."""
    target, pids = str(path.resolve()), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.scandir(f"/proc/{entry.name}/fd")
        except OSError:
            continue
        with fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path) == target:
                        pids.append(int(entry.name))
                        break
                except OSError:
                    continue
    return pids


def wait_until_closed(path: str | Path, timeout_s: float = 600.0) -> None:
    """Return once no process holds ``path`` open (checked every 0.05 s), so its writer has finished it.

    Raises:
        TimeoutError: still open after ``timeout_s`` seconds (a hung writer; generous, so a loaded
            machine never reaches it).
    """
    path = Path(path)
    if not os.path.isdir("/proc"):  # no way to see the writer: the caller's ordering must suffice
        return
    deadline = time.monotonic() + timeout_s
    while pids := _holders(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} is still open (processes {pids}) {timeout_s} s later")
        time.sleep(0.05)


def records(path: str | Path) -> Iterator[Any]:
    """The ``wandb_internal_pb2.Record`` s of a ``.wandb`` file, in order, once its writer has closed it."""
    from wandb.proto import wandb_internal_pb2 as pb

    wait_until_closed(path)
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
