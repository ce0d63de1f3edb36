"""Host memory of the pipelined model, by kind and per parameter (issue 7 item 5).

The paper counts 20 host bytes per trainable parameter under mixed precision: 2 (compute copy) + 2
(gradient slot) + 4 (fp32 master) + 4 (fp32 gradient) + 8 (Adam's two moments). :func:`host_memory`
measures the same categories on the live objects, split by trainable and frozen parameters:

- ``master_bytes``: the parameter tensors themselves (the fp32 masters of trainable parameters;
  a frozen parameter held in the compute dtype is its own compute copy, so it counts here, once; a
  frozen weight held in fp8 counts its host block: codes, padding and per-channel fp32 scales);
- ``shadow_bytes``: separate compute-dtype copies (the weight store's shadows, only where a shadow
  is not the master itself);
- ``grad_bytes``: ``.grad`` tensors, now;
- ``grad_buffer_bytes``: host gradient buffers (``WD2H`` downloads not yet added into ``.grad``, the
  fused path's gradient buffers: transient, a pinned download buffer on CUDA, a host copy on CPU
  virtual devices) at the step's peak, counted as what the gradients held then beyond today's
  ``.grad``: ``grad_bytes + grad_buffer_bytes`` is the most gradient memory the step used (a
  buffer that became the ``.grad`` itself counts once);
- ``optimizer_bytes``: tensors in ``optimizer.state`` of the parameters (Adam's ``exp_avg``,
  ``exp_avg_sq`` and ``step``; SGD's momentum buffer).

:attr:`HostMemory.frozen_matmul` counts the frozen matmul weights apart (the LoRA base's projections:
what ``frozen_weights="fp8"`` converts, :attr:`~lightning_roundpipe.runtime.host.store.WeightStore.frozen_matmul`),
so their host bytes per parameter compare across modes (4 in fp32, 2 in bf16, about 1 in fp8).
Tied parameters count once. Model buffers (rotary ``inv_freq``, BatchNorm statistics) are
``buffer_bytes``. ``total_bytes`` is then the step's peak host memory for the model (masters, shadows
and optimizer state do not change during a step). Bytes are host (CPU) bytes; device memory (the
fp32 gradient accumulator of a backward stage, for one) is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable

import torch

from lightning_roundpipe.runtime.host.store import WeightStore

#: the paper's host bytes per trainable parameter, by category (mixed precision with Adam)
PAPER_BYTES_PER_TRAINABLE_PARAM = {"compute copy": 2, "gradient slot": 2, "master": 4, "fp32 gradient": 4, "adam": 8}


@dataclass(frozen=True)
class HostBytes:
    """Host bytes of one group of parameters (trainable or frozen).

    Attributes:
        num_params: parameter elements in the group (tied parameters once).
        master_bytes: the parameter tensors, bytes.
        shadow_bytes: separate compute-dtype copies, bytes.
        grad_bytes: ``.grad`` tensors, bytes.
        grad_buffer_bytes: host gradient buffers at the peak, beyond ``grad_bytes``, bytes.
        optimizer_bytes: optimizer state tensors, bytes.
    """

    num_params: int = 0
    master_bytes: int = 0
    shadow_bytes: int = 0
    grad_bytes: int = 0
    grad_buffer_bytes: int = 0
    optimizer_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """All categories, bytes."""
        return self.master_bytes + self.shadow_bytes + self.grad_bytes + self.grad_buffer_bytes + self.optimizer_bytes

    def per_param(self) -> dict[str, float]:
        """Bytes per parameter element of every category and of the total (``{}`` for an empty group);
        keys: ``master``, ``shadow``, ``grad``, ``grad_buffer``, ``optimizer``, ``total``."""
        if not self.num_params:
            return {}
        out = {f.name[:-len("_bytes")]: getattr(self, f.name) / self.num_params
               for f in fields(self) if f.name.endswith("_bytes")}
        out["total"] = self.total_bytes / self.num_params
        return out


@dataclass(frozen=True)
class HostMemory:
    """Host bytes of the pipelined model: :class:`HostBytes` of its trainable and frozen parameters
    and its buffers.

    Attributes:
        trainable: parameters with ``requires_grad=True``.
        frozen: parameters with ``requires_grad=False`` (a LoRA base).
        buffer_bytes: model buffers, bytes.
        frozen_matmul: the part of ``frozen`` that is frozen matmul weights (2-D ``nn.Linear`` /
            ``Conv1D`` weights; fp8 with ``frozen_weights="fp8"``).
    """

    trainable: HostBytes
    frozen: HostBytes
    buffer_bytes: int = 0
    frozen_matmul: HostBytes = HostBytes()

    @property
    def total_bytes(self) -> int:
        """Everything, bytes."""
        return self.trainable.total_bytes + self.frozen.total_bytes + self.buffer_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def host_memory(store: WeightStore, optimizers: Iterable[torch.optim.Optimizer] = (),
                peak_grad_bytes: int = 0) -> HostMemory:
    """Count the host bytes of the parameters and buffers of ``store``'s layers.

    Args:
        store: the weight store (its masters are the model's parameters).
        optimizers: optimizers whose ``state`` is counted (state of parameters outside the store
            is ignored).
        peak_grad_bytes: the most bytes ``.grad`` and the host gradient buffers held at once
            during the step (:meth:`~lightning_roundpipe.runtime.execution.executor.Executor.pop_peak_grad_bytes`);
            all of it is trainable parameters': frozen parameters have no gradient.

    Returns:
        A :class:`HostMemory`.
    """
    state_bytes: dict[int, int] = {}
    for optimizer in optimizers:
        # list(): one atomic copy each, as the asynchronous optimizer's thread may be filling them
        for param, state in list(optimizer.state.items()):
            state_bytes[id(param)] = state_bytes.get(id(param), 0) + sum(
                _nbytes(v) for v in list(state.values()) if isinstance(v, torch.Tensor))
    groups = {True: dict.fromkeys(("num_params", "master_bytes", "shadow_bytes", "grad_bytes", "optimizer_bytes"), 0),
              False: dict.fromkeys(("num_params", "master_bytes", "shadow_bytes", "grad_bytes", "optimizer_bytes"), 0)}
    buffer_bytes = 0
    matmul = dict.fromkeys(("num_params", "master_bytes", "shadow_bytes"), 0)
    for key, entry in store.tensors.items():
        master = entry.master
        shadow = entry.shadow
        separate = shadow is not None and shadow.data_ptr() != master.data_ptr()
        if not entry.is_param:
            buffer_bytes += _nbytes(master) + (_nbytes(shadow) if separate else 0)
            continue
        group = groups[bool(master.requires_grad)]
        nbytes = entry.block.numel() if entry.block is not None else _nbytes(master)
        numel = entry.packed.numel if entry.packed is not None else master.numel()  # a packed weight's parameters
        group["num_params"] += numel
        group["master_bytes"] += nbytes
        group["shadow_bytes"] += _nbytes(shadow) if separate else 0
        if key in store.frozen_matmul or entry.packed is not None:
            matmul["num_params"] += numel
            matmul["master_bytes"] += nbytes
            matmul["shadow_bytes"] += _nbytes(shadow) if separate else 0
        grad = master.grad  # read once
        group["grad_bytes"] += _nbytes(grad) if grad is not None else 0
        group["optimizer_bytes"] += state_bytes.get(key, 0)
    grad_buffer_bytes = max(0, peak_grad_bytes - groups[True]["grad_bytes"] - groups[False]["grad_bytes"])
    return HostMemory(trainable=HostBytes(grad_buffer_bytes=grad_buffer_bytes, **groups[True]),
                      frozen=HostBytes(**groups[False]), buffer_bytes=buffer_bytes, frozen_matmul=HostBytes(**matmul))
