"""Type check of the main job's config before anything is built (``train.run``).

A command-line override of the wrong type (``trainer.max_steps=two``) used to reach Lightning as it
was and fail deep inside it with a bare ``TypeError: '<' not supported between instances of 'str'
and 'int'`` that named no key. Here every key of the ``trainer`` and ``data`` groups is checked
against the annotation of the parameter it feeds (``lightning.pytorch.Trainer.__init__``, the data
module's ``__init__``), before the model is loaded, and a wrong one raises a ``TypeError`` naming
the key, its value, the parameter and the type it takes.

The check understands ``int``, ``float`` (an int is accepted), ``bool``, ``str``, ``None``,
``Literal``, unions (``X | Y``, ``Optional``), lists, tuples and dicts (their items checked), and
classes (an instance, or a config node with a ``_target_`` that builds one); a key whose
annotation it cannot read (a name imported for type checking only, a ``TypeVar``) is left to the
target itself.
"""

from __future__ import annotations

import collections.abc
import inspect
import types
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig

CHECKED_GROUPS = ("trainer", "data")
"""The config groups whose keys are checked: each is one ``_target_`` call built from its keys."""

APP_VALUES = {"trainer.precision": ("auto",)}
"""Values the app accepts beyond the target's type: ``trainer.precision=auto`` is resolved by the app
before the trainer is built (:func:`~lightning_roundpipe.recipes.precision.resolve_precision`)."""

_SEQUENCES = (list, tuple, collections.abc.Sequence, collections.abc.Iterable, collections.abc.MutableSequence)
_MAPPINGS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


def _annotations(target: Any) -> dict[str, Any]:
    """``{parameter: annotation}`` of ``target``'s call (a class: its ``__init__``), each evaluated in
    its module; parameters whose annotation cannot be evaluated are left out."""
    function = target.__init__ if inspect.isclass(target) else target
    try:
        return typing.get_type_hints(function)
    except Exception:  # a name imported under TYPE_CHECKING only: evaluate the annotations one by one
        pass
    namespace = dict(getattr(inspect.unwrap(function), "__globals__", {}))
    out: dict[str, Any] = {}
    for name, parameter in inspect.signature(function).parameters.items():
        annotation = parameter.annotation
        if annotation is inspect.Parameter.empty:
            continue
        try:
            out[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation  # noqa: S307
        except Exception:
            continue
    return out


def accepts(value: Any, hint: Any) -> bool:
    """Whether ``value`` (a config value: a primitive, ``DictConfig`` or ``ListConfig``) fits the type ``hint``."""
    if hint is Any or isinstance(hint, typing.TypeVar):
        return True
    if hint is None or hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(accepts(value, arg) for arg in args)
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if origin in _SEQUENCES:
        if not isinstance(value, (list, tuple, ListConfig)):
            return False
        items = [arg for arg in args if arg is not Ellipsis]
        return len(items) != 1 or all(accepts(item, items[0]) for item in value)
    if origin in _MAPPINGS:
        return isinstance(value, (dict, DictConfig))
    if origin is not None:  # another generic (Callable[...], type[...]): left to the target
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if inspect.isclass(hint):
        if issubclass(hint, Path):
            return isinstance(value, (str, Path))
        if isinstance(value, DictConfig):
            return "_target_" in value  # instantiated into the object by Hydra
        return isinstance(value, hint)
    return True


def describe(hint: Any) -> str:
    """The type ``hint`` as written in a signature: ``int``, ``int | float | None``, ``'warn'``."""
    if hint is None or hint is type(None):
        return "None"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(dict.fromkeys(describe(arg) for arg in args))
    if origin is typing.Literal:
        return " | ".join(repr(arg) for arg in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(describe(arg) for arg in args)}]" if args else name
    return getattr(hint, "__name__", str(hint))


def check_config_types(cfg: DictConfig, groups: tuple[str, ...] = CHECKED_GROUPS) -> None:
    """Check every key of each group in ``groups`` (a node with a ``_target_``) against the annotation of
    the target's parameter of that name.

    Args:
        cfg: the composed config (``conf/train.yaml``).
        groups: the top-level keys to check.

    Raises:
        TypeError: at the first key whose value does not fit its parameter's type, naming the key
            (``trainer.max_steps``), the value, the target's parameter and the type it takes.
    """
    from hydra.utils import get_object

    for group in groups:
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        try:
            target = get_object(node._target_)
        except Exception:  # Hydra names a missing target itself when it builds the node
            continue
        hints = _annotations(target)
        name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', node._target_)}".lstrip(".")
        for key in node:
            if not isinstance(key, str) or key.startswith("_") or key not in hints:
                continue
            try:
                value = node[key]
            except Exception:  # an interpolation that cannot resolve here: left to Hydra
                continue
            if accepts(value, hints[key]) or value in APP_VALUES.get(f"{group}.{key}", ()):
                continue
            raise TypeError(
                f"`{group}.{key}={value!r}` is a `{type(value).__name__}`, but `{name}({key}=...)` takes"
                f" `{describe(hints[key])}`. HINT: give `{group}.{key}` a value of that type on the command line"
                f" or in the config (`python -m lightning_roundpipe.train --cfg job` prints the composed config)."
            )
