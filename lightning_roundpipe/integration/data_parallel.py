"""Data parallelism across nodes for :class:`~lightning_roundpipe.RoundPipeStrategy` (Lightning side).

One RoundPipe process per node (its GPUs, or CPU virtual devices, are the pipeline's workers; its
host memory holds the masters), ``world_size = num_nodes`` processes in a ``torch.distributed``
process group (gloo: the gradients live on the host). The strategy calls the helpers here from
Lightning's hooks; the gradient averaging itself is
:class:`~lightning_roundpipe.runtime.host.allreduce.GradientAllReduce`.

Launch, as for Lightning's multi-node DDP with one process per node:

- a plain cluster: on node ``k`` of ``N``,
  ``MASTER_ADDR=<node 0> MASTER_PORT=29500 NODE_RANK=k python train.py`` with
  ``Trainer(strategy="roundpipe", num_nodes=N, devices=<GPUs per node>)``
  (:class:`~lightning.fabric.plugins.environments.LightningEnvironment`), or
  ``torchrun --nnodes N --nproc-per-node 1 --node-rank k --master-addr <node 0> --master-port 29500 train.py``
  (:class:`~lightning.fabric.plugins.environments.TorchElasticEnvironment`);
- SLURM: ``srun`` with ``--ntasks-per-node=1`` (:class:`~lightning.fabric.plugins.environments.SLURMEnvironment`;
  ``conf/hydra/launcher/submitit_slurm.yaml``).
"""

from __future__ import annotations

import datetime
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generator

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _distributed_is_initialized
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lightning_roundpipe.config import DataParallel
from lightning_roundpipe.runtime.host.allreduce import GradientAllReduce, global_item_count

log = logging.getLogger(__name__)


class NodeParallelStrategy(ParallelStrategy):
    """The ``ParallelStrategy`` part of :class:`~lightning_roundpipe.RoundPipeStrategy`: one process
    per node, the root device is the CPU (masters, optimizer, batches), ``world_size = num_nodes``;
    with one process no process group is made and every collective is a no-op. Subclasses set
    :attr:`data_parallel` (:class:`DataParallel`) and, during fit with several processes,
    :attr:`data_parallel_sync` (:class:`DataParallelSync`)."""

    data_parallel: DataParallel
    data_parallel_sync: "DataParallelSync | None" = None
    _num_nodes: int = 1
    _rank_overrides: dict[str, int] | None = None

    @property
    def world_size(self) -> int:
        """Processes, one per node: 1 with one node (the cluster environment is not read, as under
        Lightning's single-device strategy); with several, the cluster environment's (as DDP's; checked
        to equal ``num_nodes`` in :func:`setup_distributed`). Settable, like ``SingleDeviceStrategy.world_size``
        (e.g. to mock a world size): a value set wins over the rest."""
        return self._ranks("world_size", 1, lambda: ParallelStrategy.world_size.fget(self))

    @world_size.setter
    def world_size(self, value: int) -> None:
        self._set_rank("world_size", value)

    @property
    def global_rank(self) -> int:
        """0 with one node; else the cluster environment's (as DDP's). Settable, as :attr:`world_size`."""
        return self._ranks("global_rank", 0, lambda: ParallelStrategy.global_rank.fget(self))

    @global_rank.setter
    def global_rank(self, value: int) -> None:
        self._set_rank("global_rank", value)

    @property
    def local_rank(self) -> int:
        """0 with one node; else the cluster environment's (as DDP's). Settable, as :attr:`world_size`."""
        return self._ranks("local_rank", 0, lambda: ParallelStrategy.local_rank.fget(self))

    @local_rank.setter
    def local_rank(self, value: int) -> None:
        self._set_rank("local_rank", value)

    @property
    def node_rank(self) -> int:
        """0 with one node; else the cluster environment's ``node_rank()`` (as DDP's: ``SLURM_NODEID``,
        ``NODE_RANK``/``GROUP_RANK``...)."""
        return 0 if self._num_nodes == 1 else ParallelStrategy.node_rank.fget(self)

    def _ranks(self, name: str, one_node: int, from_environment: Any) -> int:
        if self._rank_overrides and name in self._rank_overrides:
            return self._rank_overrides[name]
        return one_node if self._num_nodes == 1 else from_environment()

    def _set_rank(self, name: str, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"`{name}` must be a non-negative int, got {value!r}.")
        self._rank_overrides = {**(self._rank_overrides or {}), name: value}

    @property
    def root_device(self) -> torch.device:
        """The CPU: the master weights, the optimizer and the batches live there."""
        return torch.device("cpu")

    @property
    def num_nodes(self) -> int:
        """Nodes = processes: one process per node (``world_size == num_nodes``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`num_nodes` must be a positive int, got {value!r}.")
        self._num_nodes = value

    @property
    def is_distributed(self) -> bool:
        """More than one process (Lightning then adds a ``DistributedSampler``)."""
        return self.world_size > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        set_world_ranks(self)

    def setup_environment(self) -> None:
        """Several nodes: the process group; one node: check that a launcher started one process.
        (Sets up no device: ``Strategy``'s would set up the CPU root device on the accelerator; the
        subclass sets up its first worker device.)"""
        if self.num_nodes > 1:
            setup_distributed(self, self.data_parallel)
        else:
            check_one_process(self)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # collectives (as DDPStrategy's; no-ops in one process)
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor) and _distributed_is_initialized():
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if not _distributed_is_initialized():
            return tensor
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    @contextmanager
    def block_backward_sync(self) -> Generator:
        """Accumulating batches do not synchronise gradients (as DDP's ``no_sync``)."""
        sync = self.data_parallel_sync
        if sync is None:
            yield None
            return
        sync.sync = False
        try:
            yield None
        finally:
            sync.sync = True

    def on_exception(self, exception: BaseException) -> None:
        if self.world_size > 1 and _distributed_is_initialized():
            # close this rank's connections: the other ranks' next collective fails within seconds
            log.error("RoundPipe: rank %d failed (%s); leaving the process group so that every rank stops",
                      self.global_rank, type(exception).__name__)
            dist.destroy_process_group()
        super().on_exception(exception)


def set_world_ranks(strategy: Any) -> None:
    """One process per node: with several nodes ``global_rank = node_rank + local_rank``,
    ``world_size = num_nodes`` (as ``DDPStrategy.set_world_ranks`` with one process per node); with
    one node the ranks are 0 and the cluster environment is left alone (a SLURM or torchrun
    environment with some variables missing is not read)."""
    env = strategy.cluster_environment
    if env is not None and strategy.num_nodes > 1:
        env.set_global_rank(strategy.node_rank + strategy.local_rank)
        env.set_world_size(strategy.num_nodes)
    rank_zero_only.rank = strategy.global_rank


def check_one_process(strategy: Any) -> None:
    """With one node, a launcher (SLURM's ``srun``, ``torchrun``, MPI) must have started one process:
    several would each train the whole model alone.

    Raises:
        ValueError: when the cluster environment reports a world size above 1 (a world size it cannot
            read, e.g. SLURM variables partly set, is not checked).
    """
    env = strategy.cluster_environment
    if env is None or not env.creates_processes_externally:
        return
    try:
        size = int(env.world_size())
    except (KeyError, ValueError, TypeError):
        return
    if size > 1:
        raise ValueError(
            f"RoundPipe runs one process per node: the cluster environment ({type(env).__name__}) has world size {size}"
            " for `num_nodes=1`. HINT: start one process per node (`--ntasks-per-node=1`, `torchrun --nproc-per-node 1`)"
            " and set `Trainer(num_nodes=<processes>)`; the node's devices are the pipeline's (`Trainer(devices=N)`)."
        )


def setup_distributed(strategy: Any, config: DataParallel) -> None:
    """Check the cluster environment and open the gloo process group (``world_size > 1`` only).

    Raises:
        ValueError: when the environment's world size is not ``num_nodes`` (one process per node),
            or, with Lightning's own environment, ``MASTER_PORT`` is not set (every process would
            pick its own free port).
    """
    from lightning.fabric.utilities.distributed import _init_dist_connection

    env = strategy.cluster_environment
    env.validate_settings(num_devices=1, num_nodes=strategy.num_nodes)
    if isinstance(env, LightningEnvironment) and "MASTER_PORT" not in os.environ:
        raise ValueError(
            f"`Trainer(strategy='roundpipe', num_nodes={strategy.num_nodes})` runs one process per node; they meet at"
            " `MASTER_ADDR:MASTER_PORT`, and `MASTER_PORT` is not set."
            " HINT: on node k run `MASTER_ADDR=<node 0> MASTER_PORT=29500 NODE_RANK=k python train.py`, or use"
            " `torchrun --nnodes N --nproc-per-node 1 ...` or SLURM (`srun --ntasks-per-node=1`)."
        )
    if strategy.world_size != strategy.num_nodes:
        raise ValueError(
            f"RoundPipe runs one process per node: the cluster environment has world size {strategy.world_size}"
            f" for `num_nodes={strategy.num_nodes}`. HINT: start one process per node (`--ntasks-per-node=1`,"
            " `torchrun --nproc-per-node 1`) and set `Trainer(num_nodes=<processes>)`."
        )
    _init_dist_connection(env, "gloo", timeout=datetime.timedelta(seconds=config.timeout_s))
    rank_zero_info(f"RoundPipe: data parallel over {strategy.world_size} processes (one per node, gloo),"
                   f" {strategy.num_devices} pipeline device(s) each")


def warn_devices_auto(trainer: Any) -> None:
    """A pipeline of one CPU virtual device (what ``devices="auto"`` gives on the CPU: Lightning
    resolves ``"auto"`` to 1 before the strategy sees it) runs every stage on one compute thread:
    warn, naming ``devices=N`` (a ``PossibleUserWarning``, silenced like Lightning's own)."""
    devices = trainer.strategy.parallel_devices or [torch.device("cpu")]
    if len(devices) == 1 and torch.device(devices[0]).type == "cpu":
        rank_zero_warn(
            "RoundPipe pipelines over 1 CPU virtual device (`devices=1`, also what `devices='auto'` becomes with"
            " `accelerator='cpu'`): every stage runs on one compute thread. HINT: pass `Trainer(devices=N)` for N CPU virtual devices.",
            category=PossibleUserWarning,
        )


class DataParallelSync:
    """The per-fit state of the gradient synchronisation: the bucketed all-reduce, the executor
    hook that starts buckets during the backward, and the global ``num_items_in_batch``.

    Args:
        engine: the strategy's :class:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine`.
        lightning_module: its trainable parameters outside the pipelined model are reduced too.
        config: :class:`DataParallel`.
    """

    def __init__(self, engine: Any, lightning_module: torch.nn.Module, config: DataParallel) -> None:
        self.engine = engine
        self.lightning_module = lightning_module
        self.config = config
        layer_params = [[p for p in layer.parameters() if p.requires_grad] for layer in engine.seq.layers]
        self.reducer = GradientAllReduce(layer_params, bucket_bytes=config.bucket_bytes)
        self._original_prepare = None
        if config.overlap:
            engine.executor.grads_final_hook = self.reducer.layers_final
            engine.sink_barrier = self.reducer.sink_barrier
        # the fused path's buffers too, unless the asynchronous optimizer holds them back (its own barrier)
        self._sink_overlap = config.overlap and engine.grad_barrier is None
        self.reducer.accept_sink = self._sink_overlap
        if config.global_num_items and engine.seq.loss_key:
            self._install_global_count()

    def _install_global_count(self) -> None:
        seq = self.engine.seq
        original = self._original_prepare = seq.prepare

        def prepare(args: tuple, kwargs: dict) -> dict:
            carry = original(args, kwargs)
            if (torch.is_grad_enabled() and "num_items_in_batch" in carry
                    and kwargs.get("num_items_in_batch") is None):
                carry["num_items_in_batch"] = global_item_count(carry["num_items_in_batch"])
            return carry

        seq.prepare = prepare

    @property
    def sync(self) -> bool:
        return self.reducer.sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self.reducer.sync = value

    def after_backward(self) -> None:
        """Average the gradients (when this backward synchronises): wait for the overlapped buckets,
        reduce the rest."""
        if not self.reducer.sync:
            # .grad now holds this process's own gradient: the next synchronising backward must not add
            # the fused path's averaged buffers to it (finish() reduces .grad after it instead)
            self.reducer.accept_sink = False
            return
        extra = [p for p in self.lightning_module.parameters() if p.requires_grad]
        try:
            self.reducer.finish(extra)
        finally:
            self.reducer.accept_sink = self._sink_overlap

    def metrics(self) -> dict[str, float]:
        """``roundpipe/allreduce(s)`` and ``roundpipe/allreduce(bytes)`` since the last call."""
        stats = self.reducer.pop_stats()
        return {"roundpipe/allreduce(s)": stats.seconds, "roundpipe/allreduce(bytes)": float(stats.bytes)}

    def close(self) -> None:
        self.reducer.discard()
        if self.engine.executor.grads_final_hook == self.reducer.layers_final:
            self.engine.executor.grads_final_hook = None
        if self.engine.sink_barrier == self.reducer.sink_barrier:
            self.engine.sink_barrier = None
        if self._original_prepare is not None:
            self.engine.seq.prepare = self._original_prepare
            self._original_prepare = None


def node_metrics(strategy: Any, metrics: dict[str, float]) -> dict[str, float]:
    """The metrics rank 0 logs: with one process, ``metrics`` unchanged; with several, every
    process's keys with its node in them (``roundpipe/node1/device0/bubble(%)``), gathered to
    rank 0 (``all_gather_object``: a collective, every process calls it), plus the largest
    ``roundpipe/allreduce(s)`` over the nodes and ``roundpipe/allreduce(bytes)`` (the same on every
    node). Ranks other than 0 get ``{}``."""
    sync = getattr(strategy, "data_parallel_sync", None)
    if sync is None or strategy.world_size <= 1:
        return metrics
    local = dict(metrics)
    local.update(sync.metrics())
    gathered: list[dict[str, float]] = [{} for _ in range(strategy.world_size)]
    try:
        dist.all_gather_object(gathered, local)
    except Exception as error:  # another rank failed or was killed: the same clear error as the gradient all-reduce
        from lightning_roundpipe.runtime.host.allreduce import _fail

        raise _fail("the per-node metrics gather", error) from error
    if strategy.global_rank != 0:
        return {}
    out: dict[str, float] = {}
    for node, values in enumerate(gathered):
        for key, value in values.items():
            out[key.replace("roundpipe/", f"roundpipe/node{node}/", 1)] = value
    out["roundpipe/allreduce(s)"] = max(v.get("roundpipe/allreduce(s)", 0.0) for v in gathered)
    out["roundpipe/allreduce(bytes)"] = gathered[0].get("roundpipe/allreduce(bytes)", 0.0)
    return out
