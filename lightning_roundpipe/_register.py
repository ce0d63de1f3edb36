"""Registers ``Trainer(strategy="roundpipe")`` with Lightning without importing Lightning.

``import lightning_roundpipe`` must stay light (``lightning_roundpipe.schedule``, ``partition`` and
``simulate`` are pure: DESIGN.md section 3), yet ``Trainer(strategy="roundpipe")`` must work in
either import order. Lightning fills its ``StrategyRegistry`` when ``lightning.pytorch.strategies``
is imported and has no entry-point group for strategies (only for callbacks, which are loaded after
the strategy is resolved), so:

- if ``lightning.pytorch`` is already imported, the strategy is registered at once;
- otherwise a finder on ``sys.meta_path`` wraps the loader of ``lightning.pytorch`` and registers
  the strategy right after that package has finished executing (then the finder removes itself).

Registering imports :mod:`lightning_roundpipe.integration` (torch, Lightning), which at that point
are loaded anyway.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

_TRIGGER = "lightning.pytorch"
"""The package after whose import the strategy is registered (its ``__init__`` imports ``strategies``)."""


def register_now() -> None:
    """Register ``"roundpipe"`` in ``lightning.pytorch.strategies.StrategyRegistry`` (idempotent).

    Imports Lightning and :mod:`lightning_roundpipe.integration`.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_roundpipe.integration.strategy import RoundPipeStrategy

    RoundPipeStrategy.register_strategies(StrategyRegistry)


def _register_after_import() -> None:
    try:
        register_now()
    except Exception as err:  # never break `import lightning` because of this package
        warnings.warn(
            f"lightning_roundpipe could not register `strategy=\"roundpipe\"` with Lightning: {err!r}."
            " HINT: pass the strategy object instead: `Trainer(strategy=lightning_roundpipe.RoundPipeStrategy())`.",
            stacklevel=2,
        )


class _LoaderProxy(importlib.abc.Loader):
    """The original loader of ``lightning.pytorch``; registers the strategy after ``exec_module``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # get_filename, get_resource_reader, ...
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register_after_import()


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` with the other finders and wraps its loader in :class:`_LoaderProxy`."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname != _TRIGGER:
            return None
        uninstall()
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderProxy(spec.loader)
                return spec
        return None


_FINDER = _RegisterOnImport()


def uninstall() -> None:
    """Remove the import hook (no-op when it is not installed)."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def install() -> None:
    """Register now if ``lightning.pytorch`` is imported, else register when it is (see the module doc)."""
    module = sys.modules.get(_TRIGGER)
    if module is not None:
        if not getattr(getattr(module, "__spec__", None), "_initializing", False):
            register_now()
            return
        # imported from inside Lightning's own import: it registers itself once `lightning.pytorch` is done
        loader = getattr(module.__spec__, "loader", None)
        if isinstance(loader, _LoaderProxy):
            return
        warnings.warn(
            "lightning_roundpipe was imported while `lightning.pytorch` was still being imported, so"
            ' `strategy="roundpipe"` may be unregistered. HINT: import lightning_roundpipe after Lightning,'
            " or pass `lightning_roundpipe.RoundPipeStrategy()`.",
            stacklevel=3,
        )
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
