"""Checking mode of CPU virtual devices inside device ops: host syncs and placement (DESIGN.md section 4 (b), (c)).

On a CPU virtual device every tensor is a host tensor, so two classes of GPU failure run silently
on the CPU driver. While an op of a device runs (:func:`op_scope`, entered by the CPU driver around
every op on the stream's worker thread), a thread-local ``TorchFunctionMode`` and ``TorchDispatchMode``
see what the op does:

- **host syncs** (compute ops: layer forward ``F``, fused tail ``X``, recompute ``R`` and backward
  ``B``), as ``torch.cuda.set_sync_debug_mode("error")`` on CUDA: turning a *device* tensor into a
  Python value (``bool(t)``, ``if t:``, ``t.item()``, ``int``/``float``/``operator.index``,
  ``t.tolist()``, ``t.numpy()``, ``t.cpu()``; ``aten._local_scalar_dense`` from C++), an op whose
  output shape depends on the data (ATen ops tagged ``torch.Tag.dynamic_output_shape`` or
  ``data_dependent_output``: ``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
  ``repeat_interleave`` without ``output_size``...), or a copy from the device into host memory.
  Each one blocks a GPU's issuing thread until the device has caught up. It raises
  :class:`HostSyncError` naming the op (``stage 2, F(2, mb 1)``), the layer's module and the Python
  line (the first frame outside torch) that did it; with :func:`count_syncs` it is counted instead.
  A tensor the host made (a 0-dim scalar passed in, a host-side computation) is not a device tensor:
  reading its value is no sync.
- **placement**: every tensor a compute op reads must be on its device: uploaded there (the pools of
  :mod:`~lightning_roundpipe.runtime.backends.pool`, registered by the driver's ``allocate_bytes``),
  made there by an op of that device, or moved there inside the op (``t.to(device)``: a copy, as on
  a GPU). An op that mixes a host tensor of dimension >= 1 with device tensors (a module attribute
  that is no parameter or buffer, a quantisation state or a cache kept on the model: what CUDA
  refuses with "Expected all tensors to be on the same device"), or reads another device's tensor,
  raises :class:`PlacementError` naming the tensor (shape, dtype, the module attribute that holds
  it when one of the running modules does), the layer and the op. CPU 0-dim tensors are allowed,
  as CUDA allows them. Ops on host tensors only stay host ops (their outputs are host tensors), as
  on a GPU; a factory call without ``device=`` (``torch.arange(n)``) makes a host tensor, as on a GPU.

Device memory is tracked by storage (``untyped_storage().data_ptr()``, with a weak reference to
the storage, which torch keeps alive exactly as long as its data): a new storage at the address of
a freed one is not taken for it.

The scopes are on in checking mode (``LIGHTNING_ROUNDPIPE_CHECK_STREAMS=1``, the test suite) and
while :func:`count_syncs` counts (a test or a benchmark reporting syncs per step); otherwise an
op runs without them.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import threading
import weakref
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_LOCAL = threading.local()
_REGISTRY: dict[int, tuple[int, int, "weakref.ref"]] = {}  # data_ptr -> (device token, device_index, storage)
_REGISTRY_LOCK = threading.Lock()
_PRUNED = [4096]  # registry size after the last pruning of dead storages
_COUNTERS: list["SyncCounter"] = []
_TORCH_DIR = os.path.dirname(torch.__file__)
# frames that are the checks' own machinery, never the line to blame: torch, contextlib, this module, and the
# RNG guard's dispatch mode (`runtime/replay/rng_guard.py`), which a layer suspected of global draws runs under
_SKIP_DIRS = (_TORCH_DIR, os.path.dirname(contextlib.__file__) + os.sep + "contextlib", os.path.abspath(__file__),
              os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "replay", "rng_guard.py"))
_DATA_DEPENDENT = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_DYNAMIC: dict[Any, bool] = {}  # ATen op -> tagged with a data-dependent output
_SCALAR_METHODS = {torch.Tensor.item: "`.item()`", torch.Tensor.tolist: "`.tolist()`",
                   torch.Tensor.__bool__: "`bool()` (an `if` or `and`/`or` on a tensor)",
                   torch.Tensor.__int__: "`int()`", torch.Tensor.__float__: "`float()`",
                   torch.Tensor.__index__: "`operator.index()` (a tensor used as a Python index or size)",
                   torch.Tensor.__format__: "formatting (`f'{t}'`)", torch.Tensor.numpy: "`.numpy()`",
                   torch.Tensor.cpu: "`.cpu()` (a blocking device-to-host copy)"}
_FACTORIES = frozenset(getattr(torch, name) for name in (
    "arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "linspace", "logspace",
    "eye", "tensor", "as_tensor", "scalar_tensor", "tril_indices", "triu_indices") if hasattr(torch, name))


class HostSyncError(RuntimeError):
    """A device op turned a device tensor into a Python value, or ran an op whose output shape
    depends on the data: a host sync on a GPU (``torch.cuda.set_sync_debug_mode("error")``)."""


class PlacementError(RuntimeError):
    """A device op read a tensor that is not on its device (CUDA: "Expected all tensors to be on the
    same device")."""


# ---------------------------------------------------------------------- device memory by storage
def _storage(tensor: torch.Tensor) -> Any:
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, meta, wrapper subclasses: not tracked
        return None


def track(tensor: torch.Tensor, device_token: int, device_index: int) -> None:
    """Register ``tensor``'s storage as memory of the device (``device_token``: the driver
    object's ``id``; ``device_index`` for messages): a pool buffer or an op's output."""
    storage = _storage(tensor)
    if storage is None or storage.nbytes() == 0:
        return
    pointer = storage.data_ptr()
    entry = _REGISTRY.get(pointer)
    if entry is not None and entry[0] == device_token and entry[2]() is storage:
        return
    with _REGISTRY_LOCK:
        _REGISTRY[pointer] = (device_token, device_index, weakref.ref(storage))
        if len(_REGISTRY) > 2 * _PRUNED[0]:
            dead = [key for key, (_, _, ref) in _REGISTRY.items() if ref() is None]
            for key in dead:
                del _REGISTRY[key]
            _PRUNED[0] = max(4096, len(_REGISTRY))


def forget(tensor: torch.Tensor) -> None:
    """Make ``tensor``'s storage host memory again (a copy the host will read)."""
    storage = _storage(tensor)
    if storage is not None:
        with _REGISTRY_LOCK:
            _REGISTRY.pop(storage.data_ptr(), None)


def owner(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(device token, device_index)`` of the device that holds ``tensor``, ``None`` for host memory."""
    storage = _storage(tensor)
    if storage is None:
        return None
    entry = _REGISTRY.get(storage.data_ptr())
    if entry is None or entry[2]() is not storage:
        return None
    return entry[0], entry[1]


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host memory, made inside a device op for the host to read later (the
    CPU driver's form of a non-blocking device-to-host copy into pinned memory)."""
    with _suspended():
        copy = tensor.detach().clone()
    forget(copy)
    return copy


# ---------------------------------------------------------------------- counting
class SyncCounter:
    """Host syncs counted inside device ops while :func:`count_syncs` is active.

    Attributes:
        total: syncs counted.
        sites: ``Counter`` of ``(op kind, what, "file:line")``: op kind ``F``/``X``/``R``/``B``,
            what synced (``.item()``, ``aten.nonzero``...), the Python line that did it.
    """

    def __init__(self) -> None:
        self.total = 0
        self.sites: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def add(self, kind: str, what: str, line: str) -> None:
        with self._lock:
            self.total += 1
            self.sites[(kind, what, line)] += 1

    def report(self, steps: int = 1) -> str:
        """The counts as text, most frequent first, per step."""
        lines = [f"{self.total / steps:g} host syncs per step inside device ops"]
        for (kind, what, line), count in self.sites.most_common():
            lines.append(f"  {count / steps:g}/step  {kind}  {what}  at {line}")
        return "\n".join(lines)


@contextlib.contextmanager
def count_syncs() -> Iterator[SyncCounter]:
    """Count host syncs inside device ops of CPU virtual devices (every thread) instead of raising
    (the checking mode raises at the first one); also turns the op scopes on without the checking mode.

    Yields:
        the :class:`SyncCounter`, complete once the devices finished the ops issued inside the block.
    """
    counter = SyncCounter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


# ---------------------------------------------------------------------- the scope of one op
class _Op:
    __slots__ = ("token", "device_index", "label", "compute", "checking", "quiet", "upload", "host_factory")

    def __init__(self, token: int, device_index: int, label: str, compute: bool, checking: bool) -> None:
        self.token, self.device_index, self.label = token, device_index, label
        self.compute, self.checking = compute, checking
        self.quiet = 0  # > 0: inside a conversion the function mode already judged, or our own copies
        self.upload = 0  # > 0: inside `t.to(device)` (a host-to-device copy, legal in an op)
        self.host_factory = 0  # > 0: inside a factory call without `device=` (its output is a host tensor)


def _current() -> _Op | None:
    return getattr(_LOCAL, "op", None)


def unchecked():
    """Context manager: run a block of a device op without the host-sync and placement checks
    (test instrumentation, debugging; what the block makes is still the device's), as setting
    ``torch.cuda.set_sync_debug_mode("default")`` around it would on CUDA. Outside an op: nothing."""
    return _suspended()


@contextlib.contextmanager
def _suspended():
    op = _current()
    if op is not None:
        op.quiet += 1
    try:
        yield
    finally:
        if op is not None:
            op.quiet -= 1


def op_scope(driver: Any, stream: str, label: str, checking: bool):
    """Context manager around one op of a CPU virtual device, on the stream's worker thread.

    Args:
        driver: the device's driver (``device_index`` is read; its ``id`` tells devices apart).
        stream: the op's stream (syncs and placement are checked on ``compute``; every stream
            registers the device tensors its ops make).
        label: the op for messages (``"stage 2, F(2, mb 1)"``).
        checking: the checking mode is on (raise); off: only :func:`count_syncs` counts, if active.
    """
    if not checking and not _COUNTERS:
        return contextlib.nullcontext()
    return _scope(_Op(id(driver), driver.device_index, label, stream == "compute", checking))


@contextlib.contextmanager
def _scope(op: _Op):
    previous = _current()
    _LOCAL.op = op
    try:  # copy streams only register what their ops make (a buffer's own copy): no function mode there
        with (_FunctionChecks() if op.compute else contextlib.nullcontext()), _DispatchChecks():
            yield
    finally:
        _LOCAL.op = previous


@contextlib.contextmanager
def both(first: Any, second: Any):
    """Enter two context managers, ``first`` outermost."""
    with first, second:
        yield


def _op_kind(label: str) -> str:
    tail = label.rsplit(", ", 1)[-1]
    return "".join(c for c in tail.split("(", 1)[0] if c.isalpha()) or tail


def _op_text(label: str) -> str:
    """``"stage 2, 2F1"`` -> ``"F(stage 2, mb 1)"`` (an op's string form ``<stage><kind><microbatch>``)."""
    match = re.fullmatch(r"(\d+)([A-Z]+)(\d*)", label.rsplit(", ", 1)[-1])
    if match is None:
        return label
    stage, kind, microbatch = match.groups()
    return f"{kind}(stage {stage}" + (f", mb {microbatch})" if microbatch else ")")


def _site() -> tuple[str, list[str]]:
    """The Python line outside torch (and this module) that runs now, and the classes of the modules
    whose ``forward`` is running (outermost first)."""
    frame = sys._getframe(2)
    line = None
    modules: list[str] = []
    while frame is not None:
        path = frame.f_code.co_filename
        if line is None and not path.startswith(_SKIP_DIRS) and "contextlib" not in os.path.basename(path):
            line = f"{path}:{frame.f_lineno}"
        owner_module = frame.f_locals.get("self")
        if isinstance(owner_module, torch.nn.Module) and frame.f_code.co_name in ("forward", "_call_impl"):
            name = type(owner_module).__name__
            if not modules or modules[0] != name:
                modules.insert(0, name)
        frame = frame.f_back
    return line or "<unknown>", modules


def _layer_text(modules: list[str]) -> str:
    if not modules:
        return "outside any layer's forward (the backward, or the executor)"
    return f"in `{modules[0]}`" + (f" > `{modules[-1]}`" if len(modules) > 1 else "")


def _sync(op: _Op, what: str) -> None:
    line, modules = _site()
    for counter in list(_COUNTERS):
        counter.add(_op_kind(op.label), what, line)
    if op.checking and not _COUNTERS:
        raise HostSyncError(
            f"RoundPipe checking mode: host sync inside device op `{_op_text(op.label)}` on device {op.device_index}: {what} of a"
            f" device tensor, {_layer_text(modules)}, at {line}. On a GPU this blocks the op's issuing thread until the"
            " device catches up (`torch.cuda.set_sync_debug_mode('error')` raises here). HINT: decide data-dependent"
            " things on the host before upload and carry the decision as data, or keep the value on the device"
            " (`torch.where` instead of `if`, a fixed `output_size`).")


def _is_device(op: _Op, tensor: Any) -> bool:
    if not isinstance(tensor, torch.Tensor):
        return False
    where = owner(tensor)
    return where is not None and where[0] == op.token


def _describe(tensor: torch.Tensor) -> str:
    text = f"a {tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')} tensor"
    name = _attribute_of(tensor)
    return text + (f" (`{name}`)" if name else "")


def _attribute_of(tensor: torch.Tensor) -> str | None:
    """``Class.attribute`` of a running module (any frame's ``self``) that holds ``tensor``."""
    storage = _storage(tensor)
    pointer = None if storage is None else storage.data_ptr()
    frame = sys._getframe(1)
    seen: set[int] = set()
    while frame is not None:
        module = frame.f_locals.get("self")
        if isinstance(module, torch.nn.Module) and id(module) not in seen:
            seen.add(id(module))
            for sub_name, sub in module.named_modules():
                tables = [("", vars(sub)), ("parameter ", sub._parameters), ("buffer ", sub._buffers)]
                for kind, table in tables:
                    for key, value in table.items():
                        if isinstance(value, torch.Tensor) and (value is tensor or (
                                pointer is not None and _storage(value) is not None and _storage(value).data_ptr() == pointer)):
                            where = f"{type(module).__name__}" + (f".{sub_name}" if sub_name else "")
                            return f"{kind}{where}.{key}" + (" (a plain attribute: neither a parameter nor a buffer)"
                                                               if not kind else " (not the uploaded copy)")
        frame = frame.f_back
    return None


def _placement(op: _Op, func: Any, tensor: torch.Tensor, other: tuple[int, int] | None) -> None:
    line, modules = _site()
    if other is not None:
        problem = f"reads {_describe(tensor)} held by device {other[1]}"
        hint = "move it with an op of this device (`t.to(device)`), or let the program transfer it"
    else:
        problem = f"reads {_describe(tensor)} that was never uploaded to the device (host memory) with device tensors"
        hint = ("register it as a buffer (`self.register_buffer(name, tensor, persistent=False)`) so it is uploaded with"
                " the layer's stage, or create it on the input's device (`device=x.device`)")
    raise PlacementError(
        f"RoundPipe checking mode: device op `{_op_text(op.label)}` on device {op.device_index} {problem} in `{func}`,"
        f" {_layer_text(modules)}, at {line}. On a GPU this fails with \"Expected all tensors to be on the same"
        f" device\". HINT: {hint}.")


class _FunctionChecks(TorchFunctionMode):
    """Python-level conversions of device tensors (``.item()``, ``bool``, ``.tolist()``...), uploads
    inside an op (``t.to(device)``) and factories without ``device=``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _current()
        if op is None or op.quiet:
            return func(*args, **kwargs)
        what = _SCALAR_METHODS.get(func)
        if what is not None:
            if op.compute and args and _is_device(op, args[0]):
                _sync(op, what)
            op.quiet += 1
            try:
                return func(*args, **kwargs)
            finally:
                op.quiet -= 1
        if (func is torch.Tensor.to and args and _moves(args, kwargs) and _storage(args[0]) is not None
                and not _is_device(op, args[0])):  # (not a `vmap` wrapper, which has no storage)
            op.upload += 1
            try:
                out = func(*args, **kwargs)
            finally:
                op.upload -= 1
            if out is args[0]:  # the CPU driver's device is the host: copy as a GPU would
                with _suspended():
                    out = out.clone()
            track(out, op.token, op.device_index)
            return out
        if func in _FACTORIES:
            if kwargs.get("device") is not None:  # made on the device (`torch.tensor(data, device=...)`)
                out = func(*args, **kwargs)
                _track_outputs(out, op)
                return out
            op.host_factory += 1
            try:
                return func(*args, **kwargs)
            finally:
                op.host_factory -= 1
        return func(*args, **kwargs)


def _moves(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call names a device (``to(device)``, ``to(other_tensor)``, ``device=``)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an ATen op's arguments (directly or in a list: ``cat``, ``index``)."""
    out = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _track_outputs(out: Any, op: _Op) -> None:
    if isinstance(out, torch.Tensor):
        track(out, op.token, op.device_index)
    elif isinstance(out, (list, tuple)):
        for tensor in out:
            if isinstance(tensor, torch.Tensor):
                track(tensor, op.token, op.device_index)


class _DispatchChecks(TorchDispatchMode):
    """ATen-level checks: ``_local_scalar_dense`` and data-dependent shapes on device tensors,
    the placement of every tensor an op reads, and the registration of what ops make."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _current()
        if op is None:
            return func(*args, **kwargs)
        if op.quiet:  # not checked (a conversion judged above, our own copy); made on the device all the same
            out = func(*args, **kwargs)
            if func is not torch.ops.aten.copy_.default:
                _track_outputs(out, op)
            return out
        inputs = _tensors(args, kwargs)
        copy = func is torch.ops.aten.copy_.default
        device = False  # reads a tensor of this device
        host = None  # a host tensor of dimension >= 1 it reads
        for tensor in inputs:
            where = owner(tensor)
            if where is None:
                if host is None and tensor.dim() > 0 and tensor.numel() > 0:
                    host = tensor
                continue
            device = True
            if where[0] != op.token and op.compute and op.checking and not copy and not op.upload:
                _placement(op, func, tensor, where)
        if op.compute and device:
            self._syncs(op, func, args, kwargs)
        if op.compute and op.checking and device and host is not None and not copy and not op.upload:
            _placement(op, func, host, None)
        out = func(*args, **kwargs)
        if copy:
            return out  # the destination keeps its place (an upload into a pool, a download to the host)
        # outputs are the device's when the op read device tensors, or is a factory (not one called without
        # `device=`), or moves to the device; an op on host tensors only is a host op, as on a GPU
        if op.upload or (not op.host_factory and (device or not inputs or kwargs.get("device") is not None)):
            _track_outputs(out, op)
        return out

    @staticmethod
    def _syncs(op: _Op, func: Any, args: tuple, kwargs: dict) -> None:
        if func is torch.ops.aten._local_scalar_dense.default:
            _sync(op, "a Python value (`aten._local_scalar_dense`)")
            return
        if func is torch.ops.aten.copy_.default and args and owner(args[0]) is None and args[0].dim() > 0:
            _sync(op, "a device-to-host copy into host memory")
            return
        dynamic = _DYNAMIC.get(func)
        if dynamic is None:
            dynamic = _DYNAMIC[func] = any(tag in func.tags for tag in _DATA_DEPENDENT)
        if not dynamic:
            return
        name = func.overloadpacket.__name__
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if not any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                return  # integer indices: the output's shape is the indices'
            _sync(op, f"boolean-mask indexing (`aten.{name}`: its shape depends on the data)")
            return
        if name == "repeat_interleave" and kwargs.get("output_size") is not None:
            return
        _sync(op, f"`aten.{name}` (its output's shape depends on the data)")
