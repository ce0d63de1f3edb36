"""The adapter contract: a model turned into a sequence of layers that pass a *carry* dict along.

Every layer is an ``nn.Module`` whose ``forward(carry: dict) -> dict`` takes the carry of the layer
before it. The runtime saves carries at stage boundaries (on the CPU), cuts batches into
microbatches before layer 0, and merges the last layer's carries back into the model's output.

A carry holds only what cannot be rebuilt (DESIGN.md section 4): values a layer reads that are
functions of carried entries (4D attention masks, rotary tables) are *derived carry entries*
(:class:`DerivedCarry`), rebuilt on the device by the first layer of a stage that reads them and
never put into a carry, so they never cross a stage boundary nor are saved on the host.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class LayerSequence:
    """A pipelinable view of one model.

    Attributes:
        target: the module whose ``forward`` the strategy replaces by the pipelined one.
        layers: the layer modules in order; ``layers[i](carry) -> carry``. They reference the
            model's own submodules (no copies), so the model's parameters stay the master weights.
        layer_names: one label per layer for tables and error messages.
        grad_keys: carry keys whose floating-point tensors carry gradients between stages (e.g.
            ``("hidden_states",)``); other carry entries (the 2D mask, position ids, labels) are constants.
        prepare: ``prepare(args, kwargs) -> carry`` for the whole batch (before the split into
            microbatches); raises ``TypeError``/``ValueError`` for inputs the adapter cannot pipeline.
        finalize: ``finalize(merged_carry) -> output`` builds what the original ``forward`` would return
            from the last layer's carry merged over microbatches (tensors of dim >= 1 concatenated
            along dim 0, 0-dim tensors summed).
        family: a short name of the model family (``"llama"``, ``"nn.Sequential"``...).
        loss_key: key of the last layer's carry that holds the model's own scalar loss, when the
            model can compute one (HF causal LM called with ``labels``); enables the fused path.
        has_loss: ``has_loss(batch_carry) -> bool``: whether this call computes that loss.
        additive_scalars: 0-dim outputs are per-microbatch contributions that sum to the batch's
            value (the HF loss normalised by the whole batch's label tokens). Otherwise every output
            must carry the batch on dim 0, and a 0-dim output is an error.
        routing: mixture-of-experts layers: which layers route tokens (their routing is recorded
            in the forward and replayed in recomputation) and how the whole batch's routing
            enters the outputs (:class:`RoutingSpec`); ``None`` for dense models.
        host_call: ``host_call(args, kwargs) -> bool``: whether this call must run the model's own
            forward, un-pipelined on the host (a KV cache, hidden states...: what ``prepare`` cannot
            pipeline); ``None``: every call is pipelined. It raises ``ValueError`` for a call that can
            run neither way (the HF adapter: extra keys; unpipelined arguments with gradients).
        derived: the entries the layers rebuild from the carry instead of carrying them
            (:class:`DerivedCarry`: attention masks, rotary tables); ``None`` when there are none.
        boundary_bytes: ``boundary_bytes(kwargs, dtype, num_microbatches=1) -> int``: bytes one stage
            boundary's carries hold, all microbatches together, for a call with these keyword
            arguments (the model's own, ``input_ids`` of shape ``(batch, seq)``...) and hidden states
            of ``dtype`` (the compute dtype): what crosses each hop device -> host -> device and what
            the host saves there; ``None``: not known for this adapter.
        restore: ``restore()`` undoes what building the sequence changed on the model (the HF
            adapter turns Hugging Face gradient checkpointing off); the strategy calls it when it
            tears down; ``None``: nothing to undo.
        prepare_microbatch: ``prepare_microbatch(carry) -> carry`` for one microbatch's carry, on
            the host after the split and before upload: decisions that depend on the microbatch's
            data (the HF adapter's attention layout: a microbatch without padding takes the causal
            path, as the model's own forward on those rows does), made here so that no device op
            reads a value; ``None``: the split carries are used as they are.
    """

    target: nn.Module
    layers: list[nn.Module]
    layer_names: list[str]
    grad_keys: tuple[str, ...]
    prepare: Callable[[tuple, dict], dict]
    finalize: Callable[[dict], Any]
    family: str = ""
    loss_key: str | None = None
    has_loss: Callable[[dict], bool] | None = None
    additive_scalars: bool = False
    routing: "RoutingSpec | None" = None
    host_call: Callable[[tuple, dict], bool] | None = None
    derived: "DerivedCarry | None" = None
    boundary_bytes: Callable[..., int] | None = None
    restore: Callable[[], None] | None = None
    prepare_microbatch: Callable[[dict], dict] | None = None

    def __len__(self) -> int:
        return len(self.layers)

    def parameters(self):
        """Unique parameters of all layers (tied ones once), in layer order."""
        seen: set[int] = set()
        for layer in self.layers:
            for p in layer.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p


@dataclass
class RoutingSpec:
    """Routing layers of a mixture-of-experts :class:`LayerSequence` (issue 10 item 1).

    Attributes:
        layers: indices of the layers whose calls run inside
            :func:`~lightning_roundpipe.runtime.replay.routing.routing_scope` (record in the forward,
            replay in recomputation).
        needs_totals: ``needs_totals(batch_carry) -> bool``: whether this call's recomputation
            reads whole-batch routing statistics (the load-balancing loss is on); the engine then
            starts no recomputation of a routing layer before every microbatch's forward passed
            every routing layer.
        outputs: ``outputs(store, batch_carry) -> {key: 0-dim tensor}``: values added to the merged
            outputs after the forward (the load-balancing loss from the whole batch's statistics;
            its gradient the recomputation adds), or ``None``.
    """

    layers: frozenset[int]
    needs_totals: Callable[[dict], bool]
    outputs: Callable[[Any, dict], dict] | None = None


#: attribute of a carry's anchor tensor holding the derived entries built for that copy of the carry
_DERIVED_ATTR = "_roundpipe_derived"


def _version(value: Any) -> int | None:
    """In-place version of a tensor (``None``: not a tensor, or an inference tensor, which has none)."""
    if not isinstance(value, torch.Tensor) or value.is_inference():
        return None
    return value._version


class DerivedCarry(nn.Module, abc.ABC):
    """Derived carry entries: values layers read that are functions of carried entries, rebuilt on
    the device instead of crossing stage boundaries (DESIGN.md section 4).

    The contract, for an adapter whose layers need such values (a 4D attention mask of
    ``O(seq^2)`` bytes, rotary ``cos``/``sin`` tables):

    - a layer never puts a derived entry into the carry it returns; it reads one with
      :meth:`get`, so what crosses a boundary and what the host saves for recomputation are the
      carried entries only (:attr:`sources` and whatever else the adapter carries: labels...);
    - :meth:`get` builds an entry with :meth:`build` the first time a layer reads it from a given
      copy of the carry, and keeps it on that copy's :attr:`anchor` tensor. The runtime copies every
      tensor of a carry at each stage boundary (host to device), so each stage builds an entry
      once, on its own device, with the first of its layers that reads it; the entry is freed with
      the stage's carry, and a stage whose layers do not read an entry never builds it. A kept
      entry is used again only while what it was built from is unchanged: the same module (or a
      replica of it), the same tensor objects under :attr:`sources` (same in-place version), and
      the same shape, dtype and device of those under :attr:`shape_sources` (the hidden states, new
      at every layer); otherwise it is rebuilt (a caller passing the same ``position_ids`` tensor
      to two calls with different masks, or to two models);
    - the module is a submodule of every layer that reads derived entries, so its parameters and
      buffers (the rotary ``inv_freq``) are uploaded with every stage that reads them, once per
      stage (layers share the tensors).

    Args:
        entries: names of the entries :meth:`build` makes.
        sources: the carried entries they are built from, by value.
        anchor: the carried entry whose tensor keeps the built entries (an entry every layer
            passes on unchanged, and that every stage boundary copies); one of ``sources``.
        shape_sources: carried entries the entries depend on only through their shape, dtype and
            device.

    Raises:
        ValueError: when ``anchor`` is not one of ``sources``.
    """

    def __init__(self, entries: tuple[str, ...], sources: tuple[str, ...], anchor: str,
                 shape_sources: tuple[str, ...] = ()) -> None:
        super().__init__()
        if anchor not in sources:
            raise ValueError(f"The anchor `{anchor}` of derived carry entries must be one of their sources {list(sources)}.")
        self.entries = tuple(entries)
        self.sources = tuple(sources)
        self.anchor = anchor
        self.shape_sources = tuple(shape_sources)
        # the kept entries belong to this module: shared by its per-device replicas (shallow copies
        # keep plain attributes), distinct for another model's, whose masks or tables may differ
        self._owner = object()

    @abc.abstractmethod
    def build(self, carry: dict, name: str) -> Any:
        """Entry ``name`` from the carried entries of ``carry``, on their device."""

    def _key(self, carry: dict) -> tuple:
        """What the kept entries were built from: the versions of the tensors under ``sources``
        (their identity is checked apart, without keeping the anchor alive from itself), and the
        shape, dtype and device of the tensors under ``shape_sources``."""
        versions = tuple(_version(carry.get(k)) for k in self.sources)
        shapes = tuple((tuple(t.shape), t.dtype, t.device) if isinstance(t := carry.get(k), torch.Tensor) else type(t)
                       for k in self.shape_sources)
        return versions + shapes

    def get(self, carry: dict, name: str) -> Any:
        """Entry ``name`` for ``carry``: built once per copy of the carry (see the class docstring).

        Raises:
            KeyError: for a name not in :attr:`entries`.
            ValueError: when ``carry`` has no tensor under :attr:`anchor`.
        """
        if name not in self.entries:
            raise KeyError(f"`{type(self).__name__}` has no derived carry entry `{name}`; it has {list(self.entries)}.")
        anchor = carry.get(self.anchor)
        if not isinstance(anchor, torch.Tensor):
            raise ValueError(
                f"Derived carry entries of `{type(self).__name__}` are kept on the carried tensor `{self.anchor}`, but"
                f" the carry has {type(anchor).__name__} there (keys: {sorted(carry)}). HINT: the layer before must pass"
                f" `{self.anchor}` on unchanged.")
        others = (self._owner,) + tuple(carry.get(k) for k in self.sources if k != self.anchor)
        key = self._key(carry)
        kept = getattr(anchor, _DERIVED_ATTR, None)
        if (kept is None or kept[0] != key or len(kept[1]) != len(others)
                or any(a is not b for a, b in zip(kept[1], others))):
            kept = (key, others, {})
            setattr(anchor, _DERIVED_ATTR, kept)
        values = kept[2]
        if name not in values:
            values[name] = self.build(carry, name)
        return values[name]

    def forward(self, carry: dict) -> dict:
        """Every entry for ``carry``: ``{name: value}`` (what :meth:`get` returns for each)."""
        return {name: self.get(carry, name) for name in self.entries}


def module_uses_rng(module: nn.Module) -> bool:
    """Whether ``module`` draws random numbers in its current mode.

    True when some submodule sets ``roundpipe_uses_rng = True`` (an opt-in for randomness drawn
    otherwise), or, in training mode, is a dropout (``nn.Dropout*``, also PEFT's ``lora_dropout``)
    with ``p > 0``, an ``nn.RReLU``, or carries a float ``attention_dropout``/``dropout`` attribute
    above 0 (Hugging Face attention modules and ``nn.MultiheadAttention`` apply dropout
    functionally). Such layers run under :func:`~lightning_roundpipe.runtime.replay.rng.rng_scope` with a
    per-(layer, microbatch) seed, so recomputation replays the forward's masks exactly, whichever
    device runs it; other layers run without a private generator (no overhead), and one that draws
    from torch's global generator makes the step raise ``ValueError``.
    """
    for m in module.modules():
        if getattr(m, "roundpipe_uses_rng", False) is True:
            return True
        if not m.training:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if isinstance(m, nn.RReLU):
            return True
        for attr in ("attention_dropout", "dropout"):
            v = getattr(m, attr, None)
            if isinstance(v, float) and v > 0:
                return True
    return False


def is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def compiled_modules(root: nn.Module, target: nn.Module) -> list[str]:
    """Names in ``root`` (``""``: ``root`` itself) of the compiled modules around or inside ``target``:
    a ``torch.compile(module)`` wrapper (``OptimizedModule``), a module compiled in place
    (``module.compile()``) or one whose ``forward`` is a compiled function
    (``module.forward = torch.compile(module.forward)``), on the way from ``root`` down to
    ``target`` or among ``target``'s submodules."""
    inside = {id(m) for m in target.modules()}
    path = next((n for n, m in root.named_modules() if m is target), None)
    parts = path.split(".") if path else []
    above = {".".join(parts[:i]) for i in range(len(parts))} if path is not None else set()
    found = []
    for name, module in root.named_modules():
        related = id(module) in inside or name in above
        state = module.__dict__
        compiled = ((type(module).__name__ == "OptimizedModule" and "_orig_mod" in module._modules)
                    or state.get("_compiled_call_impl") is not None
                    or hasattr(state.get("forward"), "_torchdynamo_orig_callable"))
        if related and compiled:
            found.append(name)
    return found


def check_not_compiled(root: nn.Module, target: nn.Module) -> None:
    """Refuse a compiled ``target`` (:func:`compiled_modules`): RoundPipe runs the layers of the
    module it pipelines itself, on per-device replicas.

    Raises:
        ValueError: naming the compiled modules, with a HINT.
    """
    found = compiled_modules(root, target)
    if found:
        names = ", ".join(f"`{n}`" if n else f"the `{type(root).__name__}` itself" for n in found[:4])
        names += f" and {len(found) - 4} more" if len(found) > 4 else ""
        raise ValueError(
            f"RoundPipe cannot pipeline a compiled model: {names} {'is' if len(found) == 1 else 'are'} compiled"
            " (`torch.compile(module)`, `module.compile()` or a compiled `forward`). RoundPipe runs the model's layers"
            " itself, one stage at a time on each device's copy of them: a compiled call around the model would trace"
            " the pipeline's threads and queues (an internal dynamo error), and a layer compiled in place would run on"
            " the CPU master weights instead of the uploaded ones. HINT: pass the model uncompiled (drop"
            " `torch.compile(...)`/`.compile()`), or train the compiled model with the default strategy."
        )
