"""What the engine puts on the user's module, and the calls it runs un-pipelined on the host.

:class:`HostCalls` is a mixin of :class:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine`
(runtime code, no Lightning): :meth:`HostCalls.install` replaces the target's ``forward`` (and
``generate``) by :class:`~lightning_roundpipe.runtime.execution.installed.InstalledMethod` s of the
engine, :meth:`HostCalls.uninstall` gives the originals back, and :meth:`HostCalls.host_forward` runs
the target's own forward in the calling thread on the CPU master weights (``generate()``, KV-cache
calls and the other calls the pipeline cannot run).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from lightning_roundpipe.runtime.execution.installed import InstalledMethod


class HostCalls:
    """Methods of :class:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine` over the target
    module (its ``seq``, ``store``, ``autocast_dtype``, ``host_barrier``, ``forward`` and ``drain``, and
    the ``_original_forward``, ``_original_generate`` and ``_host_calls`` its constructor sets)."""

    def install(self) -> None:
        """Replace ``seq.target.forward`` by the engine's pipelined
        :meth:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine.forward` (and a ``generate`` method by
        :meth:`generate`: its forwards run on the host) as :class:`InstalledMethod` s: a deep copy or pickle
        of the module meanwhile gets its own methods."""
        target = self.seq.target
        if self._original_forward is None:
            self._original_forward = target.__dict__.get("forward")
            target.forward = InstalledMethod(self.forward, target, "forward", self._original_forward)
        if self._original_generate is None and callable(getattr(target, "generate", None)):
            self._original_generate = target.__dict__.get("generate", False)  # False: the class's own
            target.generate = InstalledMethod(self.generate, target, "generate", self._original_generate)

    def uninstall(self) -> None:
        """Restore the target's own forward (and ``generate``)."""
        target = self.seq.target
        for name, original in (("forward", self._original_forward), ("generate", self._original_generate)):
            current = target.__dict__.get(name)
            if current is not None and getattr(current, "engine", None) is self:  # an InstalledMethod of ours
                del target.__dict__[name]
                if original:
                    setattr(target, name, original)
        self._original_forward = None
        self._original_generate = None

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The target's own ``generate``, with every forward it calls run by :meth:`host_forward`."""
        target = self.seq.target
        original = self._original_generate or type(target).generate.__get__(target)
        depth = getattr(self._host_calls, "depth", 0)
        self._host_calls.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            self._host_calls.depth = depth

    def host_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The target's original forward, un-pipelined, in the calling thread on the CPU master weights.

        Used for ``generate()`` and for calls the pipeline cannot run (a KV cache: ``use_cache=True``,
        ``cache``/``past_key_values``; hidden states, attentions...; the adapter's ``host_call``).
        The engine's :attr:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine.host_barrier`
        runs first (the asynchronous optimizer's step in flight has landed); with an autocast dtype
        (mixed precision) the call runs under CPU autocast, as the workers do.

        Raises:
            ValueError: with gradients enabled and trainable parameters (host calls have no pipelined
                backward; ``generate()`` runs under ``torch.no_grad()``).
        """
        seq = self.seq
        if torch.is_grad_enabled() and any(p.requires_grad for p in seq.parameters()):
            given = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
            raise ValueError(
                f"The pipelined `{seq.family}` model was called with gradients enabled and arguments the pipeline does"
                f" not run ({', '.join(f'`{k}`' for k in given)}): such calls (a KV cache, `generate()`,"
                " `inputs_embeds`, hidden states, attentions) run un-pipelined on the host, without a backward."
                " HINT: call it under `torch.no_grad()` (as `generate()` does), or train with `input_ids`,"
                " `attention_mask`, `position_ids` and `labels` only."
            )
        self.drain()  # an overlapped call's gradients and buffers land (and may start an optimizer step)
        if self.host_barrier is not None:
            self.host_barrier()
        target = seq.target
        original = self._original_forward or type(target).forward.__get__(target)
        context = (torch.autocast("cpu", dtype=self.autocast_dtype) if self.autocast_dtype is not None
                   else contextlib.nullcontext())
        with context, self.store.host_weights():  # fp8 frozen weights: dequantised copies meanwhile
            return original(*args, **kwargs)
