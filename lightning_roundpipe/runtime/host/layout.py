"""Stage layouts and resident stages of the host weight store
(:class:`~lightning_roundpipe.runtime.host.store.WeightStore`, whose module docstring has the whole picture).

- :class:`StageLayout`: a stage's unique tensors packed into one flat byte buffer, each at a
  16-byte-aligned offset (bytes); on the device every tensor is a view into the stage's buffer.
- :class:`ResidentStage`: one stage's weights on one device from its first ``LOAD`` chunk to its
  ``DROP``: the typed views, the gradient and buffer pairs, the fp8 and nf4 weights dequantised on first bind,
  and the bitsandbytes weights' device objects.
- ``_Tensor``: the store's record of one host tensor (master, upload dtype, shadow, fp8 or bitsandbytes block);
  ``_padded_bytes``: the bytes it takes in a stage's buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lightning_roundpipe.runtime.host.bnb import PackedWeight
from lightning_roundpipe.runtime.host.grads import GradAccumulator

_ALIGN = 16


def _padded_bytes(entry: "_Tensor") -> int:
    """Bytes a tensor takes in a stage's flat buffer (its upload dtype, or an fp8 weight's codes and
    scales, padded to ``_ALIGN``)."""
    nbytes = entry.block.numel() if entry.block is not None else entry.master.numel() * entry.dtype.itemsize
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass
class _Tensor:
    master: torch.Tensor
    is_param: bool
    dtype: torch.dtype  # upload dtype
    shadow: torch.Tensor | None = None
    version: tuple[int, int] | None = None
    spare: torch.Tensor | None = None  # the second snapshot bank's copy (WeightStore.refresh_snapshot)
    original_dtype: torch.dtype | None = None  # frozen parameter converted in place: its dtype before
    # fp8 frozen weight: its host block (codes, padding, scales), the scales' view, the output-channel dim
    # and the dtype it is dequantised to on the devices
    block: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    channel_dim: int = 0
    dequant_dtype: torch.dtype | None = None
    # bitsandbytes weight (loaded in 4/8 bits, or converted by frozen_weights="nf4"): its pieces in `block`
    packed: PackedWeight | None = None
    persistent: bool = True  # a buffer in its module's state_dict (non-persistent: derived, never written back)


@dataclass(frozen=True)
class StageLayout:
    """Where a stage's tensors sit in its flat device buffer.

    Attributes:
        layers: the stage's layer indices.
        tensors: unique tensor keys (``id`` of the master) in buffer order.
        offsets: byte offset of each tensor in the buffer.
        total_bytes: buffer size, bytes (what one ``LOAD`` of the stage moves, padding included).
        names: per layer index, ``(name, tensor position)`` pairs for binding the replica.
    """

    layers: range
    tensors: tuple[int, ...]
    offsets: tuple[int, ...]
    total_bytes: int
    names: dict[int, tuple[tuple[str, int], ...]]


@dataclass
class ResidentStage:
    """One stage's weights on one device, from its first ``LOAD`` chunk to its ``DROP``.

    Attributes:
        layout: the :class:`StageLayout`.
        buffer: the device byte buffer.
        views: per tensor, its typed view into ``buffer``.
        grad_pairs: ``(master, view)`` of the trainable parameters (backward stages).
        buffer_pairs: ``(master, view)`` of buffers (each gets its own device copy after the upload).
        saved_buffers: per ``buffer_pairs`` entry, whether it is written back at a training forward
            stage's ``DROP`` (:meth:`WeightStore.written_back`: the persistent buffers, e.g. BatchNorm
            statistics; non-persistent ones such as rotary ``inv_freq`` are derived and stay on the host).
        accumulator: fp32 sum over microbatches of the gradients of the ``grad_pairs`` whose view is
            narrower than fp32 (``None`` when there are none: their ``view.grad`` is read directly).
        quantised: per position of an fp8 or ``frozen_weights="nf4"`` weight (whose view holds its codes),
            the call that dequantises it on the device (to its compute dtype).
        dequantised: per such position, the dequantised weight, once a layer using it was bound.
        states: per position of a loaded ``Linear8bitLt`` weight, its ``MatmulLtState``: the module's
            ``state`` its replicas bind for this residency (:meth:`layer_attributes`).
        nbytes: bytes resident on the device (the stage's buffer; dequantised weights come on top).
    """

    layout: StageLayout
    buffer: torch.Tensor
    views: list[torch.Tensor]
    grad_pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    buffer_pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    accumulator: GradAccumulator | None = None
    quantised: dict[int, Callable[[], torch.Tensor]] = field(default_factory=dict)
    dequantised: dict[int, torch.Tensor] = field(default_factory=dict)
    states: dict[int, Any] = field(default_factory=dict)
    saved_buffers: list[bool] = field(default_factory=list)
    released: bool = False  # the dequantised weights were freed after the stage's last compute op

    def release_dequantised(self) -> None:
        """After the stage's last compute op of this residency (on the compute stream, which made
        them): free the dequantised weights now rather than at the ``DROP``, which runs on the ``d2h``
        stream and may come after the next stage's first op (two stages' copies at once); later
        :meth:`layer_tensors` calls (the ``DROP``'s unbind) return the codes' views."""
        self.released = True
        self.dequantised.clear()

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def layer_tensors(self, layer_index: int) -> dict[str, torch.Tensor]:
        """``{qualified name: tensor}`` the replica of layer ``layer_index`` binds. An fp8 weight is
        dequantised here (on the device, by the calling compute op, outside autocast) the first time a
        layer using it binds in this residency, and the same tensor is returned until the ``DROP``
        (whose unbind must find it)."""
        if not self.quantised:
            return {name: self.views[k] for name, k in self.layout.names[layer_index]}
        out = {}
        for name, k in self.layout.names[layer_index]:
            tensor = self.views[k]
            if k in self.quantised and not self.released:
                tensor = self.dequantised.get(k)
                if tensor is None:
                    tensor = self.dequantised[k] = self.quantised[k]()
            out[name] = tensor
        return out

    def layer_attributes(self, layer_index: int) -> dict[str, Any]:
        """``{qualified attribute name: value}`` the replica of layer ``layer_index`` binds besides its
        tensors: the ``state`` (``MatmulLtState``) of each loaded ``Linear8bitLt``, whose ``CB``/``SCB`` are
        this residency's device views ({} for every other layer)."""
        if not self.states:
            return {}
        out = {}
        for name, k in self.layout.names[layer_index]:
            if k in self.states:
                prefix = name.rpartition(".")[0]
                out[f"{prefix}.state" if prefix else "state"] = self.states[k]
        return out
