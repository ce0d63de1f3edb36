"""Peak memory of the fused tail (norm, LM head, loss, backward): chunked vs unchunked (issue 10, item 2).

For each sequence length (batch 1, hidden 64, vocab 49152, fp32) a fresh subprocess builds the tail
(:class:`~lightning_roundpipe.adapters.hf_causal_lm.HFTail` with an ``RMSNorm`` and a bias-free LM
head), its input hidden states and labels, then runs the tail's forward and backward once, either
chunked (inside :func:`~lightning_roundpipe.adapters.chunked_loss.loss_only`, default chunk = 256 MiB
of logits = 1365 tokens) or unchunked (full logits, transformers' ``ForCausalLMLoss``).

Measure: the process's peak resident set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after the
step minus its current resident set (``/proc/self/statm``) right before it, so imports and inputs do
not count (``torch.cuda.max_memory_allocated`` does not exist on the CPU; tensors this large are
``mmap``-ed by glibc and returned to the system when freed, so the RSS peak is the allocator peak).
Printed beside the chunked figure: the cost model's (``CostModel.layer_costs(...)[-1].saved_activation_bytes``
plus the LM head gradient), which the partitioner and the planner use.

Run: ``python benchmarks/chunked_loss.py [--seqs 256 2048 8192] [--vocab 49152]``.
Needs about 6 GiB free for the unchunked 8192-token case.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

MiB = 2**20

_CHILD = r"""
import json, os, resource, sys
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from lightning_roundpipe.adapters.chunked_loss import loss_only
from lightning_roundpipe.adapters.hf_causal_lm import HFTail

seq, vocab, hidden, chunked = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
torch.set_num_threads(1)
torch.manual_seed(0)
tail = HFTail(nn.RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False), ForCausalLMLoss, vocab)
h = torch.randn(1, seq, hidden, requires_grad=True)
labels = torch.randint(0, vocab, (1, seq))
carry = {"hidden_states": h, "labels": labels, "num_items_in_batch": (labels[..., 1:] != -100).sum()}
page = os.sysconf("SC_PAGE_SIZE")
before = int(open("/proc/self/statm").read().split()[1]) * page
if chunked:
    with loss_only():
        out = tail(carry)
else:
    out = tail(carry)
out["loss"].backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_bytes": peak - before, "loss": out["loss"].item(), "logits": "logits" in out}))
"""


def measure(seq: int, vocab: int, hidden: int, chunked: bool) -> dict:
    """One tail step in a fresh interpreter; returns its peak memory above the pre-step RSS, bytes."""
    res = subprocess.run([sys.executable, "-c", _CHILD, str(seq), str(vocab), str(hidden), "1" if chunked else "0"],
                         capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(f"child failed (seq {seq}, chunked {chunked}):\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def modelled(seq: int, vocab: int, hidden: int) -> int:
    """The cost model's tail memory for one microbatch: saved activations plus the LM head's gradient, bytes."""
    from lightning_roundpipe.partition.costmodel import CostModel, ModelShape

    shape = ModelShape.from_config(dict(model_type="llama", hidden_size=hidden, intermediate_size=4 * hidden,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                        vocab_size=vocab))
    cm = CostModel()
    tail = cm.layer_costs(shape, seq_len=seq, microbatch_size=1, compute_dtype_bytes=4)[-1]
    return tail.saved_activation_bytes + vocab * hidden * 4


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 2048, 8192])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=64)
    args = p.parse_args(argv)
    print(f"tail peak memory above the pre-step RSS, MiB (batch 1, hidden {args.hidden}, vocab {args.vocab}, fp32)")
    print(f"{'seq':>6} | {'chunked':>9} {'model':>7} | {'unchunked':>9} | {'unchunked/chunked':>17} | loss equal")
    for seq in args.seqs:
        c = measure(seq, args.vocab, args.hidden, True)
        u = measure(seq, args.vocab, args.hidden, False)
        assert not c["logits"] and u["logits"]
        print(f"{seq:>6} | {c['peak_bytes'] / MiB:>9.0f} {modelled(seq, args.vocab, args.hidden) / MiB:>7.0f} |"
              f" {u['peak_bytes'] / MiB:>9.0f} |"
              f" {u['peak_bytes'] / max(c['peak_bytes'], 1):>17.2f} | {abs(c['loss'] - u['loss']) <= 1e-5}")


if __name__ == "__main__":
    main()
