"""Host weight store: the master weights are the model's own parameters (on the CPU); a stage's
upload is a set of compute copies; its gradients come back into the masters' ``.grad``.

Tied parameters (SmolLM2's embedding and LM head) are one master: every stage that uses it adds its
gradient into the same ``.grad``, so the master receives the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from lightning_roundpipe.runtime import transfer


@dataclass
class ResidentStage:
    """The weights of one stage on one device, from ``LOAD`` to ``DROP``.

    Attributes:
        stage_index: the stage.
        tensors: per layer index, ``{name: compute copy}`` for ``torch.func.functional_call``.
        grad_pairs: ``(master, copy)`` for parameters whose gradient goes back to the host.
        ready_event: CUDA event the compute stream waits on before first use (``None`` on CPU).
        nbytes: bytes resident on the device (H2D bytes of the upload).
    """

    stage_index: int
    tensors: dict[int, dict[str, torch.Tensor]]
    grad_pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ready_event: Any
    nbytes: int
    copies: list[torch.Tensor] = field(default_factory=list)
    buffer_pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    waited: bool = False


class WeightStore:
    """Uploads and gradient write-back for the layers of a :class:`LayerSequence`.

    Args:
        layers: the layer modules (their parameters are the masters).
        compute_dtype: dtype of uploaded floating-point *parameters* (``None``: the master's dtype);
            buffers keep their dtype (e.g. rotary ``inv_freq`` stays fp32).
    """

    def __init__(self, layers: Sequence[nn.Module], compute_dtype: torch.dtype | None = None) -> None:
        self.layers = list(layers)
        self.compute_dtype = compute_dtype
        # (name, master tensor, is parameter) per layer, captured once in the main thread: while a
        # worker runs a layer through `functional_call`, that module's attributes point at the
        # worker's copies, so they must never be read from the module during a step.
        self.entries: list[list[tuple[str, torch.Tensor, bool]]] = []
        for layer in self.layers:
            params = [(n, p, True) for n, p in layer.named_parameters(remove_duplicate=False)]
            buffers = [(n, b, False) for n, b in layer.named_buffers(remove_duplicate=False) if b is not None]
            self.entries.append(params + buffers)

    def _upload_dtype(self, t: torch.Tensor, is_param: bool) -> torch.dtype:
        return self.compute_dtype if (is_param and self.compute_dtype and t.is_floating_point()) else t.dtype

    def layer_param_bytes(self, layer_index: int) -> int:
        """Bytes one upload of ``layer_index`` moves (parameters in the compute dtype plus buffers)."""
        seen: dict[int, int] = {}
        for _, t, is_param in self.entries[layer_index]:
            seen[id(t)] = t.numel() * self._upload_dtype(t, is_param).itemsize
        return sum(seen.values())

    def upload(self, stage_index: int, layer_indices: range, worker, with_grad: bool) -> ResidentStage:
        """``LOAD``: copy the stage's parameters and buffers to ``worker``'s device.

        Args:
            with_grad: backward stage: copies of trainable masters require grad and are returned in
                ``grad_pairs`` for :meth:`commit_grads`.
        """
        by_id: dict[int, int] = {}
        masters: list[torch.Tensor] = []
        dtypes: list[torch.dtype] = []
        is_param: list[bool] = []
        names: dict[int, list[tuple[str, int]]] = {}
        for li in layer_indices:
            entries = []
            for name, t, param in self.entries[li]:
                k = by_id.get(id(t))
                if k is None:
                    k = by_id[id(t)] = len(masters)
                    masters.append(t)
                    is_param.append(param)
                    dtypes.append(self._upload_dtype(t, param))
                entries.append((name, k))
            names[li] = entries
        copies, ready, nbytes = transfer.upload_tensors(masters, dtypes, worker)
        grad_pairs = []
        if with_grad:
            for m, c, param in zip(masters, copies, is_param):
                if param and m.requires_grad:
                    c.requires_grad_(True)
                    grad_pairs.append((m, c))
        tensors = {li: {name: copies[k] for name, k in entries} for li, entries in names.items()}
        buffer_pairs = [(m, c) for m, c, param in zip(masters, copies, is_param) if not param]
        return ResidentStage(stage_index, tensors, grad_pairs, ready, nbytes, copies, buffer_pairs)

    @staticmethod
    def write_back_buffers(resident: ResidentStage) -> None:
        """Copy the stage's buffers (BatchNorm running statistics...) back into the masters.

        Called at the ``DROP`` of forward stages and of the fused tail in training mode: each layer's
        buffers are updated by exactly one stage per step (recomputation works on throw-away copies).
        """
        for master, copy in resident.buffer_pairs:
            master.copy_(copy.to(master.device))

    def ensure_ready(self, resident: ResidentStage, worker) -> None:
        """Before the first compute of a stage: wait for its (possibly prefetched) upload."""
        if not resident.waited:
            transfer.wait_ready(resident.ready_event, resident.copies, worker)
            resident.waited = True

    @staticmethod
    def commit_grads(resident: ResidentStage, worker, sink: dict | None = None) -> int:
        """``DROP`` of a backward stage: add each copy's gradient into its master's ``.grad``, or into
        ``sink[id(master)] = (master, grad)`` (the fused path's CPU gradient buffers).

        Gradients are cast to the master's dtype (fp32 for ``32-true`` and ``bf16-mixed``).

        Returns:
            D2H bytes moved.
        """
        moved = 0
        for master, copy in resident.grad_pairs:
            g = copy.grad
            if g is None:
                continue
            g = transfer.grad_to_host(g, master.dtype, worker)
            moved += g.numel() * g.element_size()
            if sink is not None:
                entry = sink.get(id(master))
                if entry is None:
                    sink[id(master)] = (master, g)
                else:
                    entry[1].add_(g)
            elif master.grad is None:
                master.grad = g
            else:
                master.grad.add_(g)
        return moved
