"""Streaming load of safetensors checkpoints into a model built on the meta device (issue 10, item 4).

``from_pretrained`` on a CPU reaches about twice a checkpoint's size at peak in some paths (a state
dict next to the model); a model larger than comfortable host memory cannot afford that. Here:

1. the model is built with its **parameters on the meta device** (``accelerate.init_empty_weights``
   with ``include_buffers=False``: no parameter memory; buffers such as rotary ``inv_freq``, which are
   not in the checkpoint, are computed as usual);
2. each checkpoint tensor is read **one at a time** through ``safetensors.safe_open`` and becomes the
   parameter's data (``module._parameters[name]``): converted to the requested dtype by one copy, or,
   with ``mmap=True`` and a matching dtype, used as it is: a copy-on-write view of the file
   (``safe_open`` maps the file ``MAP_PRIVATE``): pages are read when first touched, frozen weights
   (a LoRA base) stay file-backed page cache the kernel can drop and re-read, and a write (the
   optimizer step of a trainable weight) copies only the pages it touches, never the file;
3. ``tie_weights()`` re-ties shared parameters (SmolLM2's LM head is its embedding).

The peak resident set stays close to the model's size in its stored dtype: with copies, the
``safe_open`` handle is reopened every :data:`REOPEN_BYTES` so the file pages already copied are
unmapped (a handle kept open for the whole file would keep them resident: about 2x the size).

Shards: a folder with ``model.safetensors`` or ``model.safetensors.index.json`` (its ``weight_map``).
Checkpoint names must match ``model.state_dict()`` names (true for the Llama / Qwen / Mistral
families; a checkpoint that transformers renames while loading is rejected with a clear error).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

#: With copies, the ``safe_open`` handle is reopened after this many bytes were read (bounds the
#: file pages kept mapped, hence the peak above the model's size), bytes.
REOPEN_BYTES = 32 * 2**20

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""safetensors dtype names (``get_slice(...).get_dtype()``) -> torch dtypes."""


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_safetensors_` did.

    Attributes:
        tensors: checkpoint tensors loaded.
        bytes_read: their bytes in the stored dtype.
        mmapped: tensors used as copy-on-write views of the file (no copy).
        tied: parameters that were left on the meta device by the checkpoint and re-tied afterwards
            (``model.tie_weights()``), by name.
    """

    tensors: int
    bytes_read: int
    mmapped: int
    tied: tuple[str, ...]


def checkpoint_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint folder (one file, or the shards of its index).

    Raises:
        FileNotFoundError: when the folder has neither ``model.safetensors`` nor ``model.safetensors.index.json``.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in dict.fromkeys(weight_map.values())]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"No `model.safetensors` or `model.safetensors.index.json` in `{folder}`."
        " HINT: save the model with `save_pretrained(folder)` (safetensors is its default format)."
    )


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, leaf = name.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), leaf


def load_safetensors_(model: nn.Module, files: Iterable[str | os.PathLike], *, dtype: torch.dtype | None = None,
                      mmap: bool = False, strict: bool = True) -> LoadReport:
    """Load safetensors files into ``model``'s parameters and persistent buffers, one tensor at a time.

    Args:
        model: the module (parameters may be on the meta device).
        files: safetensors files.
        dtype: dtype of floating-point parameters (``None``: as stored); buffers keep the stored dtype
            unless they are floating point and ``dtype`` is given.
        mmap: use a tensor whose stored dtype is already the target dtype as a copy-on-write view
            of the file instead of copying it (see the module docstring).
        strict: raise when a checkpoint tensor has no parameter or buffer in ``model``, or a
            parameter is still on the meta device after loading and tying.

    Returns:
        A :class:`LoadReport`.

    Raises:
        ValueError: unknown checkpoint names, shape mismatches, or parameters the checkpoint does not
            provide (``strict``); each names the tensors (the first few) and gives a HINT.
    """
    from safetensors import safe_open

    unknown: list[str] = []
    count = read = mmapped = 0
    for path in files:
        path = str(path)
        with safe_open(path, framework="pt") as handle:
            names = list(handle.keys())
        handle = None
        since_open = 0
        try:
            for name in names:
                if handle is None or since_open >= REOPEN_BYTES:
                    handle = safe_open(path, framework="pt")  # drops the previous mapping (copied pages)
                    since_open = 0
                try:
                    owner, leaf = _owner(model, name)
                except AttributeError:
                    unknown.append(name)
                    continue
                old = owner._parameters.get(leaf) if leaf in owner._parameters else owner._buffers.get(leaf)
                if old is None and leaf not in owner._buffers:
                    unknown.append(name)
                    continue
                piece = handle.get_slice(name)
                shape, stored_dtype = tuple(piece.get_shape()), _DTYPES[piece.get_dtype()]
                if old is not None and tuple(old.shape) != shape:
                    raise ValueError(f"Checkpoint tensor `{name}` has shape {shape}, the model's"
                                     f" {tuple(old.shape)}. HINT: the config does not match the checkpoint.")
                nbytes = math.prod(shape) * stored_dtype.itemsize
                target = dtype if (dtype is not None and stored_dtype.is_floating_point) else stored_dtype
                if mmap and stored_dtype == target:
                    data, mmapped = handle.get_tensor(name), mmapped + 1
                else:
                    data = torch.empty(shape, dtype=target)
                    rows = shape[0] if shape else 1
                    step = max(1, REOPEN_BYTES // max(1, nbytes // max(rows, 1)))
                    for lo in range(0, rows, step):  # large tensors in blocks of rows: few file pages mapped at once
                        if since_open >= REOPEN_BYTES:
                            handle, since_open = safe_open(path, framework="pt"), 0
                        if shape:
                            block = handle.get_slice(name)[lo:lo + step]
                            data[lo:lo + step].copy_(block)
                        else:
                            block = handle.get_tensor(name)
                            data.copy_(block)
                        since_open += block.numel() * block.element_size()
                        del block
                del piece
                if leaf in owner._parameters:
                    owner._parameters[leaf] = nn.Parameter(data, requires_grad=old.requires_grad and data.is_floating_point())
                else:
                    owner._buffers[leaf] = data
                count += 1
                read += nbytes
        finally:
            handle = None
    if unknown and strict:
        raise ValueError(
            f"{len(unknown)} checkpoint tensors have no parameter or buffer in `{type(model).__name__}`:"
            f" {', '.join(f'`{n}`' for n in unknown[:5])}{' ...' if len(unknown) > 5 else ''}. HINT: the checkpoint"
            " uses other names than the model (transformers renames some while loading); load it with"
            " `from_pretrained` instead, or pass `strict=False`."
        )
    missing_before = {n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta}
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    missing = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    if missing and strict:
        raise ValueError(
            f"{len(missing)} parameters were not in the checkpoint: {', '.join(f'`{n}`' for n in missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}. HINT: check that the checkpoint is for this config, or pass"
            " `strict=False` and initialise them yourself."
        )
    return LoadReport(count, read, mmapped, tuple(sorted(missing_before - set(missing))))


def load_pretrained_streaming(folder: str | os.PathLike, *, dtype: str | torch.dtype = "float32", mmap: bool = False,
                              model_class: Any = None, config: Any = None) -> Any:
    """A Hugging Face model from a local safetensors checkpoint folder, without a second copy in memory.

    Args:
        folder: the checkpoint folder (``config.json`` plus safetensors shards).
        dtype: parameter dtype (a ``torch.dtype`` or its name, e.g. ``"float32"``, ``"bfloat16"``).
        mmap: keep tensors already in ``dtype`` as copy-on-write views of the files (see the module
            docstring); frozen weights then cost page cache only.
        model_class: an ``Auto*`` class or model class with ``from_config`` (default ``AutoModelForCausalLM``).
        config: the model config (default: read from ``folder``).

    Returns:
        The model in eval mode (as ``from_pretrained`` returns it), parameters on the CPU.

    Raises:
        FileNotFoundError: no safetensors checkpoint in ``folder``.
        ValueError: a checkpoint that does not match the model (see :func:`load_safetensors_`).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"`dtype` must be a floating-point torch dtype or its name, got {dtype!r}.")
    files = checkpoint_files(folder)
    config = config if config is not None else AutoConfig.from_pretrained(str(folder), local_files_only=True)
    cls = model_class or AutoModelForCausalLM
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config, dtype=torch_dtype)
    load_safetensors_(model, files, dtype=torch_dtype, mmap=mmap)
    return model.eval()
