"""Corrections of the asynchronous optimizer's one-step-stale update, computed on the host (no Lightning).

With ``optimizer="async"`` (RoundPipe paper, arXiv 2604.27085, section 4) step ``k``'s gradient is
taken on the weights ``W_{k-2}`` and applied to ``W_{k-1}``. Write ``W`` for the masters when the
correction runs, ``W_prev`` for the masters before the latest update and ``g_prev`` for the previous
step's gradient. A *stale* step is one whose weights lack the latest update (every step but the first
of a fit and the first after a validation, whose snapshot is the current weights); only stale steps
are corrected. Each correction keeps one fp32 tensor per trainable parameter (4 bytes/parameter of
host memory for fp32 masters), plus one scratch tensor the size of the largest parameter, and moves no
byte over PCIe:

- ``"weight_prediction"``: the snapshot a stale step computes on is ``W + (W - W_prev)``, the linear
  extrapolation of the weights by the last update, instead of ``W``; the optimizer still steps the
  true masters with the gradient. Sources: SpecTrain (Chen et al. 2018, "Efficient and Robust Parallel
  DNN Training through Model Parallelism on Multi-GPU Platform", arXiv 1809.02839), PipeMare (Yang et
  al., MLSys 2021, arXiv 1910.05124), PipeDream-2BW's discussion of weight prediction. Keeps ``W_prev``.
- ``"delay_compensation"``: DC-ASGD (Zheng et al., "Asynchronous Stochastic Gradient Descent with
  Delay Compensation", ICML 2017, arXiv 1609.08326), constant-``lambda`` form:
  ``g <- g + lambda * g * g * (W - W_stale)`` with ``W_stale = W_prev`` the weights the gradient was
  taken on (elementwise products: the diagonal outer-product approximation of the Hessian).
  Keeps ``W_prev``.
- ``"gradient_extrapolation"``: ``g_k <- g_k + (g_k - g_{k-1})``, a first-order predictor of the
  gradient at the fresh weights from the two latest gradients. This is *not* the error feedback of
  arXiv 2606.30634 (unread here): a delay-error-feedback that adds next step the difference between
  the update taken and the fresh one must estimate that fresh update the same way, and applying the
  estimate one step later than it is known only lags it, so the extrapolation itself is the sound
  one-step-stale form. Keeps ``g_prev`` (the previous step's uncorrected gradient; after a step the
  optimizer skipped, e.g. inf gradients under ``16-mixed``, the next step is not corrected).

The gradient corrections run in the main thread once a step's gradient is complete, before
``on_before_optimizer_step`` and gradient clipping (which see the corrected gradient, as the
optimizer does); ``W_prev`` is copied on the optimizer thread right before each update; the predicted
weights are computed where the snapshot is refreshed (the optimizer thread in the steady state).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CORRECTIONS", "StalenessCorrection", "make_staleness_correction"]

CORRECTIONS = ("weight_prediction", "delay_compensation", "gradient_extrapolation")
"""The corrections (``RoundPipeConfig.staleness_correction`` besides ``None``)."""


class StalenessCorrection:
    """The state and the arithmetic of one correction over the trainable parameters.

    Args:
        kind: one of :data:`CORRECTIONS`.
        params: the trainable master parameters the optimizer updates (fp32 on the host).
        names: one name per parameter (the keys of :meth:`state_dict`).
        dc_lambda: ``lambda`` of ``"delay_compensation"`` (``>= 0``; ignored by the others).

    Raises:
        ValueError: an unknown ``kind``, ``names`` not one per parameter, or a negative ``dc_lambda``.
    """

    def __init__(self, kind: str, params: Sequence[torch.Tensor], names: Sequence[str], dc_lambda: float = 0.0) -> None:
        if kind not in CORRECTIONS:
            raise ValueError(f"`staleness_correction` must be one of {list(CORRECTIONS)} or None, got {kind!r}."
                             " HINT: None keeps the paper's one-step-stale update.")
        if len(names) != len(params) or len(set(names)) != len(names):
            raise ValueError(f"`names` must name each of the {len(params)} parameters once, got {len(names)} names.")
        if not dc_lambda >= 0:
            raise ValueError(f"`staleness_correction_lambda` must be >= 0, got {dc_lambda!r}. HINT: 0.04 (the default).")
        self.kind = kind
        self.dc_lambda = float(dc_lambda)
        self.params = list(params)
        self.names = list(names)
        self._index = {id(param): index for index, param in enumerate(self.params)}
        keeps_weights = kind != "gradient_extrapolation"
        self.previous: list[torch.Tensor | None] = [
            param.detach().clone() if keeps_weights else None for param in self.params]
        """Per parameter, ``W_prev`` (``weight_prediction``, ``delay_compensation``; ``W_0`` before the
        first update) or ``g_prev`` (``gradient_extrapolation``; ``None`` before a first gradient)."""
        self._previous_usable = True  # g_prev is a gradient the optimizer applied (gradient_extrapolation)
        self._scratch: dict[torch.dtype, torch.Tensor] = {}  # one buffer per dtype, the largest parameter's size

    @property
    def predicts_weights(self) -> bool:
        """Whether the snapshot of a stale step is predicted (:meth:`predicted`)."""
        return self.kind == "weight_prediction"

    def state_bytes(self) -> int:
        """Host bytes the correction keeps (its tensors: 4 bytes per fp32 parameter once filled; the
        scratch buffer not counted)."""
        return sum(t.numel() * t.element_size() for t in self.previous if t is not None)

    def _scratch_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A scratch tensor of ``tensor``'s shape and dtype (valid until the next call)."""
        buffer = self._scratch.get(tensor.dtype)
        if buffer is None or buffer.numel() < tensor.numel():
            largest = max(p.numel() for p in self.params if p.dtype == tensor.dtype) if self.params else 0
            buffer = self._scratch[tensor.dtype] = torch.empty(max(largest, tensor.numel()), dtype=tensor.dtype)
        return buffer[:tensor.numel()].view(tensor.shape)

    # ------------------------------------------------------------------ the three moments
    @torch.no_grad()
    def before_update(self) -> None:
        """Right before the optimizer updates the masters (on the optimizer thread): ``W_prev = W``."""
        if self.kind == "gradient_extrapolation":
            return
        for param, previous in zip(self.params, self.previous):
            previous.copy_(param)

    @torch.no_grad()
    def predicted(self, master: torch.Tensor) -> torch.Tensor | None:
        """``W + (W - W_prev)`` for ``master`` (in a scratch tensor of its dtype and shape, valid until
        the next call: copy it at once), under ``"weight_prediction"``; ``None`` otherwise or for a
        tensor the correction does not track. One thread at a time."""
        index = self._index.get(id(master))
        if not self.predicts_weights or index is None:
            return None
        weights = master.detach()
        return torch.sub(weights, self.previous[index], out=self._scratch_like(weights)).add_(weights)

    @torch.no_grad()
    def correct_gradients(self, stale: bool) -> None:
        """Correct each parameter's ``.grad`` in place (the step's complete gradient; parameters
        without one are left out), if ``stale``; ``gradient_extrapolation`` also keeps the
        uncorrected gradient as the next ``g_prev``. Main thread, no optimizer step in flight."""
        if self.kind == "gradient_extrapolation":
            usable = stale and self._previous_usable
            for index, param in enumerate(self.params):
                grad, previous = param.grad, self.previous[index]
                if grad is None:
                    continue
                if previous is None or previous.shape != grad.shape:
                    self.previous[index] = grad.detach().clone()
                elif usable:
                    difference = torch.sub(grad, previous, out=self._scratch_like(grad))
                    previous.copy_(grad)
                    grad.add_(difference)
                else:
                    previous.copy_(grad)
        elif self.kind == "delay_compensation" and stale and self.dc_lambda > 0:
            for param, previous in zip(self.params, self.previous):
                grad = param.grad
                if grad is not None:
                    moved = torch.sub(param.detach(), previous, out=self._scratch_like(grad)).mul_(grad)
                    grad.addcmul_(moved, grad, value=self.dc_lambda)

    def commit(self, updated: bool) -> None:
        """After the step's hooks: whether the optimizer takes the step (``updated``); a skipped
        step's gradient (e.g. inf) is no ``g_prev`` to extrapolate from."""
        self._previous_usable = updated

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """``{"kind", "lambda", "tensors": {name: clone}}`` (a copy: an asynchronous checkpoint writer
        may save it while training goes on)."""
        tensors = {name: t.detach().clone() for name, t in zip(self.names, self.previous) if t is not None}
        return {"kind": self.kind, "lambda": self.dc_lambda, "tensors": tensors}

    def load_state_dict(self, state: dict) -> bool:
        """Take the tensors of :meth:`state_dict` (by name) if ``state`` is of this ``kind``; returns
        whether it was.

        Raises:
            ValueError: a saved tensor whose shape differs from its parameter's.
        """
        if not isinstance(state, dict) or state.get("kind") != self.kind:
            return False
        self._previous_usable = True
        tensors = state.get("tensors", {})
        for index, (name, param) in enumerate(zip(self.names, self.params)):
            saved = tensors.get(name)
            if saved is None:
                continue
            if saved.shape != param.shape:
                raise ValueError(f"The checkpoint's `{self.kind}` state of `{name}` has shape {tuple(saved.shape)},"
                                 f" the parameter {tuple(param.shape)}. HINT: resume with the model it was saved from.")
            self.previous[index] = saved.detach().to(dtype=param.dtype, device=param.device).clone()
        return True


def make_staleness_correction(kind: str | None, params: Sequence[torch.Tensor], names: Sequence[str],
                              dc_lambda: float = 0.0) -> StalenessCorrection | None:
    """A :class:`StalenessCorrection`, or ``None`` for ``kind`` ``None`` (the paper's stale update)."""
    return None if kind is None else StalenessCorrection(kind, params, names, dc_lambda)
