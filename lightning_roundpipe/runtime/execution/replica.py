"""Per-device replicas of the layer modules (DESIGN.md section 4).

Each device runs a stage on its own replica of the stage's modules: a shallow copy of every module
of the layer (new ``_parameters``, ``_buffers`` and ``_modules`` dicts, everything else shared)
whose parameters and buffers are bound to the tensors uploaded to that device. No lock is shared
between devices, and a forward and a backward stage over the same layer may run at once on two
devices (the fused plan), which ``torch.func.functional_call`` on the shared module could not do
(it swaps the module's attributes while it runs). Binding copies each original module's
``training`` flag, so ``model.eval()`` is honoured. Plain attributes set on a layer's modules
after the replicas were made (a callback's ``momentum = None`` on a BatchNorm, PEFT's
``set_adapter``) reach them at the next program's start (:class:`HostAttributes`).
"""

from __future__ import annotations

import threading

from torch import nn


class LayerReplica:
    """A shallow structural copy of one layer module.

    Args:
        layer: the original layer (never modified).
    """

    def __init__(self, layer: nn.Module) -> None:
        self.pairs: list[tuple[nn.Module, nn.Module]] = []
        self.module = self._copy(layer, {})
        self._originals = {id(copy): original for original, copy in self.pairs}
        self.bound_attributes: set[tuple[int, str]] = set()
        """``(id(replica module), name)`` of the plain attributes :meth:`bind` sets (not the layer's to follow)."""
        # bind (compute thread) and unbind (the DROP on the d2h thread) of one device's replica: an
        # unbind must never undo a bind of another stage made between its check and its write
        self._lock = threading.Lock()
        self._slots: dict[str, tuple[nn.Module, str, bool, nn.Module]] = {}
        for prefix, original in layer.named_modules(remove_duplicate=False):
            copy = self._find(prefix)
            for name in original._parameters:
                self._slots[f"{prefix}.{name}" if prefix else name] = (copy, name, True, original)
            for name in original._buffers:
                self._slots[f"{prefix}.{name}" if prefix else name] = (copy, name, False, original)

    def _copy(self, module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
        if id(module) in memo:
            return memo[id(module)]
        copy = object.__new__(type(module))
        copy.__dict__ = dict(module.__dict__)
        memo[id(module)] = copy
        copy._parameters = dict(module._parameters)
        copy._buffers = dict(module._buffers)
        copy._modules = {n: (None if c is None else self._copy(c, memo)) for n, c in module._modules.items()}
        self.pairs.append((module, copy))
        return copy

    def _find(self, prefix: str) -> nn.Module:
        module = self.module
        for part in prefix.split(".") if prefix else ():
            module = module._modules[part]
        return module

    def bind(self, tensors: dict[str, "object"], attributes: dict[str, "object"] | None = None) -> nn.Module:
        """Point the replica's parameters and buffers at ``tensors`` (``{qualified name: tensor}``),
        set the plain ``attributes`` (``{qualified name: value}``: per-residency objects a module's forward
        reads with its weights, e.g. a bitsandbytes ``Linear8bitLt``'s ``state``) on the replica's modules,
        and copy the training flags; returns the replica module to call."""
        for original, copy in self.pairs:
            copy.training = original.training
        with self._lock:
            for name, tensor in tensors.items():
                module, leaf, is_param, _ = self._slots[name]
                (module._parameters if is_param else module._buffers)[leaf] = tensor
            for name, value in (attributes or {}).items():
                prefix, _, leaf = name.rpartition(".")
                copy = self._find(prefix)
                copy.__dict__[leaf] = value
                self.bound_attributes.add((id(copy), leaf))
        return self.module

    def unbind(self, tensors: dict[str, "object"], attributes: dict[str, "object"] | None = None) -> None:
        """Point the slots still bound to ``tensors`` (and the ``attributes`` still set to those values)
        back at the original module's parameters, buffers and attributes (host memory), so a dropped
        stage's device buffer is freed at its ``DROP``: a replica must not keep it alive until the
        layer's next stage on this device."""
        with self._lock:
            for name, tensor in tensors.items():
                module, leaf, is_param, original = self._slots[name]
                table = module._parameters if is_param else module._buffers
                if table.get(leaf) is tensor:
                    table[leaf] = (original._parameters if is_param else original._buffers)[leaf]
            for name, value in (attributes or {}).items():
                prefix, _, leaf = name.rpartition(".")
                copy = self._find(prefix)
                if copy.__dict__.get(leaf) is value:
                    copy.__dict__[leaf] = self._originals[id(copy)].__dict__.get(leaf)

    def unbind_all(self) -> None:
        """Point every slot back at the original module's tensors (after a failed program, whose
        stages were never dropped)."""
        with self._lock:
            for module, leaf, is_param, original in self._slots.values():
                (module._parameters if is_param else module._buffers)[leaf] = \
                    (original._parameters if is_param else original._buffers)[leaf]
            for original, copy in self.pairs:
                for key, leaf in self.bound_attributes:
                    if key == id(copy):
                        copy.__dict__[leaf] = original.__dict__.get(leaf)


#: module attributes the replica manages itself (its own tensor tables, the training flag bind copies)
_OWN_ATTRIBUTES = frozenset({"_parameters", "_buffers", "_modules", "training"})
_MISSING = object()
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _same(a: object, b: object) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, _PLAIN) and a == b)


def diverged_attributes(replicas: "list[list[LayerReplica]]",
                        followed: "HostAttributes | None" = None) -> list[tuple[nn.Module, str]]:
    """Plain attributes (not parameters, buffers, submodules nor ``training``) that differ between a
    layer's modules and any device's replica of them: set (or changed) by a forward on the replica,
    which the layer never sees, or set on the layer after the replicas were made, which they never
    see. A value counts as changed when it is another object, except equal plain scalars and strings.

    Args:
        replicas: per device, the :class:`LayerReplica` of every layer (the executor's ``replicas``).
        followed: the executor's :class:`HostAttributes`: attributes changed on a layer since its last
            push are not named (the next program's start copies them to the replicas).

    Returns:
        ``(original module, attribute name)`` pairs, once each, in layer order.
    """
    found: dict[tuple[int, str], tuple[nn.Module, str]] = {}
    pending = {(id(module), key) for module, key in followed.changed()} if followed is not None else set()
    for device_replicas in replicas:
        for replica in device_replicas:
            for original, copy in replica.pairs:
                mine, theirs = original.__dict__, copy.__dict__
                for key in sorted((mine.keys() | theirs.keys()) - _OWN_ATTRIBUTES):
                    if (id(copy), key) in replica.bound_attributes:
                        continue
                    if (id(original), key) not in pending and not _same(mine.get(key, _MISSING), theirs.get(key, _MISSING)):
                        found.setdefault((id(original), key), (original, key))
    return list(found.values())


class HostAttributes:
    """Follows the plain attributes of the layers' modules (everything in a module's ``__dict__`` but
    its parameter, buffer and submodule tables and ``training``) for the devices' replicas: an
    attribute set, replaced or deleted on a layer since the last :meth:`push` (by a callback, the
    LightningModule, PEFT) is copied to every device's replica of that module at the next push,
    which the executor makes before a program's ops are issued. Attributes a replica sets on itself
    in forward are left alone (:func:`diverged_attributes` names them).

    Args:
        replicas: per device, the :class:`LayerReplica` of every layer (the executor's ``replicas``).

    Cost: one comparison of each module's attribute dict with the one seen per :meth:`changed` (2 us
    a module of a Llama decoder layer on a loaded 2-core CPU), the copy only for what changed.
    """

    def __init__(self, replicas: "list[list[LayerReplica]]") -> None:
        self._copies: dict[int, tuple[nn.Module, list[nn.Module]]] = {}
        for device_replicas in replicas:
            for replica in device_replicas:
                for original, copy in replica.pairs:
                    self._copies.setdefault(id(original), (original, []))[1].append(copy)
        self._seen = {key: dict(original.__dict__) for key, (original, _) in self._copies.items()}

    def changed(self) -> list[tuple[nn.Module, str]]:
        """``(module, attribute name)`` of each attribute set, replaced or deleted on a layer's
        module since the last :meth:`push`: in a module whose attribute dict is not equal (``==``) to
        the one seen, each value that is another object, except equal plain scalars and strings."""
        out = []
        for key, (original, _) in self._copies.items():
            now, seen = original.__dict__, self._seen[key]
            try:
                if now == seen:  # identity first, then `==`: the common case, nothing changed
                    continue
            except Exception:  # a value whose `==` is no bool (a tensor of several elements)
                pass
            for name in sorted((now.keys() | seen.keys()) - _OWN_ATTRIBUTES):
                if not _same(now.get(name, _MISSING), seen.get(name, _MISSING)):
                    out.append((original, name))
        return out

    def push(self, changes: list[tuple[nn.Module, str]] | None = None) -> list[tuple[nn.Module, str]]:
        """Copy the changed attributes (``changes``, default :meth:`changed`) to every replica of their
        module and remember the layers' current attributes; returns the changes. Call it while no
        program runs on the replicas (a forward and its recomputation must see one value)."""
        changes = self.changed() if changes is None else changes
        for original, name in changes:
            value = original.__dict__.get(name, _MISSING)
            for copy in self._copies[id(original)][1]:
                if value is _MISSING:
                    copy.__dict__.pop(name, None)
                else:
                    copy.__dict__[name] = value
        for key, (original, _) in self._copies.items():
            self._seen[key] = dict(original.__dict__)
        return changes
