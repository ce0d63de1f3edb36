"""Data parallelism across nodes (issue 9): 2 processes (gloo on loopback) x 2 CPU virtual devices.

Oracle: one process on the default Lightning strategy with the global batch (the two processes'
batches together: Lightning's ``DistributedSampler`` gives process ``r`` rows ``r, r + 2, ...``, so
the global batch ``k`` is rows ``[2 * ROWS * k, 2 * ROWS * (k + 1))``) ends with the same parameters
(fp32, 1e-5), with accumulation, clipping by norm, and unequal label-token counts per process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_roundpipe
from _dp_worker import CLIP, ROWS, TwiceMLP
from _helpers import CausalLMModule, MLPModule, TokenData, VectorData, loader, max_diff, params, tiny_hf, trainer
from lightning_roundpipe.runtime.host.allreduce import GradientAllReduce

HERE = Path(__file__).parent
WORKER = str(HERE / "_dp_worker.py")


def _env(extra: dict) -> dict:
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_NAME"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _popen_two(args: list[str], timeout: float) -> tuple[list[subprocess.CompletedProcess], list[float]]:
    """Two processes as two "nodes" with Lightning's environment variables (LightningEnvironment);
    also returns when each was seen to exit (``time.time()``)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(r),
                                        "LOCAL_RANK": "0"}))
             for r in range(2)]
    out, ended = [], []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            ended.append(time.time())
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out, ended


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-process launch with ``torchrun`` (TorchElasticEnvironment): the training runs, then the
    resume runs (a 1-process checkpoint, written here first, resumed by the 2 processes; and a
    2-process checkpoint for the test to resume)."""
    out = tmp_path_factory.mktemp("dp_train")
    _resume_fit(_roundpipe(), 2, save_dir=out / "1p")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           WORKER, "train", str(out), str(out / "1p" / "last.ckpt")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env({}))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    infos = [json.loads((out / f"info{r}.json").read_text()) for r in range(2)]
    return torch.load(out / "params.pt"), infos, out


def _oracle(make, data, steps=3, accumulate=2):
    module = make()
    t = trainer("auto", 1, max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=CLIP)
    t.fit(module, loader(data, 2 * ROWS))
    return params(module)


def test_two_processes_equal_one_process_global_batch(trained):
    got, infos, _ = trained
    make_llama = lambda: CausalLMModule(tiny_hf("llama", layers=3))  # noqa: E731
    want = {"llama": _oracle(make_llama, TokenData(n=12 * ROWS)),
            "llama_noacc": _oracle(make_llama, TokenData(n=12 * ROWS), steps=2, accumulate=1),
            "mlp": _oracle(MLPModule, VectorData(n=12 * ROWS)),
            # two pipelined calls feed one backward: the first call's buckets were launched before the
            # second call's gradients arrived, so they are reduced again from .grad
            "mlp_twice": _oracle(lambda: TwiceMLP(scheduler=False), VectorData(n=12 * ROWS), steps=2, accumulate=1)}
    start = {"llama": params(make_llama()), "mlp": params(MLPModule())}
    for name in want:
        assert max_diff(got[name], want[name]) <= 1e-5, name
        assert max_diff(start[name.split("_")[0]], want[name]) > 1e-3, name  # the weights moved: the comparison means something
    # overlap: every bucket started during the backward (transparent path; fused path when .grad holds no
    # accumulated batch); with accumulation the fused path's buckets run after the backward
    for rank in range(2):
        assert all(launched == total for launched, total in infos[rank]["mlp"]["launched"])
        assert all(launched == total for launched, total in infos[rank]["llama_noacc"]["launched"])
        assert all(launched == 0 for launched, _ in infos[rank]["llama"]["launched"])
        assert len(infos[rank]["mlp"]["launched"]) == 3  # one synchronising backward per optimizer step


def test_unequal_token_counts_need_the_global_count(trained):
    """The two processes' batches hold different numbers of label tokens: normalising each by its own
    count (plain DDP) would not give the global batch's gradient, so the parity above relies on the
    all-reduced count. Oracle: the per-process counts of the data themselves."""
    data = TokenData(n=12 * ROWS)
    counts = [[(data.labels[list(range(2 * ROWS * k + r, 2 * ROWS * (k + 1), 2))][:, 1:] != -100).sum().item()
               for r in range(2)] for k in range(6)]
    assert any(a != b for a, b in counts)


def test_world_size_devices_ranks_and_metric_keys(trained):
    _, infos, _ = trained
    for rank, report in enumerate(infos):
        for name in ("llama", "llama_noacc", "mlp", "mlp_twice"):
            r = report[name]
            assert (r["num_devices"], r["world_size"], r["global_rank"], r["num_nodes"]) == (2, 2, rank, 2), r
            assert r["env"] == "TorchElasticEnvironment" and r["sampler_replicas"] == 2
            assert r["sampler_kwargs"] == {"num_replicas": 2, "rank": rank}
    keys = set(infos[0]["mlp"]["metric_keys"])
    for node in (0, 1):
        assert {f"roundpipe/node{node}/device0/bubble(%)", f"roundpipe/node{node}/device1/bubble(%)",
                f"roundpipe/node{node}/allreduce(s)"} <= keys
    assert {"roundpipe/allreduce(s)", "roundpipe/allreduce(bytes)"} <= keys
    assert not any(k.startswith("roundpipe/device") for k in keys)
    assert infos[1]["mlp"]["metric_keys"] == []  # rank 1 logs nothing


def test_single_process_ranks_and_keys():
    module = MLPModule()
    t = trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3), devices=3, max_steps=1, log_every_n_steps=1)
    t.fit(module, loader(VectorData(n=7)))
    assert (t.num_devices, t.world_size, t.global_rank, t.num_nodes) == (3, 1, 0, 1)
    assert not dist.is_initialized()
    assert "roundpipe/device2/bubble(%)" in t.strategy.step_metrics
    assert not any("node" in k or "allreduce" in k for k in t.strategy.step_metrics)


def _resume_fit(strategy, max_steps, ckpt_path=None, save_dir=None):
    module = MLPModule(scheduler=False)
    callbacks = [ModelCheckpoint(dirpath=save_dir, save_last=True)] if save_dir else []
    t = trainer(strategy, 2 if strategy != "auto" else 1, max_steps=max_steps, gradient_clip_val=CLIP,
                enable_checkpointing=bool(save_dir), callbacks=callbacks)
    t.fit(module, loader(VectorData(n=2 * ROWS), 2 * ROWS), ckpt_path=ckpt_path)  # one global batch per epoch
    return params(module)


def _roundpipe():
    return lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default")


def test_resume_across_process_counts(trained):
    out = trained[2]
    straight = _resume_fit("auto", 4)
    # a 1-process checkpoint resumed by 2 processes
    assert max_diff(torch.load(out / "resumed2p.pt"), straight) <= 1e-5
    # a 2-process checkpoint (written once, by rank 0) resumed by 1 process, and by the default strategy
    ckpt2 = out / "ckpt2p" / "last.ckpt"
    assert sorted(p.name for p in ckpt2.parent.iterdir()) == ["epoch=1-step=2.ckpt", "last.ckpt"]
    assert max_diff(_resume_fit(_roundpipe(), 4, ckpt_path=ckpt2), straight) <= 1e-5
    assert max_diff(_resume_fit("auto", 4, ckpt_path=ckpt2), straight) <= 1e-5
    assert max_diff(_resume_fit("auto", 2), straight) > 1e-3  # the resumed steps changed the weights


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_failure_on_one_rank_stops_every_rank(tmp_path, mode):
    """Rank 1 fails in step 2 (its worker raises, or it is SIGKILLed); rank 0 must stop with a clear
    error, not wait for the process group's timeout: that is 900 s here (`_dp_worker.FAIL_TIMEOUT_S`),
    longer than this test waits for both processes (300 s, then `TimeoutExpired`), so no wall time is
    measured."""
    runs, _ = _popen_two([mode, str(tmp_path)], timeout=300)
    assert runs[0].returncode != 0 and runs[1].returncode != 0, [r.stdout[-3000:] for r in runs]
    assert "RoundPipe data parallel: rank 0 of 2" in runs[0].stdout, runs[0].stdout[-4000:]
    if mode == "raise":
        assert "injected failure on rank 1" in runs[1].stdout
    assert (tmp_path / "failed_at").is_file()  # rank 1 failed where it was made to (step 2)


def test_buckets_follow_layers_in_reverse_and_tied_params_once():
    layers = [torch.nn.Linear(4, 4) for _ in range(4)]
    tied = layers[0].weight
    layer_params = [list(m.parameters()) for m in layers] + [[tied]]
    reducer = GradientAllReduce(layer_params, bucket_bytes=100)  # one Linear(4, 4) (80 bytes) a bucket
    order = reducer.parameters
    assert len(order) == len({id(p) for p in order}) == 8  # the tied weight once
    assert order[-2] is tied  # in the bucket of its first layer, reduced last
    assert [sorted(b.layers) for b in reducer._buckets] == [[3, 4], [2], [1], [0]]  # layer 4 owns nothing


def test_devices_auto_on_cpu_warns():
    with pytest.warns(UserWarning, match="devices=N"):
        t = trainer(lightning_roundpipe.RoundPipeStrategy(), devices="auto", max_steps=1)
        t.fit(MLPModule(), loader(VectorData(n=7)))


def test_data_parallel_settings_are_checked():
    with pytest.raises(ValueError, match="timeout_s"):
        lightning_roundpipe.DataParallel(timeout_s=0)
    with pytest.raises(TypeError, match="DataParallel"):
        lightning_roundpipe.RoundPipeStrategy(data_parallel=5)
    # a mapping of its fields (what Hydra passes for `strategy.data_parallel.*`) is converted and checked
    assert lightning_roundpipe.RoundPipeStrategy(data_parallel={"timeout_s": 5}).data_parallel.timeout_s == 5
    with pytest.raises(TypeError, match=r"no field `timeout`; valid: \['timeout_s'"):
        lightning_roundpipe.RoundPipeStrategy(data_parallel={"timeout": 5})
