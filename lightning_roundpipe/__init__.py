"""lightning_roundpipe: RoundPipe (arXiv 2604.27085) pipeline training for PyTorch Lightning.

``import lightning_roundpipe`` registers ``Trainer(strategy="roundpipe")`` (in either import order:
see :mod:`lightning_roundpipe._register`) without importing torch or Lightning itself; the Lightning
classes (:class:`RoundPipeStrategy`, :class:`RoundPipePrecision`, :class:`RoundPipeMetricsCallback`)
load on first access. The pure packages (``schedule``, ``partition``, ``simulate``) never import
Lightning.
"""

import time as _time

_IMPORT_START_S = _time.perf_counter()
"""``time.perf_counter()`` when Python began importing this package, before torch and Lightning: the
main job (``python -m lightning_roundpipe.train``) counts its printed wall time from here."""

from typing import TYPE_CHECKING, Any  # noqa: E402

from lightning_roundpipe import _register  # noqa: E402

__version__ = "0.1.0"
__all__ = ["DataParallel", "RoundPipeConfig", "RoundPipeMetricsCallback", "RoundPipePrecision", "RoundPipeStrategy",
           "__version__"]

_LAZY = {
    "DataParallel": "lightning_roundpipe.config",
    "RoundPipeConfig": "lightning_roundpipe.config",
    "RoundPipeMetricsCallback": "lightning_roundpipe.integration.callbacks",
    "RoundPipePrecision": "lightning_roundpipe.integration.precision",
    "RoundPipeStrategy": "lightning_roundpipe.integration.strategy",
}

if TYPE_CHECKING:
    from lightning_roundpipe.config import RoundPipeConfig
    from lightning_roundpipe.integration import DataParallel, RoundPipeMetricsCallback, RoundPipePrecision, RoundPipeStrategy


def __getattr__(name: str) -> Any:
    """The Lightning classes, imported on first access (PEP 562)."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


_register.install()
