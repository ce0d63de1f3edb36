"""The methods the engine installs on the user's module, and what a copy of that module gets.

Runtime code (no Lightning); the asynchronous optimizer (:mod:`~lightning_roundpipe.integration.async_step`)
installs its wrappers on the LightningModule and the optimizers the same way.

:meth:`~lightning_roundpipe.runtime.execution.host_calls.HostCalls.install` (the engine's) puts the pipelined
``forward`` (and ``generate``) on the target module as instance attributes. A bound method of the
engine there would make the module, and the LightningModule holding it, impossible to copy while
the engine runs: ``copy.deepcopy`` and ``pickle`` would reach the engine's worker threads and
queues (``cannot pickle '_queue.SimpleQueue' object``). Lightning's weight averaging callbacks,
``ModelCheckpoint``-style callbacks and users copy modules in the middle of ``fit``.

:class:`InstalledMethod` calls the engine's method, and a copy of it (``copy.deepcopy``,
``pickle``) is the copied module's own method instead: the copy is a plain module, not pipelined
(the engine is not copied; its devices and threads belong to the running fit).
"""

from __future__ import annotations

from typing import Any, Callable


class InstalledMethod:
    """``target.<name>`` while an engine is installed: calls ``call`` (a bound method of the engine).

    Args:
        call: the engine's method (``engine.forward``, ``engine.generate``), or another wrapper of the
            target's method (the asynchronous optimizer's deferred ``lr_scheduler_step``).
        target: the module (or optimizer) it is installed on.
        name: the attribute (``"forward"``, ``"generate"``, ``"lr_scheduler_step"``...).
        original: what ``target.__dict__`` held under ``name`` before (a falsy value: nothing,
            the class's own method).

    Copies (``copy.deepcopy``, ``pickle``) reduce to ``original`` (copied with the target), else to the
    target class's method bound to the copied target (``getattr(copy, name)``).
    """

    __slots__ = ("call", "target", "name", "original")

    def __init__(self, call: Callable[..., Any], target: Any, name: str, original: Any) -> None:
        self.call = call
        self.target = target
        self.name = name
        self.original = original

    @property
    def engine(self) -> Any:
        """The object ``call`` is a bound method of (the engine), else ``None``."""
        return getattr(self.call, "__self__", None)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """What ``call`` wraps, else ``call``: ``inspect.signature`` and Lightning's ``is_overridden`` see
        through this object as through the ``functools.wraps`` wrapper it replaces."""
        return getattr(self.call, "__wrapped__", self.call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __reduce__(self) -> tuple:
        if self.original:  # the target's own instance attribute, copied with it
            return own_method, (self.original,)
        # the class's method bound to the copy: `getattr` runs before the copy's state is set, so it finds the
        # class's; only standard names, so a module pickled during fit unpickles without lightning_roundpipe
        return getattr, (self.target, self.name)

    def __repr__(self) -> str:
        return f"<RoundPipe's {type(self.target).__name__}.{self.name}>"


def own_method(original: Any) -> Any:
    """``original``: what a copy of a target whose ``__dict__`` held its own method gets back
    (:class:`InstalledMethod`)."""
    return original
