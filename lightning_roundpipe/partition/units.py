"""Byte counts for messages: a unit that shows the number (bytes, KiB, MiB or GiB). Pure."""

from __future__ import annotations

_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def format_bytes(nbytes: float, exact: bool = False) -> str:
    """``nbytes`` in the largest binary unit it reaches, three significant digits (``"12.5 KiB"``,
    ``"3.40 GiB"``; below 1 KiB ``"640 bytes"``); with ``exact``, the byte count too
    (``"12.5 KiB (12,800 bytes)"``), so that two different sizes never print the same."""
    for size, unit in _UNITS:
        if abs(nbytes) >= size:
            value = nbytes / size
            text = f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
            return f"{text} ({int(nbytes):,} bytes)" if exact else text
    return f"{int(nbytes):,} bytes"
