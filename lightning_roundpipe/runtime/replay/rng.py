"""Random numbers of pipelined layers: a generator per (layer, microbatch), private to the running call.

DESIGN.md section 5. A layer that draws random numbers in its current mode (:func:`rng_layers`:
dropout modules, Hugging Face attention dropout, PEFT's ``lora_dropout``) runs every forward
(``F``, the fused tail ``X`` and the recompute ``R``) inside :func:`rng_scope` with the seed
:func:`layer_seed` ``(base_seed, layer_index, microbatch_index)``:

- the scope pushes a ``TorchFunctionMode`` in the calling thread (torch function modes are
  thread-local: the device's compute thread sees it, no other thread does). Random ops that were
  not handed a generator get the scope's private generator: ``torch.rand*``/``randn*``/``randint*``/
  ``randperm``/``normal``/``bernoulli``/``multinomial``/``poisson``/``rrelu``, ``Tensor.bernoulli_``/
  ``uniform_``/``normal_``/``random_``/``exponential_``/..., ``nn.init.*`` (``generator=`` added);
  ``torch.dropout`` and its ``feature_``/``alpha_``/in-place variants (under ``F.dropout``,
  ``dropout1d/2d/3d``, ``alpha_dropout``, ``feature_alpha_dropout``, ``nn.Dropout*``, HF attention,
  PEFT) are computed here exactly as ATen's CPU kernel does it, with the noise drawn from the
  private generator (same dtype, ``1/(1-p)`` scaling, ``inplace=``, ``training=False`` as identity);
  ``torch.native_dropout`` likewise; ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` runs
  the math kernel ``aten._scaled_dot_product_attention_math`` with a ``dropout_mask`` drawn from the
  private generator on every device (the same kernel in a forward and its recompute). Torch's Python functions that draw
  inside (``F.dropout*``, ``F.rrelu``, ``F.gumbel_softmax``, ``F.multi_head_attention_forward``) run
  their own body with the mode active, and ``F.fractional_max_pool*`` gets its ``_random_samples``;
- the generator lives on the device of the op (a CPU generator for CPU virtual devices and for CPU
  ops, ``torch.Generator(device="cuda:i")`` on a GPU), one per (thread, device), created once and
  reseeded with the layer's seed at the layer's first draw. The same (layer, microbatch) therefore
  draws the same numbers in the forward and in its recomputation, on whichever device runs it, and
  with whatever device count: no process-wide lock, devices run random layers in parallel;
- on CUDA, ``torch.dropout`` runs ATen's fused kernel (``native_dropout``: its scale in fp32, as
  the default strategy's), and fused attention kernels called directly read the device's default
  generator: for that launch it is loaded with the private generator's state and restored right
  after, under a lock per GPU (logical devices sharing one GPU swap one at a time). Stacked RNNs with ``dropout > 0`` in training (``nn.LSTM``...: the
  kernel draws the dropout inside) and random ATen ops called directly (``torch.ops.aten...``) without
  a generator argument and not covered so raise ``ValueError``;
- a guard around every layer call (also of layers outside :func:`rng_layers`;
  :mod:`~lightning_roundpipe.runtime.replay.rng_guard`) raises ``ValueError`` when the layer itself
  drew from the global generator of the device it runs on (an op not covered above, or randomness
  ``module_uses_rng`` did not detect) instead of silently training with masks its recomputation does
  not replay: on CPU virtual devices, per thread, at the op, from the call after the one that saw the
  global generator advance (the main thread may draw from the same process-wide generator meanwhile);
  on CUDA, by comparing the device's default generator before and after, under the GPU's swap lock;
  an explicit ``generator=torch.default_generator`` in a random layer raises at once.

The engine's ``base_seed`` of each pipelined call that has random layers comes from the engine's own
``torch.Generator`` (``RoundPipeEngine.next_base_seed``), seeded once, at the first such call, with one
``torch.randint(0, 2**62, (1,))`` drawn from the global CPU generator in the main thread: so
``seed_everything`` still makes runs reproducible, and the main thread draws from the global
generator only once, not while an overlapped run's layers run (issue 30). Nothing else of a step
touches the global generators. The default strategy instead advances the global
generator by every mask it draws (an amount that depends on the mask sizes), so after a step the
global stream differs between the two, which matters only to code that draws from it later (a
shuffling sampler's next epoch); the masks themselves differ too (other generators). A random op
called with an explicit ``generator=`` keeps it (its replay is the caller's business). Overhead:
the torch calls of a random layer's forward pass through a Python handler (about 1-3 us each);
other layers run without the mode.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import threading
import types
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_roundpipe.adapters.base import LayerSequence, module_uses_rng
from lightning_roundpipe.runtime.replay.rng_guard import (CUDA_SWAP_LOCKS, cuda_swap_lock, generator_state,
                                                         global_draw_guard, global_draw_message)

_local = threading.local()
# the math kernel warns once that `dropout_mask` is meant for tests; here it is the point
warnings.filterwarnings("ignore", message="Dropout mask should only be used for testing purposes")


def layer_seed(base_seed: int, layer_index: int, microbatch_index: int) -> int:
    """Seed of one (layer, microbatch), independent of which device runs it.

    Args:
        base_seed: the pipelined call's seed (``PipelineState.base_seed``).
        layer_index: index of the layer in the :class:`LayerSequence`.
        microbatch_index: index of the microbatch in the call.

    Returns:
        A non-negative int below ``2**63``: the first 8 bytes (little endian) of the BLAKE2b digest
        of ``"{base_seed}:{layer_index}:{microbatch_index}"``, shifted right by one bit.
    """
    digest = hashlib.blake2b(f"{base_seed}:{layer_index}:{microbatch_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rng_layers(seq: LayerSequence) -> frozenset:
    """Indices of the layers of ``seq`` that draw random numbers in their current mode
    (:func:`~lightning_roundpipe.adapters.base.module_uses_rng`); only these run with a seed."""
    return frozenset(i for i, layer in enumerate(seq.layers) if module_uses_rng(layer))


@contextlib.contextmanager
def rng_scope(seed: int | None, device: torch.device, layer_index: int | None = None):
    """Run one layer call; with a ``seed``, its random ops draw from generators private to this call
    and thread, seeded with ``seed`` (one per device the ops run on).

    Args:
        seed: the layer's :func:`layer_seed`; ``None``: the layer is not random (no mode is pushed).
        device: the device the layer runs on (``cpu`` for CPU virtual devices, ``cuda:i``).
        layer_index: the layer's index, for error messages.

    Raises:
        ValueError: a random ATen op that cannot be given a private generator (named in the
            message), or the layer drew from the global generator of ``device``
            (:func:`~lightning_roundpipe.runtime.replay.rng_guard.global_draw_guard`).
    """
    device = torch.device(device)
    with global_draw_guard(device, seed is not None, layer_index):
        if seed is None:
            yield
        else:
            with _PrivateRandomMode(seed, layer_index):
                yield


def _thread_generator(device: torch.device) -> torch.Generator:
    """This thread's generator on ``device`` (created once per thread and device)."""
    generators = getattr(_local, "generators", None)
    if generators is None:
        generators = _local.generators = {}
    gen = generators.get(device)
    if gen is None:
        gen = generators[device] = torch.Generator(device=device)
    return gen


def _normalize(device: torch.device) -> torch.device:
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device


class _PrivateRandomMode(TorchFunctionMode):
    """Gives random torch calls the scope's private generator (see the module docstring); every
    other call is made unchanged."""

    def __init__(self, seed: int, layer_index: int | None = None) -> None:
        super().__init__()
        self.seed = seed
        self.layer_index = layer_index
        self._seeded: dict[torch.device, torch.Generator] = {}
        self._in_body: set = set()

    def generator(self, device: torch.device) -> torch.Generator:
        """The private generator on ``device``, seeded with the scope's seed at its first use here."""
        device = _normalize(torch.device(device))
        gen = self._seeded.get(device)
        if gen is None:
            gen = _thread_generator(device)
            gen.manual_seed(self.seed)
            self._seeded[device] = gen
        return gen

    def refuse_default(self, generator: torch.Generator, func) -> None:
        """Raise ``ValueError`` when a random call was handed a global default generator explicitly
        (its recomputation would draw other numbers)."""
        if generator is torch.default_generator or (
                generator.device.type == "cuda" and any(generator is g for g in torch.cuda.default_generators)):
            name = getattr(func, "__name__", str(func))
            raise ValueError(global_draw_message(str(generator.device), name, True, self.layer_index))

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = _RULES.get(func, _MISSING)
        if rule is _MISSING:
            rule = _RULES[func] = _rule_of(func)
        if rule is None:
            return func(*args, **kwargs)
        return rule(self, func, args, kwargs)


# ---------------------------------------------------------------------- rules
_MISSING = object()
_RULES: dict[Any, Any] = {}


def _op_device(args: tuple, kwargs: dict) -> torch.device:
    """Device of a call: its first tensor argument's, else its ``device=``, else the default device."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    return item.device
    device = kwargs.get("device")
    return _normalize(torch.device(device) if device is not None else torch.get_default_device())


def _bind(names: tuple, defaults: dict, args: tuple, kwargs: dict) -> dict:
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def _with_generator(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
    """Functions with a ``generator=`` argument: the private one unless the caller gave one."""
    given = kwargs.get("generator") or next((a for a in args if isinstance(a, torch.Generator)), None)
    if given is not None:
        mode.refuse_default(given, func)
        return func(*args, **kwargs)
    device = _op_device(args, kwargs)
    if device.type == "meta":
        return func(*args, **kwargs)
    return func(*args, **{**kwargs, "generator": mode.generator(device)})


def _dropout(feature: bool, alpha: bool, inplace: bool) -> Callable:
    """``torch.dropout`` and variants (``input, p, train``): ATen's ``_dropout_impl``, noise drawn
    from the private generator (bitwise what ATen's CPU kernel gives from a generator in that state)."""

    def rule(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
        bound = _bind(("input", "p", "train"), {}, args, kwargs)
        x, p, train = bound["input"], float(bound["p"]), bool(bound["train"])
        if not 0 <= p <= 1:
            raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
        if p == 0 or not train or x.numel() == 0:
            return x
        if p == 1:
            zero = torch.zeros((), dtype=x.dtype, device=x.device)
            return x.mul_(zero) if inplace else x * zero
        if x.device.type == "cuda" and not feature and not alpha:
            # CUDA's own fused kernel (its 1/(1-p) scale in fp32, as the default strategy computes it;
            # noise.div_ in bf16 would scale by 1.0547 instead of 1/0.95 = 1.0526), on the private generator
            out = _on_default_cuda_generator(mode, x.device, torch.ops.aten.native_dropout.default, (x, p, True), {})[0]
            return x.copy_(out) if inplace else out
        if feature:
            if x.dim() < 2:
                raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
            noise = torch.empty((x.shape[0], x.shape[1]) + (1,) * (x.dim() - 2), dtype=x.dtype, device=x.device)
        else:
            noise = torch.empty_like(x)
        noise.bernoulli_(1 - p, generator=mode.generator(x.device))
        if not alpha:
            noise.div_(1 - p)
            return x.mul_(noise) if inplace else x * noise
        selu_alpha = 1.7580993408473766
        a = 1.0 / math.sqrt((selu_alpha * selu_alpha * p + 1) * (1 - p))
        b = noise.add(-1).mul_(selu_alpha * a).add_(selu_alpha * a * p)
        noise.mul_(a)
        return (x.mul_(noise) if inplace else x * noise).add_(b)

    return rule


def _native_dropout(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
    """``native_dropout(input, p, train)`` (the fused dropout of CUDA): ``(input * mask / (1 - p),
    mask)`` with a bool ``mask`` from the private generator; identity and an all-true mask when not training."""
    bound = _bind(("input", "p", "train"), {"train": None}, args, kwargs)
    x, p, train = bound["input"], float(bound["p"]), bound["train"]
    if x.numel() == 0:
        return x, torch.empty_like(x, dtype=torch.bool)
    if train is not None and not train:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = 1.0 - p
    mask = torch.empty_like(x, dtype=torch.uint8).bernoulli_(keep, generator=mode.generator(x.device)).to(torch.bool)
    return x.mul(mask).mul_(0.0 if keep == 0 else 1.0 / keep), mask


_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _sdpa(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
    """``F.scaled_dot_product_attention`` with ``dropout_p > 0``: the math kernel with a
    ``dropout_mask`` (True: keep) of shape ``(*batch, L, S)`` drawn from the private generator, on
    every device. On CUDA this pins the kernel: the fused backends' choice can differ between a
    forward without grad and its recompute with grad, and each draws its mask differently, so the
    recompute would not replay the forward's mask (attention dropout is rare in fine-tuning; the math
    kernel costs O(L*S) memory per head)."""
    bound = _bind(_SDPA_NAMES, _SDPA_DEFAULTS, args, kwargs)
    p = float(bound["dropout_p"])
    if p == 0:
        return func(*args, **kwargs)
    query, key = bound["query"], bound["key"]
    lead = query.shape[:-2] if bound["enable_gqa"] else torch.broadcast_shapes(query.shape[:-2], key.shape[:-2])
    mask = torch.empty((*lead, query.shape[-2], key.shape[-2]), dtype=torch.uint8, device=query.device)
    mask = mask.bernoulli_(1 - p, generator=mode.generator(query.device)).to(torch.bool)
    attn_mask = bound["attn_mask"]
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as the public function does (True: attend)
        attn_mask = torch.where(attn_mask, torch.zeros((), dtype=query.dtype, device=query.device),
                                torch.full((), float("-inf"), dtype=query.dtype, device=query.device))
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, bound["value"], attn_mask, p, bound["is_causal"], mask, scale=bound["scale"],
        enable_gqa=bound["enable_gqa"])[0]


def _on_default_cuda_generator(mode: _PrivateRandomMode, device: torch.device, func, args: tuple, kwargs: dict):
    """Launch ``func`` (it reads the device's default generator) with that generator in the private
    generator's state; afterwards the private generator continues where the kernel left it and the
    default generator is back in its own state."""
    private = mode.generator(device)
    index = private.device.index
    default = torch.cuda.default_generators[index]
    with cuda_swap_lock(index):  # several workers may share one GPU
        saved = generator_state(default)
        default.set_state(generator_state(private))
        try:
            return func(*args, **kwargs)
        finally:
            private.set_state(generator_state(default))
            default.set_state(saved)


#: One lock per GPU around the default-generator swap (logical devices on one GPU share its generator).
_CUDA_SWAP_LOCKS = CUDA_SWAP_LOCKS


def _fractional_max_pool(dims: int) -> Callable:
    """``F.fractional_max_pool{2,3}d``: torch's own ``_random_samples`` draw, from the private generator."""

    def rule(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
        x = args[0] if args else kwargs["input"]
        if (args[5] if len(args) > 5 else kwargs.get("_random_samples")) is None:
            args = args[:5]
            n_batch = 1 if x.dim() == dims + 1 else x.size(0)
            kwargs = {**kwargs, "_random_samples": torch.rand(
                n_batch, x.size(-dims - 1), dims, dtype=x.dtype, device=x.device, generator=mode.generator(x.device))}
        return func(*args, **kwargs)

    return rule


def _rnn(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
    """``torch.lstm``/``gru``/``rnn_tanh``/``rnn_relu`` (``nn.LSTM``...): their dropout between stacked
    layers is drawn inside the kernel (from the global CPU generator, or cuDNN's own state), so a
    stacked RNN with ``dropout > 0`` in training is refused; without it the call is made unchanged."""
    at = next((i for i, a in enumerate(args) if isinstance(a, float)), None)  # (..., num_layers, dropout, train, ...)
    if at is None or at + 1 >= len(args) or not (args[at] > 0 and args[at + 1] and args[at - 1] > 1):
        return func(*args, **kwargs)
    raise ValueError(
        f"RoundPipe cannot give the dropout of `torch.{func.__name__}` (an `nn.LSTM`/`nn.GRU`/`nn.RNN` with"
        f" `num_layers={args[at - 1]}, dropout={args[at]}`) the layer's private random generator: the kernel"
        " draws it internally, so its recomputation would not replay the same masks. HINT: stack single-layer RNN"
        " modules with `nn.Dropout` between them, or use `dropout=0`."
    )


_GUARDS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
_BODIES: dict[Any, Callable] = {}


def _no_guard(*args: Any) -> bool:
    return False


def _run_body(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
    """A torch Python function whose body draws random numbers: run that body with the mode active
    for the torch calls it makes (a copy of the function whose ``has_torch_function`` guards answer
    False, so it does not hand the call back to the mode)."""
    if func in mode._in_body:  # the copy still dispatched to the mode: run it as is
        return func(*args, **kwargs)
    body = _BODIES.get(func)
    if body is None:
        scope = dict(func.__globals__)
        scope.update({name: _no_guard for name in _GUARDS})
        body = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
        body.__kwdefaults__ = func.__kwdefaults__
        _BODIES[func] = body
    mode._in_body.add(func)
    try:
        with mode:
            return body(*args, **kwargs)
    finally:
        mode._in_body.discard(func)


def _explicit_rules() -> dict:
    rules: dict[Any, Callable] = {}
    for fn in (torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal, torch.bernoulli, torch.multinomial,
               torch.poisson, torch.binomial, torch.rand_like, torch.randn_like, torch.randint_like, torch.rrelu,
               torch.rrelu_, torch._standard_gamma, torch._sample_dirichlet):
        rules[fn] = _with_generator
    for name in ("bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_", "cauchy_",
                 "log_normal_", "multinomial"):
        rules[getattr(torch.Tensor, name)] = _with_generator
    for fn in vars(torch.nn.init).values():
        if inspect.isfunction(fn) and "generator" in inspect.signature(fn).parameters:
            rules[fn] = _with_generator
    for fn, feature, alpha, inplace in (
            (torch.dropout, False, False, False), (torch.dropout_, False, False, True),
            (torch.feature_dropout, True, False, False), (torch.feature_dropout_, True, False, True),
            (torch.alpha_dropout, False, True, False), (torch.alpha_dropout_, False, True, True),
            (torch.feature_alpha_dropout, True, True, False), (torch.feature_alpha_dropout_, True, True, True)):
        rules[fn] = _dropout(feature, alpha, inplace)
    rules[torch.native_dropout] = _native_dropout
    for fn in (torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu):
        rules[fn] = _rnn
    rules[F.scaled_dot_product_attention] = _sdpa
    for fn in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, F.rrelu,
               F.gumbel_softmax, F.multi_head_attention_forward):
        rules[fn] = _run_body
    for fn, dims in ((F.fractional_max_pool2d, 2), (F.fractional_max_pool2d_with_indices, 2),
                     (F.fractional_max_pool3d, 3), (F.fractional_max_pool3d_with_indices, 3)):
        rules[fn] = _fractional_max_pool(dims)
    return rules


_EXPLICIT = _explicit_rules()


def _rule_of(func) -> Callable | None:
    """The rule for calls of ``func`` inside the scope (``None``: call unchanged); cached per function."""
    rule = _EXPLICIT.get(func)
    if rule is not None:
        return rule
    if isinstance(func, torch._ops.OpOverload):
        return _aten_rule(func)
    if isinstance(func, torch._ops.OpOverloadPacket) and any(
            torch.Tag.nondeterministic_seeded in getattr(func, name).tags for name in func.overloads()):
        return _aten_packet
    return None


def _aten_packet(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
    """``torch.ops.aten.rand(...)``: the rule of the overload the call resolves to."""
    overload = getattr(func, torch._C._jit_resolve_packet(func._qualified_op_name, *args, **kwargs))
    rule = _RULES.get(overload, _MISSING)
    if rule is _MISSING:
        rule = _RULES[overload] = _rule_of(overload)
    return overload(*args, **kwargs) if rule is None else rule(mode, overload, args, kwargs)


# ---------------------------------------------------------------------- ATen ops called directly
def _schema_arg(func, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """Value of the schema argument ``name`` in a call of the ``OpOverload`` ``func``."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if not a.kwarg_only and i < len(args):
                return args[i]
            if name in kwargs:
                return kwargs[name]
            return a.default_value if a.has_default_value() else default
    return default


def _is_generator(arg) -> bool:
    t = arg.type
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return str(t) == "Generator"


def _aten_rule(func) -> Callable | None:
    """``torch.ops.aten...`` overloads tagged ``nondeterministic_seeded``: the private generator
    through their ``generator`` argument, or through the overload that has one
    (``aten.rand.default`` -> ``aten.rand.generator``); ``native_dropout`` as above; fused
    attention with ``dropout_p > 0`` on CUDA on the private generator's state; else an error."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    schema = list(func._schema.arguments)
    if any(_is_generator(a) for a in schema):
        return _aten_with_generator
    signature = [(a.name, a.kwarg_only) for a in schema]
    packet = func.overloadpacket
    for overload in packet.overloads():
        other = getattr(packet, overload)
        arguments = other._schema.arguments
        if any(_is_generator(a) for a in arguments) and [
                (a.name, a.kwarg_only) for a in arguments if not _is_generator(a)] == signature:
            return lambda mode, _, args, kwargs: _aten_with_generator(mode, other, args, kwargs)
    name = func.name()
    if name.endswith("_backward") or "no_dropout" in name:
        return None  # replays saved philox seeds, or draws nothing
    if name == "aten::native_dropout" and func._overloadname == "default":
        return _native_dropout
    names = {a.name for a in schema}
    if "dropout_p" in names:
        return _aten_fused_attention
    if "dropout" in names:
        return _aten_dropout_arg
    return _unsupported


def _aten_with_generator(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
    name = next(a.name for a in func._schema.arguments if _is_generator(a))
    given = _schema_arg(func, args, kwargs, name)
    if given is not None:
        mode.refuse_default(given, func)
        return func(*args, **kwargs)
    device = _op_device(args, kwargs)
    if device.type == "meta":
        return func(*args, **kwargs)
    return func(*args, **{**kwargs, name: mode.generator(device)})


def _aten_fused_attention(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
    if not _schema_arg(func, args, kwargs, "dropout_p"):
        return func(*args, **kwargs)
    device = _op_device(args, kwargs)
    if device.type != "cuda":
        return _unsupported(mode, func, args, kwargs)
    return _on_default_cuda_generator(mode, device, func, args, kwargs)


def _aten_dropout_arg(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
    """Ops with a ``dropout`` argument and randomness inside (cuDNN/MIOpen RNNs): fine without
    dropout or outside training, else unsupported."""
    if not _schema_arg(func, args, kwargs, "dropout") or _schema_arg(func, args, kwargs, "train", True) is False:
        return func(*args, **kwargs)
    return _unsupported(mode, func, args, kwargs)


def _unsupported(mode: _PrivateRandomMode, func, args: tuple, kwargs: dict):
    name = func.name()
    if "rnn" in name:
        hint = (" HINT: give the RNN `dropout=0` and put an `nn.Dropout` between stacked RNN modules, or run it"
                " without cuDNN (`torch.backends.cudnn.flags(enabled=False)`).")
    elif "attention" in name:
        hint = " HINT: call `F.scaled_dot_product_attention` (covered) instead of the kernel, or pass `dropout_p=0`."
    else:
        hint = (" HINT: draw the random numbers with an op that takes `generator=` (`torch.bernoulli`,"
                " `Tensor.bernoulli_`, `torch.rand`, `F.dropout`...), or keep the module in eval mode.")
    raise ValueError(
        f"RoundPipe cannot give `{func}` on `{_op_device(args, kwargs)}` the layer's private random generator: it"
        " draws from a global generator, so its recomputation would not replay the same random numbers and the"
        f" devices would share that generator.{hint}"
    )
