"""Checking mode of the stream drivers: every buffer access must follow the events it needs.

The executor issues each op of the stream program on one ``(device, stream)`` queue and tells the
driver which buffers the op reads and writes (:class:`Access`). :class:`StreamChecker` keeps, as a
GPU race detector does (vector clocks, as in CUDA's compute-sanitizer racecheck and torch's
``TORCH_CUDA_SANITIZER``), for every stream the events it has waited on (transitively), and for every
buffer its last writer, its readers since then and its release. When an op reads a buffer whose
producer it has not waited for, overwrites one whose last readers it has not waited for, fills a
pooled stage buffer whose release (``DROP``) it has not waited for, or refills a pooled transfer
buffer before every reader of its previous content has read it and been waited for, it raises
:class:`StreamCheckError` at once, at issue time, naming the op and the buffer, with the stream
program's grid and the failing op marked.

The check is made when the op is *issued*, from the waits the issuing thread has really made, so it
does not depend on how fast any device runs: a missing edge raises whether or not the data happened
to be there in time (no artificial delay is needed to expose it). Buffers the host wrote before the
program (the batch, boundaries saved by an earlier program) are not declared; after a program has
been synchronised, :meth:`StreamChecker.reset` forgets every access (all of them completed).

Pure Python; used by the CPU driver (:class:`~lightning_roundpipe.runtime.backends.cpu.CpuBackend`)
when checking is on (``check_streams=True`` or ``LIGHTNING_ROUNDPIPE_CHECK_STREAMS=1``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Hashable

#: Environment variable that turns the checking mode on for every CPU virtual device (``1``).
CHECK_ENV = "LIGHTNING_ROUNDPIPE_CHECK_STREAMS"

StreamId = tuple[int, str]


def env_flag(name: str, hint: str) -> bool:
    """An on/off environment variable of the checking mode: ``1``/``true`` on, ``0``/``false``/unset off
    (case and surrounding blanks ignored).

    Args:
        name: the variable.
        hint: what setting it does, for the error (``"turns the stream checking mode on"``).

    Raises:
        ValueError: any other value of the variable.
    """
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("", "0", "false"):
        return False
    raise ValueError(f"`{name}={os.environ[name]}` is not understood; valid values: 1, true, 0, false."
                     f" HINT: `export {name}=1` {hint}.")


def checking_default() -> bool:
    """Whether the checking mode is on by default (``LIGHTNING_ROUNDPIPE_CHECK_STREAMS``: ``1``/``true``
    on, ``0``/``false``/unset off).

    Raises:
        ValueError: any other value of the variable.
    """
    return env_flag(CHECK_ENV, "turns the stream checking mode on")


class StreamCheckError(RuntimeError):
    """An op touched a buffer without waiting for the event that makes the access safe."""


@dataclass(frozen=True)
class Access:
    """The buffers one op touches.

    Attributes:
        reads: ``(buffer key, expected content tag or None)``: the op reads these; with a tag, the
            buffer must hold exactly that content (a pooled stage buffer: the stage's complete load).
        writes: ``(buffer key, content tag)``: the op (over)writes these.
        fills: ``(buffer key, content tag)``: the op writes into a pooled buffer; if the buffer held
            something before, its release must have been waited for.
        releases: ``(buffer key, expected readers)``: the op gives the buffer back (``DROP``); each
            expected reader (an op's string form) must have read it, and every reader must be
            waited for.
        refills: ``(buffer key, content tag, previous content tag, its readers)``: the op overwrites a
            pooled transfer buffer (no release op: the program orders the refill after the previous
            content's readers). The buffer must hold the previous content (``None``: the slot's first
            use in the program), each of its readers must have read it and been waited for, and so
            must its writer.
    """

    reads: tuple[tuple[Hashable, Any], ...] = ()
    writes: tuple[tuple[Hashable, Any], ...] = ()
    fills: tuple[tuple[Hashable, Any], ...] = ()
    releases: tuple[tuple[Hashable, tuple[str, ...]], ...] = ()
    refills: tuple[tuple[Hashable, Any, Any, tuple[str, ...]], ...] = ()


@dataclass
class _Mark:
    stream: StreamId
    count: int
    label: str


@dataclass
class _Buffer:
    writer: _Mark | None = None
    tag: Any = None
    readers: list[_Mark] = field(default_factory=list)
    released: _Mark | None = None

    @property
    def tag_stage(self) -> Any:
        return _stage(self.tag)


class StreamChecker:
    """Vector clocks of every stream and the access history of every buffer (see module docstring).

    One checker is shared by all devices of an executor (waits cross devices). Thread-safe: issuing
    threads call it concurrently.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clocks: dict[StreamId, dict[StreamId, int]] = {}
        self._buffers: dict[Hashable, _Buffer] = {}
        self.program: Any = None
        self.checked_ops = 0

    def reset(self, program: Any = None) -> None:
        """Forget every access (everything issued so far has completed); ``program`` is shown in errors."""
        with self._lock:
            self._buffers.clear()
            self._clocks.clear()
            self.program = program

    def forget(self, bank: int) -> None:
        """Forget the accesses of the buffers of pool bank ``bank`` (the program that used them has
        completed) and keep the rest (a program of the other bank is still in flight): the keys of
        bank ``b > 0`` start with ``"bank{b}"`` (:func:`~lightning_roundpipe.runtime.execution.access.in_bank`)."""
        prefix = f"bank{bank}"
        with self._lock:
            for key in list(self._buffers):
                banked = isinstance(key, tuple) and bool(key) and isinstance(key[0], str) and key[0].startswith("bank")
                if (banked and key[0] == prefix) or (bank == 0 and not banked):
                    del self._buffers[key]

    # ------------------------------------------------------------------ events
    def record(self, stream: StreamId) -> dict[StreamId, int]:
        """The clock an event recorded now on ``stream`` carries."""
        with self._lock:
            return dict(self._clocks.setdefault(stream, {}))

    def wait(self, stream: StreamId, clock: dict[StreamId, int] | None) -> None:
        """``stream`` waits for an event that carried ``clock``."""
        if not clock:
            return
        with self._lock:
            mine = self._clocks.setdefault(stream, {})
            for other, count in clock.items():
                if mine.get(other, 0) < count:
                    mine[other] = count

    # ------------------------------------------------------------------ ops
    def issue(self, stream: StreamId, label: str, access: Access, op: Any = None) -> None:
        """Check and record one op issued on ``stream``.

        Raises:
            StreamCheckError: the op reads, overwrites, fills or releases a buffer without having
                waited for the access it must follow (message: op, buffer, the other access, grid).
        """
        with self._lock:
            clock = self._clocks.setdefault(stream, {})
            count = clock.get(stream, 0) + 1
            clock[stream] = count
            self.checked_ops += 1
            me = _Mark(stream, count, label)
            problem = self._check(clock, me, access)
            if problem is None:
                self._apply(me, access)
        if problem is not None:
            grid = ""
            if self.program is not None and op is not None:
                try:
                    grid = "\n" + self.program.format_grid(mark=op)
                except Exception:  # the grid is a courtesy; never hide the finding behind it
                    grid = ""
            raise StreamCheckError(f"RoundPipe stream check: device {stream[0]}, stream `{stream[1]}`: `{label}` {problem}."
                                   " HINT: the stream program lacks a dependency edge, or the executor waits on the"
                                   " wrong event." + grid)

    @staticmethod
    def _seen(clock: dict[StreamId, int], mark: _Mark) -> bool:
        return clock.get(mark.stream, 0) >= mark.count

    def _check(self, clock: dict[StreamId, int], me: _Mark, access: Access) -> str | None:
        for key, tag, previous, expected in access.refills:  # before the reads: name the pool hazard first
            buffer = self._buffers.get(key)
            held = None if buffer is None or buffer.writer is None else buffer.tag
            if held != previous:
                return (f"refills pooled {_name(key)} with {tag!r} while it holds {held!r}, not {previous!r}"
                        " (the ops before it in the slot were not waited for)")
            if buffer is None or buffer.writer is None:
                continue  # the slot's first use in this program (earlier programs have completed)
            done = {reader.label for reader in buffer.readers}
            missing = [label for label in expected if label not in done]
            if missing:
                return (f"refills pooled {_name(key)} with {tag!r} before `{missing[0]}` read {buffer.tag!r}"
                        " (not waited for)")
            problem = self._overwrite(clock, key, buffer)
            if problem:
                return problem.replace("overwrites", "refills pooled").replace(" without", f" ({buffer.tag!r}) without")
        for key, expect in access.reads:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.writer is None:
                return f"reads {_name(key)} before any op wrote it (its producer was not waited for)"
            if expect is not None and buffer.tag != expect:
                return f"reads {_name(key)} holding {buffer.tag!r}, but needs {expect!r} (not waited for)"
            if not self._seen(clock, buffer.writer):
                return f"reads {_name(key)} written by `{buffer.writer.label}` without waiting for it"
            if buffer.released is not None:
                return f"reads {_name(key)} after `{buffer.released.label}` released it"
        for key, _ in access.writes:
            buffer = self._buffers.get(key)
            if buffer is not None:
                problem = self._overwrite(clock, key, buffer)
                if problem:
                    return problem
        for key, _ in access.fills:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.writer is None:
                continue
            if buffer.writer.stream == me.stream and buffer.released is None and buffer.tag_stage == _stage(_tag_of(access, key)):
                continue  # the next chunk of the same load
            if buffer.released is None:
                return f"fills {_name(key)} still holding {buffer.tag!r}, which no op released yet"
            if not self._seen(clock, buffer.released):
                return f"fills {_name(key)} released by `{buffer.released.label}` without waiting for the release"
        for key, expected in access.releases:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.writer is None:
                return f"releases {_name(key)}, which holds nothing"
            done = {reader.label for reader in buffer.readers}
            missing = [label for label in expected if label not in done]
            if missing:
                return f"releases {_name(key)} before `{missing[0]}` read it (not waited for)"
            problem = self._overwrite(clock, key, buffer)
            if problem:
                return problem.replace("overwrites", "releases")
        return None

    def _overwrite(self, clock: dict[StreamId, int], key: Hashable, buffer: _Buffer) -> str | None:
        if buffer.writer is not None and not self._seen(clock, buffer.writer):
            return f"overwrites {_name(key)} written by `{buffer.writer.label}` without waiting for it"
        for reader in buffer.readers:
            if not self._seen(clock, reader):
                return f"overwrites {_name(key)} still read by `{reader.label}` without waiting for it"
        return None

    def _apply(self, me: _Mark, access: Access) -> None:
        for key, _ in access.reads:
            self._buffers[key].readers.append(me)
        refilled = tuple((key, tag) for key, tag, _, _ in access.refills)
        for key, tag in tuple(access.writes) + tuple(access.fills) + refilled:
            buffer = self._buffers.setdefault(key, _Buffer())
            fresh_fill = (key, tag) in access.fills and (buffer.released is not None or buffer.writer is None)
            if (key, tag) in access.writes or (key, tag) in refilled or fresh_fill:
                buffer.readers = []
                buffer.released = None
            buffer.writer, buffer.tag = me, tag
        for key, _ in access.releases:
            buffer = self._buffers[key]
            buffer.released = me
            buffer.readers = []


def _tag_of(access: Access, key: Hashable) -> Any:
    return next(tag for k, tag in access.fills if k == key)


def _stage(tag: Any) -> Any:
    """A fill's tag is ``(stage_index, round_index, chunk_index)``: the load it belongs to."""
    return tag[:2] if isinstance(tag, tuple) else tag


def _name(key: Hashable) -> str:
    if isinstance(key, tuple):
        return "`" + ":".join(str(k) for k in key) + "`"
    return f"`{key}`"
