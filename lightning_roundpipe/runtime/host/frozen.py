"""The weight store's frozen parameters (a mixin of
:class:`~lightning_roundpipe.runtime.host.store.WeightStore`): a frozen floating-point parameter that
would need an upload copy is held only as that copy (in the compute dtype under mixed precision,
pinned on CUDA), or, with ``frozen_weights="fp8"``, as fp8 codes with per-output-channel scales
(:mod:`~lightning_roundpipe.runtime.host.fp8`), or with ``frozen_weights="nf4"`` as NF4 codes with their
bitsandbytes quantisation state; these are given back their original dtype at the end of the run (values
rounded). Weights loaded in 4/8 bits by bitsandbytes are held packed with their quantisation state
(:mod:`~lightning_roundpipe.runtime.host.bnb`), values unchanged. See the store module's docstring.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch

from lightning_roundpipe.runtime.host import bnb, fp8
from lightning_roundpipe.runtime.host.pinned import pinned_bytes, pinned_empty

if TYPE_CHECKING:  # pragma: no cover
    from lightning_roundpipe.runtime.host.layout import _Tensor


class FrozenWeights:
    """Methods of :class:`~lightning_roundpipe.runtime.host.store.WeightStore` over its frozen
    parameters (its ``tensors``, ``pin_memory`` and ``_needs_copy``)."""

    def _hold_frozen_in_compute_dtype(self, entry: _Tensor) -> None:
        """A frozen floating-point parameter that would need a shadow becomes its own shadow (in its
        upload dtype: the compute dtype for a matmul weight under mixed precision, else its own)."""
        master = entry.master
        if not (entry.is_param and not master.requires_grad and master.is_floating_point() and self._needs_copy(entry)):
            return
        entry.original_dtype = master.dtype
        data = pinned_empty(master.shape, entry.dtype, pin=self.pin_memory)
        data.copy_(master.detach())
        master.data = data

    def _hold_frozen_in_fp8(self, entry: _Tensor, channel_dim: int, name: str) -> None:
        """A frozen matmul weight becomes fp8 codes with per-channel scales in one host block (pinned on
        CUDA), converted from its master directly; the master's original storage is freed here."""
        master = entry.master
        _, nbytes, _ = fp8.block_layout(master.shape, channel_dim)
        block = pinned_bytes(nbytes, pin=self.pin_memory)
        codes, scale = fp8.split_block(block, master.shape, channel_dim)
        fp8.quantise_into(master.detach(), channel_dim, codes, scale, name)
        entry.original_dtype, entry.dtype = master.dtype, fp8.FP8_DTYPE
        entry.block, entry.scale, entry.channel_dim = block, scale, channel_dim
        entry.dequant_dtype = self.compute_dtype if self.compute_dtype is not None else master.dtype
        master.data = codes

    def _hold_loaded_packed(self, entry: _Tensor, module: torch.nn.Module, kind: str) -> None:
        """A weight loaded in 4/8 bits by bitsandbytes (``kind``: :func:`~lightning_roundpipe.runtime.host.bnb.packed_kind`)
        is held with its whole quantisation state in one host block (pinned on CUDA); the module's tensors view it."""
        entry.block, entry.packed = bnb.hold_loaded(module, entry.master, kind, self.pin_memory)
        entry.dequant_dtype = bnb.working_dtype(module, self.compute_dtype, torch.float32)

    def _hold_frozen_in_nf4(self, entry: _Tensor) -> None:
        """``frozen_weights="nf4"``: a frozen ``nn.Linear`` weight becomes NF4 codes and their quantisation state
        in one host block (pinned on CUDA), quantised from its master directly; the master's original storage is
        freed here (the parameter's ``.data`` is the codes, ``uint8`` of shape ``(numel // 2, 1)``)."""
        master = entry.master
        block, packed = bnb.quantise_nf4(master, self.pin_memory)
        entry.original_dtype, entry.dtype = master.dtype, torch.uint8
        entry.block, entry.packed = block, packed
        entry.dequant_dtype = self.compute_dtype if self.compute_dtype is not None else master.dtype
        master.data = bnb.split(block, packed.pieces)["data"]

    def restore_frozen(self) -> None:
        """Give the frozen parameters converted at construction their original dtype back (unpinned).

        The values of the matmul weights stay rounded to the compute dtype (e.g. bf16), or, with
        ``frozen_weights="fp8"`` or ``"nf4"``, are the dequantised values in the original dtype: the pipeline
        computed with those all along, so no training result changes. The others (norms, embeddings:
        converted only to pin them on CUDA) are unchanged. One weight at a time (its fp8 block is
        freed before the next is converted back).
        """
        for entry in self.tensors.values():
            if entry.packed is not None and not entry.packed.converted:  # loaded in 4/8 bits: values unchanged
                bnb.release_host(entry.block, entry.packed)
                entry.block = entry.packed = None
                continue
            if entry.original_dtype is None:
                continue
            master = entry.master
            if entry.packed is not None:  # frozen_weights="nf4": bitsandbytes' dequantisation, original dtype
                data = bnb.dequantise_nf4(bnb.split(entry.block, entry.packed.pieces), entry.packed,
                                          entry.original_dtype)
                entry.block = entry.packed = None
                entry.dtype = entry.original_dtype
            elif entry.scale is not None:
                data = torch.empty(master.shape, dtype=entry.original_dtype)
                fp8.dequantise_into(master.detach(), entry.scale, data, entry.channel_dim)
                entry.block = entry.scale = None
                entry.dtype = entry.original_dtype
            else:
                data = torch.empty(master.shape, dtype=entry.original_dtype)
                data.copy_(master.detach())
            master.data = data
            entry.original_dtype = None
            entry.shadow = entry.version = entry.spare = None

    @contextlib.contextmanager
    def host_weights(self) -> Iterator[None]:
        """While open, the fp8 weights' parameters hold their dequantised values (in the devices'
        dtype; a copy of each, in host memory), for an un-pipelined call on the host (``generate()``,
        a KV cache); the codes come back when it closes. Main thread only, while no program runs."""
        swapped: list[tuple[_Tensor, torch.Tensor]] = []
        try:
            for entry in self.tensors.values():
                if entry.scale is not None:
                    codes = entry.master.data
                    entry.master.data = fp8.dequantise(codes, entry.scale, entry.dequant_dtype)
                    swapped.append((entry, codes))
                elif entry.packed is not None and entry.packed.converted:
                    codes = entry.master.data
                    entry.master.data = bnb.dequantise_nf4(bnb.split(entry.block, entry.packed.pieces), entry.packed,
                                                           entry.dequant_dtype)
                    swapped.append((entry, codes))
            yield
        finally:
            for entry, codes in swapped:
                entry.master.data = codes

    @property
    def fp8_weights(self) -> list[torch.Tensor]:
        """The frozen matmul weights held as fp8 codes (``frozen_weights="fp8"``)."""
        return [e.master for e in self.tensors.values() if e.scale is not None]

    @property
    def dequantised_weights(self) -> list[torch.Tensor]:
        """The frozen weights the devices dequantise when a layer binds them (fp8, ``frozen_weights="nf4"``):
        their copies are freed after the stage's last compute op of a residency."""
        return [e.master for e in self.tensors.values()
                if e.scale is not None or (e.packed is not None and e.packed.converted)]

    @property
    def packed_weights(self) -> list[torch.Tensor]:
        """The frozen weights held packed by bitsandbytes' formats: loaded in 4/8 bits, or ``frozen_weights="nf4"``."""
        return [e.master for e in self.tensors.values() if e.packed is not None]

    @property
    def frozen_in_compute_dtype(self) -> list[torch.Tensor]:
        """The frozen parameters held only as their upload copy (converted at construction): the
        frozen matmul weights under mixed precision, and on CUDA every frozen parameter (pinned)."""
        return [e.master for e in self.tensors.values() if e.original_dtype is not None]

