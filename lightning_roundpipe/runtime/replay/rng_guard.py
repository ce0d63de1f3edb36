"""The guard around every pipelined layer call: a layer must not draw from torch's global generators.

A layer that draws random numbers from a global generator (an op :mod:`.rng` does not give the
layer's private generator, or randomness ``module_uses_rng`` did not detect) would draw other
numbers in its recomputation; the guard raises ``ValueError`` instead of training with masks the
backward does not replay. It checks only the generator of the device the layer runs on, and only
draws made by the layer itself (issue 30: the main thread draws from the global CPU generator while
an overlapped run's layers run, and must not be blamed on them):

- **CPU virtual devices**: the device's generator *is* the process-wide CPU generator, from which
  the main thread (user code, data loading) and other devices' threads may draw at any time, so a
  before/after comparison cannot tell whose draw it saw. It only makes the layer *suspect*: from its
  next call on (the next microbatch, or its own recomputation, which comes after the forward it
  would not replay), the layer runs under :class:`_GlobalDrawGuard`, a ``TorchDispatchMode`` pushed
  in the calling thread (dispatch modes are thread-local: no other thread sees it), which raises at
  the first ATen op tagged ``torch.Tag.nondeterministic_seeded`` that the layer's thread calls
  without a generator (or with the global one), naming it; ops that draw nothing in that call
  (``train=False``, ``dropout_p=0``, the backward kernels replaying saved seeds) pass. So a layer
  that draws from the global generator fails the step, at the latest in its recomputation, before
  a backward with the wrong masks completes, and another thread's draw only costs the guard for
  that layer (every ATen op of its calls through a Python handler, a few microseconds each; 1.5-1.7x
  the step of the tests' tiny Llama, ``benchmarks/rng_guard.py``); layers never suspected pay two
  reads of the generator's state per call. A random layer handed the global generator explicitly
  (``generator=torch.default_generator``) raises at once (:mod:`.rng`);
- **CUDA**: the device's default generator (``torch.cuda.default_generators[i]``) is compared before
  and after the call, each read under the GPU's swap lock (:data:`CUDA_SWAP_LOCKS`), so a logical
  device on the same GPU that is loading a private state into it for a fused kernel (:mod:`.rng`) is
  never seen mid-swap. CPU ops of a CUDA layer are not checked (the main thread's draws would be
  blamed on them).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: One lock per GPU around reads and swaps of its default generator (logical devices on one GPU share it).
CUDA_SWAP_LOCKS: dict[int, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def cuda_swap_lock(index: int) -> threading.Lock:
    """The swap lock of GPU ``index`` (created once)."""
    lock = CUDA_SWAP_LOCKS.get(index)
    if lock is None:
        with _LOCKS_LOCK:
            lock = CUDA_SWAP_LOCKS.setdefault(index, threading.Lock())
    return lock


_COLLECTOR_LOCK = threading.Lock()
_COLLECTOR_HOLDS = [0, False]  # threads inside generator_state, whether the collector was on at the first


def _pause_collector() -> None:
    with _COLLECTOR_LOCK:
        if _COLLECTOR_HOLDS[0] == 0:
            _COLLECTOR_HOLDS[1] = gc.isenabled()
            gc.disable()
        _COLLECTOR_HOLDS[0] += 1


def _resume_collector() -> None:
    with _COLLECTOR_LOCK:
        _COLLECTOR_HOLDS[0] -= 1
        if _COLLECTOR_HOLDS[0] == 0 and _COLLECTOR_HOLDS[1]:
            gc.enable()


def generator_state(generator: torch.Generator) -> torch.Tensor:
    """``generator.get_state()`` (a ``uint8`` tensor: 5056 bytes for the CPU generator, 16 for a
    CUDA one) with Python's cyclic garbage collector kept from starting meanwhile, in any thread
    (counted across threads; turned back on by the last thread out, and only if it was on), so the
    read cannot deadlock with another thread's (see the module docstring). About 3 us more than
    ``get_state`` (8 us with a ``contextmanager``).
    """
    _pause_collector()
    try:
        return generator.get_state()
    finally:
        _resume_collector()


@contextlib.contextmanager
def global_draw_guard(device: torch.device, seeded: bool, layer_index: int | None):
    """Run one layer call on ``device``; raise ``ValueError`` if it drew from the device's global
    generator (see the module docstring).

    Args:
        device: the device the layer runs on (``cpu`` for CPU virtual devices, ``cuda:i``).
        seeded: whether the layer runs with a private generator (for the message).
        layer_index: the layer's index, for the message.

    Raises:
        ValueError: naming the layer, the generator and, on CPU, the op.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        with cuda_swap_lock(index):
            before = generator_state(generator)
        yield
        with cuda_swap_lock(index):
            after = generator_state(generator)
        if not torch.equal(before, after):
            raise ValueError(global_draw_message(f"cuda:{index}", None, seeded, layer_index))
        return
    if device.type != "cpu":
        yield
        return
    if layer_index in _SUSPECT:
        with _GlobalDrawGuard(seeded, layer_index):
            yield
        return
    before = generator_state(torch.default_generator)
    yield
    if not torch.equal(before, generator_state(torch.default_generator)):  # this layer, or another thread
        _SUSPECT.add(layer_index)


#: Layer indices whose call saw torch's global CPU generator advance: they run under the
#: per-thread guard from then on (see the module docstring).
_SUSPECT: set = set()


def global_draw_message(generator: str, op: str | None, seeded: bool, layer_index: int | None) -> str:
    """The guard's error message (Lightning's style: what, why, HINT)."""
    layer = "a layer" if layer_index is None else f"layer {layer_index}"
    through = f" (`{op}`)" if op else ""
    if seeded:
        why = (" through an op that RoundPipe does not give the layer's private generator to, so its recomputation"
               " would draw other numbers.")
        hint = (" HINT: draw them with ops that take `generator=` (`torch.bernoulli`, `Tensor.uniform_`, `torch.rand`,"
                " `F.dropout`...).")
    else:
        why = (", but RoundPipe did not detect it as random (`module_uses_rng`), so it ran without a private"
               " generator and its recomputation would draw other numbers.")
        hint = (" HINT: set `roundpipe_uses_rng = True` on the module that draws them (or use `nn.Dropout` modules,"
                " which draw nothing in eval mode).")
    return f"RoundPipe: {layer} drew random numbers from torch's global `{generator}` generator{through}{why}{hint}"


_DRAWS: dict[Any, Any] = {}  # OpOverload -> None (draws nothing) or the names it is checked by


def _draw_check(func) -> tuple | None:
    """``None`` for ops that never draw; else ``(generator argument name or None, schema argument
    names)`` of an op tagged ``nondeterministic_seeded`` (cached per op)."""
    check = _DRAWS.get(func, _DRAWS)
    if check is not _DRAWS:
        return check
    check = None
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) and not func.name().endswith("_backward"):
        arguments = func._schema.arguments
        generator = next((a.name for a in arguments if "Generator" in str(a.type)), None)
        check = (generator, tuple((a.name, a.kwarg_only, a.default_value if a.has_default_value() else None)
                                  for a in arguments))
    _DRAWS[func] = check
    return check


def _argument(names: tuple, args: tuple, kwargs: dict, name: str, missing: Any = None) -> Any:
    """The value of schema argument ``name`` in a call (its schema default when not passed;
    ``missing`` when the schema has no such argument)."""
    positional = 0
    for arg_name, kwarg_only, default in names:
        if arg_name == name:
            if not kwarg_only and positional < len(args):
                return args[positional]
            return kwargs.get(name, default)
        if not kwarg_only:
            positional += 1
    return missing


def _is_default_cpu_generator(generator: torch.Generator) -> bool:
    """Whether ``generator`` is ``torch.default_generator`` (the dispatcher hands a new Python object
    for it to a dispatch mode: compared by device and state)."""
    return (generator.device.type == "cpu"
            and torch.equal(generator_state(generator), generator_state(torch.default_generator)))


def _draws_from_global(check: tuple, args: tuple, kwargs: dict) -> bool:
    generator_name, names = check
    for name in ("train", "training"):
        if _argument(names, args, kwargs, name, True) is False:
            return False
    if generator_name is not None:
        generator = _argument(names, args, kwargs, generator_name)
        return generator is None or _is_default_cpu_generator(generator)
    for name in ("dropout_p", "dropout"):
        value = _argument(names, args, kwargs, name, None)
        if value is not None and not value:
            return False
    return True


class _GlobalDrawGuard(TorchDispatchMode):
    """Raises at an ATen op of this thread that draws from torch's global CPU generator."""

    def __init__(self, seeded: bool, layer_index: int | None) -> None:
        super().__init__()
        self.seeded = seeded
        self.layer_index = layer_index

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = _DRAWS.get(func, _DRAWS)
        if check is _DRAWS:
            check = _draw_check(func)
        if check is not None and _draws_from_global(check, args, kwargs):
            raise ValueError(global_draw_message("cpu", str(func), self.seeded, self.layer_index))
        return func(*args, **kwargs)
