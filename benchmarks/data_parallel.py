"""Data parallelism across "nodes" on one machine: 2 processes x 1 CPU virtual device vs 1 process x 1.

Model: Llama-shaped (4 decoder layers, hidden 256, vocab 4096, tied embeddings; about 5 M parameters,
about 19 MiB of fp32 gradients), ``32-true``, SGD, fused path; the same global batch of ``2 * rows``
sequences of 128 tokens in both runs (the 2-process run: ``rows`` each). Printed:

- the median step time of each run (after warm-up) and their ratio (on a 2-core machine near 2x is
  the bound: each process runs one compute thread and one copy thread);
- ``roundpipe/allreduce(s)`` per step (the main thread's wait for the gradient all-reduce) and
  ``roundpipe/allreduce(bytes)`` (fp32 bytes each process all-reduced), and an estimate for 2 nodes
  x 8 GPUs: ring all-reduce moves ``2 (N - 1) / N`` of the bytes over each link.

Run: ``python benchmarks/data_parallel.py [--steps 6] [--rows 4]``; it starts the 2-process run
itself (``torchrun``-style environment variables, gloo on loopback). Numbers from a shared machine
are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("WANDB_MODE", "disabled")

HIDDEN, LAYERS, VOCAB, SEQ = 256, 4, 4096, 128


def run_one(args: argparse.Namespace, rows: int, result: str) -> None:
    """One process of a run (world size from ``num_nodes``): trains, writes its step times."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, Dataset
    from torch.utils.data.distributed import DistributedSampler

    import lightning_roundpipe

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            from transformers import LlamaConfig, LlamaForCausalLM

            torch.manual_seed(0)
            cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
            cfg._attn_implementation = "eager"
            self.model = LlamaForCausalLM(cfg)

        def training_step(self, batch: dict, batch_idx: int):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class Times(L.Callback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.allreduce: list[float] = []
            self.bytes = 0.0
            self._t = 0.0

        def on_train_batch_start(self, *a) -> None:
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, *a) -> None:
            self.steps.append(time.perf_counter() - self._t)
            m = getattr(trainer.strategy, "step_metrics", {})  # the previous step's (the strategy's callback runs after this one)
            if "roundpipe/allreduce(s)" in m:
                self.allreduce.append(float(m["roundpipe/allreduce(s)"]))
                self.bytes = float(m["roundpipe/allreduce(bytes)"])

    torch.set_num_threads(1)
    times = Times()
    world = args.nodes
    ds = Tokens()
    sampler = None
    if world > 1:
        sampler = DistributedSampler(ds, num_replicas=world, rank=int(os.environ["NODE_RANK"]), shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=world, max_steps=args.steps,
                        strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=2, partition="default"),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1, callbacks=[times])
    trainer.fit(LM(), DataLoader(ds, batch_size=rows, sampler=sampler))
    if trainer.global_rank == 0:
        with open(result, "w") as f:
            json.dump({"steps": times.steps, "allreduce": times.allreduce, "bytes": times.bytes}, f)


def launch(args: argparse.Namespace, nodes: int, rows: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(nodes):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(rank), LOCAL_RANK="0")
            cmd = [sys.executable, __file__, "--worker", "--nodes", str(nodes), "--rows", str(rows),
                   "--steps", str(args.steps), "--result", result]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, err = p.communicate(timeout=1200)
            if p.returncode != 0:
                raise SystemExit(f"worker failed:\n{err[-3000:]}")
        with open(result) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=4, help="rows per process in the 2-process run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_one(args, args.rows, args.result)
        return
    warm = 2
    one = launch(args, 1, 2 * args.rows)
    two = launch(args, 2, args.rows)
    t1, t2 = statistics.median(one["steps"][warm:]), statistics.median(two["steps"][warm:])
    ar = statistics.median(two["allreduce"][warm:]) if two["allreduce"] else float("nan")
    nbytes = two["bytes"]
    print(f"global batch {2 * args.rows} x {SEQ} tokens, {args.steps} steps (median after {warm} warm-up)")
    print(f"1 process  x 1 virtual device: step {t1 * 1e3:8.1f} ms")
    print(f"2 processes x 1 virtual device: step {t2 * 1e3:8.1f} ms   speed-up {t1 / t2:5.2f}x (bound ~2x on 2 cores)")
    print(f"all-reduce per step: {ar * 1e3:7.1f} ms main-thread wait, {nbytes / 2**20:7.2f} MiB fp32 per process"
          f" ({ar / t2 * 100 if t2 else 0:4.1f}% of the step)")
    n = 2  # nodes; the host all-reduce runs between the 2 nodes, each node's 8 GPUs are its pipeline
    # (label, fp32 gradient bytes, one 8x4090 node's RoundPipe tokens/s from the paper's artifact)
    models = [("this model", nbytes, None), ("Qwen3-1.7B full", 1.72e9 * 4, 65417), ("Llama3.1-8B full", 8.03e9 * 4, 24275)]
    print(f"estimate, {n} nodes x 8 GPUs: ring all-reduce moves 2 (N-1)/N x the gradient bytes over each node's link"
          " (N = nodes; host gloo assumed to reach line rate)")
    for label, size, tokens_per_s in models:
        for link, rate in (("25 GbE", 25e9 / 8), ("100 Gb IB", 100e9 / 8)):
            ring = 2 * (n - 1) / n * size / rate
            extra = ""
            if tokens_per_s:  # tokens per node and step for the all-reduce to be <= 10% of the step (not overlapped)
                extra = f"; <= 10% of the step from {ring * 10 * tokens_per_s / 1e3:,.0f}K tokens/node/step"
            print(f"  {label:17s} {size / 2**30:7.2f} GiB over {link:9s}: {ring * 1e3:9.1f} ms per step{extra}")


if __name__ == "__main__":
    main()
