"""Where a worker's exception happened, as a note on the original exception (DESIGN.md section 4).

A stream thread that raises hands its exception to the main thread unchanged (same object: type,
attributes and traceback kept) with one ``add_note`` naming the device, the op, the stream, the
stage and the microbatch, and, when the exception was raised inside a layer, that layer's name in
the model (the module's qualified name, ``model.layers.3`` for the fourth decoder layer of a Hugging
Face model, ``2`` for the third child of an ``nn.Sequential``) and the innermost module whose
``forward`` was running (``model.layers.3.mlp.down_proj``). Layer-sequence indices are not HF
indices: layer 0 of a Hugging Face layer sequence is the embedding prefix, so sequence layer 4 is
``model.layers.3``; the note gives both.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from lightning_roundpipe.adapters.base import LayerSequence


def layer_module_names(seq: LayerSequence) -> list[str]:
    """Per layer of ``seq``, the qualified name(s) in ``seq.target`` of the model modules it runs,
    comma-separated (``"model.layers.3"``; ``"model.embed_tokens"`` for a Hugging Face prefix);
    the modules that build derived carry entries (``seq.derived``: ``model.rotary_emb``), which
    every decoder layer holds, are named only for a layer that runs nothing else;
    ``seq.layer_names[i]`` for a layer that holds no module of the target."""
    names = {id(m): n for n, m in seq.target.named_modules(remove_duplicate=False)}
    helpers = {id(m) for m in seq.derived.modules()} if seq.derived is not None else set()
    out = []
    for index, layer in enumerate(seq.layers):
        found: list[str] = []
        subs = [sub for _, sub in layer.named_modules()]
        own = [sub for sub in subs if id(sub) not in helpers and id(sub) in names]
        for sub in own or subs:
            name = names.get(id(sub))
            if name is not None and not any(name == f or name.startswith(f + ".") for f in found):
                found.append(name)
        found = [n for n in found if n] or ([names[id(layer)]] if names.get(id(layer)) else [])
        out.append(", ".join(found) if found else seq.layer_names[index])
    return out


def failing_module(error: BaseException, replicas: Sequence, seq: LayerSequence) -> tuple[int, str | None, str] | None:
    """Where in a layer ``error`` was raised, from its traceback: the deepest frame whose ``self``
    is one of this device's replica modules (a module's ``forward``).

    Args:
        error: the exception, with its traceback.
        replicas: this device's :class:`~lightning_roundpipe.runtime.execution.replica.LayerReplica` per layer.
        seq: the layer sequence (names are looked up in ``seq.target``).

    Returns:
        ``(layer index, qualified name of that module in seq.target or None, its class name)``, or
        ``None`` when no layer's module was running (a backward op, a copy).
    """
    copies: dict[int, tuple[int, nn.Module]] = {}
    for index, replica in enumerate(replicas):
        for original, copy in replica.pairs:
            copies[id(copy)] = (index, original)
    found = None
    tb = error.__traceback__
    while tb is not None:
        hit = copies.get(id(tb.tb_frame.f_locals.get("self")))
        if hit is not None:
            found = hit
        tb = tb.tb_next
    if found is None:
        return None
    index, module = found
    names = {id(m): n for n, m in seq.target.named_modules(remove_duplicate=False)}
    return index, names.get(id(module)) or None, type(module).__name__


def context_note(device_index: int, device: str, op: str, stream: str, stage: str,
                 microbatch_index: int | None, layer_name: str | None = None,
                 where: tuple[int, str | None, str] | None = None) -> str:
    """The note added to a worker's exception.

    Args:
        device_index, device, op, stream: where the op ran (``device`` as text, ``op`` as ``"3B1"``).
        stage: the stage's description (``StageSpec.describe()``).
        microbatch_index: ``None`` for ops of a whole stage (``LOAD``, ``WD2H``, ``DROP``).
        layer_name: name in the model of the failing layer (:func:`layer_module_names`).
        where: :func:`failing_module`'s answer.
    """
    parts = [f"RoundPipe: device {device_index} ({device}), op `{op}` on stream `{stream}`, {stage}"]
    if microbatch_index is not None:
        parts.append(f"microbatch {microbatch_index}")
    if where is not None:
        index, inner, type_name = where
        if inner is None or inner == layer_name:
            parts.append(f"layer `{layer_name}` ({type_name}; layer {index} of the layer sequence)")
        else:
            parts.append(f"layer `{layer_name}` (layer {index} of the layer sequence), in `{inner}` ({type_name})")
    return ", ".join(parts)


class ErrorNotes:
    """Builds the note of a stream thread's exception for one layer sequence (the layers' names in
    the model are computed on the first error).

    Args:
        seq: the layer sequence the executor runs.
    """

    def __init__(self, seq: LayerSequence) -> None:
        self.seq = seq
        self._layer_names: list[str] | None = None
        self.auto_partition = False
        """Whether the run's partition is automatic (an out-of-memory HINT then does not suggest it)."""

    def note(self, error: BaseException, device_index: int, device: str, op: Any, stream: str, spec: Any,
             replicas: Sequence) -> str:
        """The note for ``error`` raised by ``op`` (its ``microbatch_index`` is read) of stage
        ``spec`` (a :class:`~lightning_roundpipe.schedule.plan.StageSpec`) on ``stream`` of device
        ``device_index``, whose layer replicas are ``replicas``. Never raises: a failure to name the
        layer leaves the layer out."""
        where = layer_name = None
        stage = spec.describe()
        try:
            if self._layer_names is None:
                self._layer_names = layer_module_names(self.seq)
            where = failing_module(error, replicas, self.seq)
            layer_name = None if where is None else self._layer_names[where[0]]
            first, last = self._layer_names[spec.layers.start], self._layer_names[spec.layers.stop - 1]
            stage += f" = `{first}`" if first == last else f" = `{first}` .. `{last}`"
        except Exception:  # never hide the user's error behind one of ours
            where = None
        note = context_note(device_index, device, str(op), stream, stage, op.microbatch_index, layer_name, where)
        return note + oom_hint(error, self.auto_partition)


def oom_hint(error: BaseException, auto_partition: bool = False) -> str:
    """A device out-of-memory error's HINT (the CPU budget's own error carries one already);
    ``auto_partition``: the run's partition is automatic already, so the HINT does not suggest it."""
    import torch

    if not isinstance(error, torch.OutOfMemoryError) or hasattr(error, "budget_bytes"):
        return ""
    stages = "shorter `forward_stages`/`backward_stages`" if auto_partition else \
        "`partition='auto'`, or shorter `forward_stages`/`backward_stages`"
    return (". HINT: the device ran out of memory in this op (torch's message above gives the bytes): use smaller"
            f" stages ({stages}), fewer microbatches in flight (`microbatches_per_round`), or a smaller microbatch"
            " or sequence; every device's stage weight pool holds slots as large as the largest stage")
