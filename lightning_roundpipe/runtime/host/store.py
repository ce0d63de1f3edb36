"""Host weight store: masters, compute-dtype shadows, stage layouts and gradient write-back.

- **Masters** are the model's own parameters (fp32, or the chosen dtype) on the CPU.
- **Upload dtype** (DESIGN.md section 5). With a compute dtype (the mixed precisions: bf16 under
  ``bf16-mixed``, fp16 under ``16-mixed``) only the *matmul weights* are uploaded in it: the
  ``weight`` of every ``nn.Linear`` and convolution module (:func:`autocast_cast_weights`; PEFT's
  LoRA A/B linears and the frozen base linears they wrap are such modules), the operands
  ``torch.autocast`` casts to the compute dtype anyway, so rounding them on the host changes no
  result and halves their bytes (the paper's uploads). Everything else keeps the master's dtype:
  norm weights, biases, embeddings (a weight tied between the embedding and the LM head too: the
  embedding reads it in fp32, autocast casts it for the head's matmul) and buffers. The devices
  then compute exactly what Lightning's autocast computes for the same module: norms, embedding
  outputs and the residual stream, which crosses the stage boundaries, stay fp32.
- **Shadows**: per tensor, a host copy in the upload dtype, pinned on CUDA (exact-size page-locked
  memory, :mod:`~lightning_roundpipe.runtime.host.pinned`, not torch's power-of-two pinned cache),
  from which every upload reads (paper section 3.3: uploads move compute-dtype bytes from pinned memory). A shadow is
  refreshed from its master when the master changed (its version counter moved: the optimizer
  step). Where no copy is needed (CPU virtual devices, same dtype) the master itself is the shadow.
- **Frozen parameters** (``requires_grad=False``, e.g. a LoRA base) hold only their upload copy
  (DESIGN.md section 5): at construction each frozen floating-point parameter that would need a
  shadow is converted *in place* (``param.data = param.data.to(upload_dtype)``, pinned on CUDA), so
  it is its own shadow: no fp32 copy of a frozen matmul weight, no gradient buffer, no gradient
  download, uploaded from the same host bytes every step. Frozen norms and embeddings stay fp32
  (only pinned in place on CUDA). :meth:`WeightStore.restore_frozen` (the engine's ``close``)
  gives them back their original dtype; the matmul weights' values stay rounded to the compute
  dtype, which changes no result: every computation already used the compute-dtype copy. Freezing
  is read at construction: unfreezing a converted parameter while the store lives is an error.
- **fp8 frozen weights** (``frozen_weights="fp8"``, :mod:`~lightning_roundpipe.runtime.host.fp8`): the
  frozen matmul weights are converted instead, one at a time, from their masters into fp8 codes with
  per-output-channel fp32 scales (each original's storage is freed once converted: the host never holds
  the whole base twice); the codes are the parameter's ``.data``. A stage uploads codes and scales;
  :meth:`~lightning_roundpipe.runtime.host.layout.ResidentStage.layer_tensors` dequantises each on the device (compute dtype, else the master's)
  when its layer first binds in that residency, kept until the ``DROP``. :meth:`WeightStore.restore_frozen`
  gives back the original dtype with the fp8-rounded values; :meth:`WeightStore.host_weights` lends
  dequantised copies to un-pipelined host calls.
- **Stage layout**: a stage's unique tensors packed into one flat byte buffer (16-byte aligned),
  uploaded in chunks of at most ``chunk_bytes`` that may cut a tensor; on the device every tensor
  is a view into the stage's buffer.
- **Gradients**: a backward stage's gradients are summed over its microbatches on the device, in fp32
  where the upload dtype is narrower (:mod:`~lightning_roundpipe.runtime.host.grads`), come back in one
  flat host buffer, and the host adds them
  into the masters' ``.grad`` (or the fused path's CPU buffers) in a fixed order, so the result does
  not depend on thread timing. Tied parameters (SmolLM2's embedding and LM head) are one master:
  every stage that uses it adds into the same ``.grad``.
"""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

import torch
from torch import nn

from lightning_roundpipe.partition.profile import SharedWeight
from lightning_roundpipe.runtime.host import fp8
from lightning_roundpipe.runtime.host.frozen import FrozenWeights
from lightning_roundpipe.runtime.host.grads import GradAccumulator, download_bytes, needs_fp32_accumulation
from lightning_roundpipe.runtime.host.layout import ResidentStage, StageLayout, _padded_bytes, _Tensor
from lightning_roundpipe.runtime.host.pinned import is_pinned, pinned_empty

FROZEN_WEIGHT_MODES = (None, "fp8")
"""Valid ``frozen_weights`` of :class:`WeightStore` (``RoundPipeConfig.frozen_weights``)."""

#: modules whose ``weight`` is an operand of a matrix multiply or convolution that ``torch.autocast``
#: casts to its lower-precision dtype (``F.linear``, ``F.conv*d``, ``F.conv_transpose*d``)
AUTOCAST_WEIGHT_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.modules.conv._ConvNd)


def autocast_cast_weights(layers: Sequence[nn.Module]) -> set[int]:
    """``id`` of the parameters of ``layers`` that autocast casts to its dtype wherever they are used.

    A parameter qualifies when every module that registers it is an :data:`AUTOCAST_WEIGHT_MODULES`
    instance holding it as its ``weight``: the weights of ``nn.Linear`` and convolution modules,
    PEFT LoRA's A/B linears and the base linears they wrap. Biases, norm weights, embeddings and
    other parameters do not; neither does a weight tied between an ``nn.Embedding`` and an LM head
    ``nn.Linear`` (the embedding reads it in fp32). A parameter a module reads without registering
    it (a functional call on another module's weight) is not seen: such a weight must not be an
    ``nn.Linear`` weight that is also read outside autocast's matmul.
    """
    matmul: set[int] = set()
    other: set[int] = set()
    for layer in layers:
        for module in layer.modules():
            for name, param in module._parameters.items():
                if param is None:
                    continue
                is_weight = name == "weight" and isinstance(module, AUTOCAST_WEIGHT_MODULES)
                (matmul if is_weight else other).add(id(param))
    return matmul - other


def _persistent(layer: nn.Module, name: str) -> bool:
    """Whether the buffer ``name`` (qualified within ``layer``) is in its module's ``state_dict``."""
    owner, _, leaf = name.rpartition(".")
    module = layer.get_submodule(owner) if owner else layer
    return leaf not in module._non_persistent_buffers_set


class WeightStore(FrozenWeights):
    """Shadows, layouts and gradient write-back for the layers of a layer sequence.

    Args:
        layers: the layer modules (their parameters are the masters).
        compute_dtype: dtype of ``torch.autocast`` on the devices (``torch.bfloat16`` /
            ``torch.float16`` under the mixed precisions; ``None``: no autocast). The matmul
            weights (:func:`autocast_cast_weights`) are uploaded in it; every other parameter and
            buffer keeps its master's dtype (norms, biases, embeddings, rotary ``inv_freq``: fp32).
            ``None`` uploads every tensor in its master's dtype (the true precisions).
        pin_memory: keep shadows in pinned host memory (CUDA), so uploads are asynchronous DMA.
        frozen_weights: ``"fp8"``: hold and upload the frozen matmul weights as fp8 codes with
            per-output-channel scales, dequantised on the devices (see the module docstring);
            ``None``: as their upload dtype.

    Frozen floating-point parameters that would need a shadow (another dtype, pinning, a
    non-contiguous layout) are converted in place at construction (see the module docstring);
    :meth:`restore_frozen` undoes the dtype change.

    Raises:
        ValueError: for a ``frozen_weights`` other than ``None`` and ``"fp8"``, or an fp8 weight
            holding an infinity or NaN.
    """

    def __init__(self, layers: Sequence[nn.Module], compute_dtype: torch.dtype | None = None,
                 pin_memory: bool = False, frozen_weights: str | None = None) -> None:
        if frozen_weights not in FROZEN_WEIGHT_MODES:
            raise ValueError(f"`frozen_weights` must be one of {list(FROZEN_WEIGHT_MODES)}, got {frozen_weights!r}."
                             " HINT: 'fp8' holds the frozen matmul weights (a LoRA base) in fp8 with per-channel scales.")
        self.layers = list(layers)
        self.compute_dtype = compute_dtype
        self.pin_memory = pin_memory
        self.frozen_weights = frozen_weights
        self.frozen_matmul = fp8.fp8_candidates(self.layers)
        """``id`` -> output-channel dim of the frozen matmul weights (converted with ``frozen_weights="fp8"``)."""
        self.snapshot = False
        """Asynchronous optimizer: the shadows of trainable parameters are always copies (never the
        master itself), and only ``refresh(force=True)`` changes any shadow, so the pipeline reads a
        snapshot while the optimizer thread updates the masters (paper section 4)."""
        self.read_bank = 0
        """The snapshot bank (0 or 1) the runs started from now on upload from (:meth:`refresh_snapshot`);
        always 0 outside the asynchronous steady state."""
        self.refresh_events: tuple[int, dict[int, threading.Event]] | None = None
        """A snapshot refresh running off the main thread (:meth:`begin_snapshot_refresh`): its bank and,
        per tensor key, the event set once that tensor's copy is in the bank (the uploads wait for it)."""
        self.tensors: dict[int, _Tensor] = {}
        # (name, master key) per layer, captured once in the main thread: workers never read the modules' attributes
        self.entries: list[list[tuple[str, int]]] = []
        in_compute_dtype = autocast_cast_weights(self.layers) if compute_dtype is not None else set()
        in_fp8 = self.frozen_matmul if frozen_weights == "fp8" else {}
        for index, layer in enumerate(self.layers):
            entries = []
            named = [(n, p, True) for n, p in layer.named_parameters(remove_duplicate=False)]
            named += [(n, b, False) for n, b in layer.named_buffers(remove_duplicate=False) if b is not None]
            for name, tensor, is_param in named:
                key = id(tensor)
                persistent = is_param or _persistent(layer, name)
                if key in self.tensors:  # shared under several names: saved if any of them is
                    self.tensors[key].persistent = self.tensors[key].persistent or persistent
                else:
                    half = is_param and key in in_compute_dtype and tensor.is_floating_point()
                    dtype = compute_dtype if half else tensor.dtype
                    self.tensors[key] = entry = _Tensor(tensor, is_param, dtype, persistent=persistent)
                    try:
                        if key in in_fp8:
                            self._hold_frozen_in_fp8(entry, in_fp8[key], f"`{name}` of layer {index}")
                        else:
                            self._hold_frozen_in_compute_dtype(entry)
                    except BaseException:  # the parameters converted so far get their dtype back (values rounded)
                        self.restore_frozen()
                        raise
                entries.append((name, key))
            self.entries.append(entries)
        self._layouts: dict[range, StageLayout] = {}

    # ------------------------------------------------------------------ shadows
    def _needs_copy(self, entry: _Tensor) -> bool:
        master = entry.master
        trainable = entry.is_param and master.requires_grad
        return ((self.snapshot and trainable) or (self.pin_memory and not is_pinned(master))
                or entry.dtype != master.dtype or not master.is_contiguous())

    def refresh(self, force: bool = False) -> int:
        """Bring every shadow up to date with its master (after an optimizer step, a checkpoint load).

        Args:
            force: refresh also when :attr:`snapshot` holds the shadows (the asynchronous
                optimizer's caller does, while no optimizer step is in flight).

        Returns:
            Bytes copied (0 when nothing changed; frozen weights are never copied; 0 under
            :attr:`snapshot` without ``force``).

        Raises:
            ValueError: a frozen parameter held in the compute dtype was unfrozen.
        """
        return sum(self.refresh_entry(key) for key in self.stale_entries(force))

    def stale_entries(self, force: bool = False) -> list[int]:
        """The tensor keys whose shadow must be copied from its master now (:meth:`refresh_entry`);
        entries that need no copy (the master serves as its own shadow) are set up here.

        Raises:
            ValueError: a frozen parameter held in the compute dtype was unfrozen.
        """
        if self.snapshot and not force:
            return []
        stale = []
        for key, entry in self.tensors.items():
            if entry.original_dtype is not None and entry.master.requires_grad:
                raise ValueError(
                    f"A parameter of shape {tuple(entry.master.shape)} was frozen when RoundPipe started and is held in"
                    f" {entry.dtype} (its upload copy only); it now has `requires_grad=True`, but it has no"
                    f" {entry.original_dtype} master to train. HINT: set `requires_grad` before `trainer.fit` (e.g. in"
                    " the LightningModule's `__init__` or `configure_model`), not during it."
                )
            master = entry.master.detach()
            if not self._needs_copy(entry):
                entry.shadow, entry.version = master, None
                continue
            if entry.shadow is not None and entry.version == (master.data_ptr(), master._version):
                continue
            stale.append(key)
        return stale

    def mark_stale(self, parameters: Iterable[torch.Tensor]) -> int:
        """Make the shadows of ``parameters`` stale, so that the next :meth:`refresh` (or run) copies
        them from their masters: to be called after every optimizer step. The version counter alone
        misses updates: a fused optimizer (``torch.optim.AdamW(fused=True)``: ``torch._fused_adamw_``)
        changes its parameters in place without bumping ``Tensor._version``, and the devices would go
        on computing with the weights of before the first step. Returns how many entries were marked."""
        wanted = {id(p) for p in parameters}
        marked = 0
        for entry in self.tensors.values():
            if id(entry.master) in wanted and entry.version is not None:
                entry.version = (entry.version[0], -1)  # matches no version counter: stale, shadow kept
                marked += 1
        return marked

    def refresh_entry(self, key: int, value: torch.Tensor | None = None) -> int:
        """Copy one master into its shadow (in the compute dtype, pinned on CUDA); returns the bytes
        copied. Called by :meth:`refresh`, or per tensor in upload order by the executor's refresh
        thread while the devices already run (DESIGN.md section 4). ``value``: copy this tensor of
        the master's shape instead (the asynchronous optimizer's predicted weights); the shadow then
        counts as stale (the next :meth:`refresh` copies the master)."""
        entry = self.tensors[key]
        master = entry.master.detach()
        if entry.shadow is None or entry.version is None or entry.shadow.shape != master.shape:
            entry.shadow = pinned_empty(master.shape, entry.dtype, pin=self.pin_memory)
        entry.shadow.copy_(master if value is None else value)
        entry.version = (master.data_ptr(), master._version if value is None else -1)
        return entry.shadow.numel() * entry.shadow.element_size()

    def refresh_snapshot(self) -> int:
        """Asynchronous steady state (DESIGN.md section 11): copy every master that has a shadow copy
        into the snapshot bank no run reads now (``1 - read_bank``) and make it :attr:`read_bank`, in
        the calling thread (:meth:`begin_snapshot_refresh` and :meth:`copy_to_bank` do it in two
        parts, the copies on another thread). A run keeps the bank it started with, so the run still
        draining uploads the previous weights while the next one uploads these. The caller guarantees
        that the run which last read the target bank has finished and that no optimizer step is in
        flight. Each shadow copy exists twice (bytes: twice the trainable parameters in the upload dtype).

        Returns:
            Bytes copied.

        Raises:
            ValueError: a frozen parameter held in the compute dtype was unfrozen.
        """
        bank, keys = self.begin_snapshot_refresh()
        return sum(self.copy_to_bank(key, bank) for key in keys)

    def begin_snapshot_refresh(self) -> tuple[int, list[int]]:
        """The main thread's part of :meth:`refresh_snapshot`: make the other bank :attr:`read_bank` and
        return it with the keys whose copies it needs, in layer order (the order the forward stages
        upload them). Until :meth:`copy_to_bank` has run for a key, a run reading the bank must wait
        (:attr:`refresh_events`, set up by the caller).

        Raises:
            ValueError: a frozen parameter held in the compute dtype was unfrozen.
        """
        keys = self.snapshot_keys()
        self.read_bank = 1 - self.read_bank
        return self.read_bank, keys

    def snapshot_keys(self) -> list[int]:
        """The keys of every tensor with a shadow copy, in layer order, whatever its version counter
        says (a fused optimizer step on the optimizer thread bumps none, see :meth:`mark_stale`).

        Raises:
            ValueError: a frozen parameter held in the compute dtype was unfrozen.
        """
        self.stale_entries(force=True)  # sets up the entries that need no copy (their master serves)
        return list(dict.fromkeys(key for entries in self.entries for _, key in entries
                                  if self.tensors[key].block is None and self._needs_copy(self.tensors[key])))

    def copy_to_bank(self, key: int, bank: int, value: torch.Tensor | None = None) -> int:
        """Copy one master (or ``value``, as :meth:`refresh_entry`) into its snapshot ``bank`` copy (the
        shadow for 0, the spare for 1; pinned on CUDA); returns the bytes copied. Any thread, while no
        optimizer step changes the master."""
        if bank == 0:
            return self.refresh_entry(key, value)
        entry = self.tensors[key]
        master = entry.master.detach()
        if entry.spare is None or entry.spare.shape != master.shape:
            entry.spare = pinned_empty(master.shape, entry.dtype, pin=self.pin_memory)
        entry.spare.copy_(master if value is None else value)
        return entry.spare.numel() * entry.spare.element_size()

    def end_snapshot(self) -> None:
        """Leave :attr:`snapshot` mode: one bank again, the second bank's copies freed, every shadow
        copy stale (the next run copies it from its master)."""
        self.snapshot, self.read_bank, self.refresh_events = False, 0, None
        for entry in self.tensors.values():
            entry.spare = None
            if entry.shadow is not None and entry.shadow.data_ptr() != entry.master.data_ptr():
                entry.version = None

    def host_bytes(self, key: int, bank: int = 0) -> torch.Tensor:
        """The shadow of tensor ``key`` in snapshot ``bank`` (:meth:`refresh_snapshot`) as a flat
        ``uint8`` view."""
        entry = self.tensors[key]
        if entry.block is not None:  # an fp8 weight: its codes and scales
            return entry.block
        shadow = entry.spare if bank == 1 and entry.spare is not None else entry.shadow
        if shadow is None:
            raise RuntimeError("RoundPipe weight store used before `refresh()`.")
        return shadow.reshape(-1).view(torch.uint8)

    # ------------------------------------------------------------------ layouts
    def layout(self, layers: range) -> StageLayout:
        """The flat layout of the stage over ``layers`` (cached)."""
        got = self._layouts.get(layers)
        if got is not None:
            return got
        keys: list[int] = []
        position: dict[int, int] = {}
        names: dict[int, tuple[tuple[str, int], ...]] = {}
        for li in layers:
            pairs = []
            for name, key in self.entries[li]:
                if key not in position:
                    position[key] = len(keys)
                    keys.append(key)
                pairs.append((name, position[key]))
            names[li] = tuple(pairs)
        offsets, total = [], 0
        for key in keys:
            entry = self.tensors[key]
            offsets.append(total)
            total += _padded_bytes(entry)
        got = self._layouts[layers] = StageLayout(layers, tuple(keys), tuple(offsets), total, names)
        return got

    def stage_bytes(self, layers: range) -> int:
        """Bytes one upload of the stage moves (matmul weights in the compute dtype, the other
        parameters and buffers in their own, padding)."""
        return self.layout(layers).total_bytes

    def shared_weights(self) -> list[SharedWeight]:
        """The tensors several layers use (a tied embedding / LM head), with the bytes that
        :meth:`stage_bytes` and :meth:`stage_grad_bytes` of each such layer count for them: a stage
        holding several of those layers moves them once."""
        users: dict[int, list[int]] = {}
        for li, entries in enumerate(self.entries):
            for key in dict.fromkeys(key for _, key in entries):
                users.setdefault(key, []).append(li)
        out = []
        for key, layers in users.items():
            if len(layers) > 1:
                entry = self.tensors[key]
                out.append(SharedWeight(layers=tuple(layers), param_bytes=_padded_bytes(entry),
                                        grad_bytes=download_bytes(entry.master.numel(), entry.dtype)
                                        if entry.is_param and entry.master.requires_grad else 0))
        return out

    def stage_grad_bytes(self, layers: range) -> int:
        """Bytes of the stage's trainable parameters' gradients as ``WD2H`` downloads them: fp32
        where the upload dtype is narrower (the fp32 accumulator), else the upload dtype. Frozen
        parameters move no gradient bytes."""
        layout = self.layout(layers)
        return sum(download_bytes(self.tensors[k].master.numel(), self.tensors[k].dtype) for k in layout.tensors
                   if self.tensors[k].is_param and self.tensors[k].master.requires_grad)

    def accumulator_numel(self, layers: range) -> int:
        """Elements of the stage's fp32 gradient accumulator: its trainable parameters whose upload
        dtype is narrower than fp32 (:func:`~lightning_roundpipe.runtime.host.grads.needs_fp32_accumulation`);
        0 when there are none (e.g. under ``32-true``)."""
        return sum(self.tensors[k].master.numel() for k in self.layout(layers).tensors
                   if self.tensors[k].is_param and self.tensors[k].master.requires_grad
                   and needs_fp32_accumulation(self.tensors[k].dtype))

    def chunk_pieces(self, layout: StageLayout, buffer: torch.Tensor, start: int, stop: int, bank: int = 0
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(device bytes, host bytes)`` pieces that fill ``buffer[start:stop]`` from snapshot ``bank``."""
        pieces = []
        for key, offset in zip(layout.tensors, layout.offsets):
            src = self.host_bytes(key, bank)
            lo, hi = max(start, offset), min(stop, offset + src.numel())
            if lo < hi:
                pieces.append((buffer[lo:hi], src[lo - offset:hi - offset]))
        return pieces

    def resident(self, layout: StageLayout, buffer: torch.Tensor, with_grad: bool,
                 accumulator_buffer: torch.Tensor | None = None) -> ResidentStage:
        """Typed views of a stage's device buffer (the replica's parameters and buffers); with
        ``with_grad``, the trainable parameters' views require grad and those narrower than fp32
        get a :class:`~lightning_roundpipe.runtime.host.grads.GradAccumulator`, summing into
        ``accumulator_buffer`` (``uint8``, at least :meth:`accumulator_numel` fp32 elements: a slot of
        the device's accumulator pool; ``None``: allocated at the first gradient)."""
        views, grad_pairs, buffer_pairs, saved, quantised = [], [], [], [], {}
        for key, offset in zip(layout.tensors, layout.offsets):
            entry = self.tensors[key]
            if entry.block is not None:  # fp8 codes and scales, dequantised when a layer binds them
                view, scale = fp8.split_block(buffer[offset:offset + entry.block.numel()], entry.master.shape,
                                              entry.channel_dim)
                quantised[len(views)] = (scale, entry.dequant_dtype)
                views.append(view)
                continue
            nbytes = entry.master.numel() * entry.dtype.itemsize
            view = buffer[offset:offset + nbytes].view(entry.dtype).view(entry.master.shape)
            if entry.is_param and with_grad and entry.master.requires_grad:
                view.requires_grad_(True)
                grad_pairs.append((entry.master, view))
            elif not entry.is_param:
                buffer_pairs.append((entry.master, view))
                saved.append(entry.persistent)
            views.append(view)
        low = [(master, view) for master, view in grad_pairs if needs_fp32_accumulation(view.dtype)]
        accumulator = GradAccumulator(low, accumulator_buffer) if low else None
        return ResidentStage(layout, buffer, views, grad_pairs, buffer_pairs, accumulator, quantised,
                             saved_buffers=saved)

    @staticmethod
    def own_buffers(resident: ResidentStage) -> None:
        """After the stage's last chunk landed: give every buffer (BatchNorm running statistics...)
        its own tensor. Views of one base share a version counter, so an in-place update of a
        buffer view during the forward would look to autograd like a change of the weights it
        saved (stream-ordered on CUDA: runs on the ``weights`` stream after the copies)."""
        if not resident.buffer_pairs:
            return
        owned = {id(view): view.clone() for _, view in resident.buffer_pairs}
        resident.views = [owned.get(id(v), v) for v in resident.views]
        resident.buffer_pairs = [(master, owned[id(view)]) for master, view in resident.buffer_pairs]

    @staticmethod
    def written_back(resident: ResidentStage) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(master, device copy)`` of the buffers a training forward stage downloads at its ``DROP``:
        the persistent ones (BatchNorm running statistics, whose native kernel updates them without a
        version bump, and anything else a checkpoint keeps). Non-persistent buffers (rotary
        ``inv_freq``, cached masks: derived from the config, left out of ``state_dict``) are never
        downloaded: the device does not change them, and a download plus write-back per ``DROP``
        would move their bytes both ways at every step."""
        return [pair for pair, saved in zip(resident.buffer_pairs, resident.saved_buffers) if saved]

    @staticmethod
    def write_back_buffers(resident: ResidentStage) -> None:
        """Copy the stage's buffers (BatchNorm running statistics...) back into the masters.

        Called at the ``DROP`` of forward stages and of the fused tail in training mode: each layer's
        buffers are updated by exactly one stage per step (recomputation works on throw-away copies).
        """
        for master, view in resident.buffer_pairs:
            master.copy_(view)

    def rebind_buffers(self) -> int:
        """Follow the buffers a module replaced since the last call (``bn.running_mean = torch.zeros_like(...)``:
        Lightning's ``StochasticWeightAveraging`` does so before it recomputes the BatchNorm statistics):
        the entry's master becomes the module's current tensor, so uploads read it and
        :meth:`write_back_buffers` writes into it. Main thread only, between calls. Returns how many.

        Raises:
            ValueError: for a buffer replaced by one of another shape or dtype, or removed (``None``): the
                stage layouts are fixed for the fit.
        """
        rebound = 0
        for index, (layer, entries) in enumerate(zip(self.layers, self.entries)):
            for name, key in entries:
                entry = self.tensors[key]
                if entry.is_param:
                    continue
                current = layer.get_buffer(name)
                if current is entry.master:
                    continue
                if current is None or current.shape != entry.master.shape or current.dtype != entry.master.dtype:
                    got = "None" if current is None else f"{tuple(current.shape)} {current.dtype}"
                    raise ValueError(
                        f"The buffer `{name}` of layer {index} of the pipelined model was replaced during the run by"
                        f" {got}; RoundPipe laid it out as {tuple(entry.master.shape)} {entry.master.dtype}. HINT: update"
                        " buffers in place (`buffer.copy_(...)`, `buffer.zero_()`) or keep their shape and dtype.")
                entry.master, entry.version = current, None
                rebound += 1
        return rebound

    def grad_bytes(self) -> int:
        """Bytes of the trainable masters' ``.grad`` now (host)."""
        total = 0
        for entry in self.tensors.values():
            grad = entry.master.grad if entry.is_param else None  # read once: another thread may set it
            if grad is not None:
                total += grad.numel() * grad.element_size()
        return total

    @staticmethod
    def add_grads(pairs: list[tuple[torch.Tensor, torch.Tensor]], sink: dict | None, staged: bool = True) -> int:
        """Add host gradients into ``master.grad`` (cast to the master's dtype), or into
        ``sink[id(master)] = (master, grad)`` (the fused path's CPU gradient buffers).

        With ``staged`` (the gradients are views of host staging blocks, pinned on CUDA), a gradient that
        is kept rather than added is copied first (ordinary memory): a ``.grad`` viewing a staging block
        would keep the block from the next program, which then pins another (Lightning's
        ``zero_grad`` runs after ``training_step``, so every step would pin a second set of blocks).

        Returns:
            Bytes of the new ``sink`` entries (host gradient buffers kept until the loss's backward).
        """
        retained = 0
        for master, grad in pairs:
            kept = master.grad is None if sink is None else id(master) not in sink
            grad = grad.to(master.dtype, copy=staged and kept)
            if sink is not None:
                entry = sink.get(id(master))
                if entry is None:
                    sink[id(master)] = (master, grad)
                    retained += grad.numel() * grad.element_size()
                else:
                    entry[1].add_(grad)
            elif master.grad is None:
                master.grad = grad
            else:
                master.grad.add_(grad)
        return retained
