"""The strategy's arguments as one typed config: :class:`RoundPipeConfig`.

Pure data (no torch, no Lightning: importable alone, DESIGN.md section 3), shared by

- :class:`~lightning_roundpipe.RoundPipeStrategy`: its keyword arguments build a config
  (``RoundPipeStrategy(num_microbatches=4)``), or take one (``RoundPipeStrategy(config=RoundPipeConfig(...))``);
- :class:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine`
  (:meth:`~lightning_roundpipe.runtime.execution.engine.RoundPipeEngine.from_config`);
- ``conf/strategy/roundpipe.yaml``: one key per field, so every field can be set from the command line
  (``strategy.fused_loss=false strategy.optimizer=async``); a test checks the keys equal the fields.

Every field is validated once, in :meth:`RoundPipeConfig.__post_init__`, with Lightning-style errors
(the backticked name, the valid options and a HINT).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

DEFAULT_CHUNK_BYTES = 64 * 2**20
"""Default largest weight upload chunk, bytes (64 MiB; the same as ``schedule.lower.DEFAULT_CHUNK_BYTES``)."""

DEFAULT_TRACE_EVERY_N_STEPS = 50
"""Default batches between two step traces (:attr:`RoundPipeConfig.trace_every_n_steps`)."""

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Default largest all-reduce bucket across nodes, bytes of fp32 gradients (25 MiB, as DDP's ``bucket_cap_mb``)."""

PARTITION_MODES = ("auto", "default")
DISPATCH_MODES = ("auto", "round_robin", "weighted")
OPTIMIZER_MODES = ("sync", "async")
STALENESS_CORRECTIONS = (None, "weight_prediction", "delay_compensation", "gradient_extrapolation")
"""Values of :attr:`RoundPipeConfig.staleness_correction` (``"none"`` is read as ``None``)."""
DEFAULT_STALENESS_LAMBDA = 0.04
"""Default :attr:`RoundPipeConfig.staleness_correction_lambda` (DC-ASGD's variance control, untuned)."""
FROZEN_WEIGHT_MODES = (None, "fp8", "nf4")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy ints too


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_positive(name: str, value: Any, integer: bool, hint: str) -> None:
    ok = _is_int(value) if integer else _is_number(value)
    if not ok or not value > 0 or not math.isfinite(value):
        kind = "a positive int" if integer else "a positive finite number"
        raise ValueError(f"`{name}` must be {kind}, got {value!r}. HINT: {hint}.")


MIN_RELATIVE_SPEED = 0.01
"""The slowest CPU virtual device accepted, relative to the fastest (``cpu_device_speeds``)."""


def _bytes(name: str, value: Any, hint: str) -> int:
    """A size argument in bytes as an int: an int (numpy's too) or, deliberately, a float holding a whole
    number (``1.5e9``, as a command line or a YAML file writes a large size); every size argument of the
    strategy (``chunk_bytes``, ``device_memory_bytes``, ``DataParallel.bucket_bytes``) takes the same.

    Raises:
        TypeError: not a number (a ``str``, a ``bool``, ``None``).
        ValueError: a float that is no whole number of bytes, or a value <= 0.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be an int of bytes (or a float holding a whole number, e.g. 1.5e9), got"
                        f" {value!r} ({type(value).__name__}). HINT: {hint}.")
    if not _is_int(value) and not (math.isfinite(value) and float(value).is_integer()):
        raise ValueError(f"`{name}` must be a whole number of bytes (an int, or a float such as 1.5e9), got {value!r}."
                         f" HINT: {hint}.")
    if not value > 0:
        raise ValueError(f"`{name}` must be a positive number of bytes, got {value!r}. HINT: {hint}.")
    return int(value)


MIN_LINK_BYTES_PER_S = 1e6
"""The slowest modelled host link accepted, bytes/s (1 MB/s; a GiB stage then takes 18 minutes a copy):
a rate given in GB/s by mistake (``25``) would make each upload take days, and the run look hung."""


def check_link_rate(rate: float) -> None:
    """Raise ``ValueError`` for a ``cpu_link_bytes_per_s`` below :data:`MIN_LINK_BYTES_PER_S`."""
    if rate < MIN_LINK_BYTES_PER_S:
        raise ValueError(f"`cpu_link_bytes_per_s` is in bytes/s and must be at least {MIN_LINK_BYTES_PER_S:.0e}"
                         f" (1 MB/s), got {rate!r}: a 64 MiB weight chunk would take {64 * 2**20 / rate / 86400:.1f}"
                         " days. HINT: 25e9 models PCIe 4.0 x16 one way (25 GB/s).")


def _as_ranges(name: str, stages: Any) -> tuple[range, ...] | None:
    """``None``, or ``stages`` (``range`` s or ``(start, stop)`` pairs, e.g. lists from YAML) as ranges."""
    if stages is None:
        return None
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence):
        raise TypeError(f"`{name}` must be a list of `range`s or `(start, stop)` pairs, got {stages!r}."
                        " HINT: forward_stages=[(0, 3), (3, 6)] covers layers 0..5 in two stages.")
    out = []
    for stage in stages:
        if isinstance(stage, range):
            out.append(stage)
        elif (isinstance(stage, Sequence) and not isinstance(stage, (str, bytes)) and len(stage) == 2
              and all(_is_int(v) for v in stage)):
            out.append(range(stage[0], stage[1]))
        else:
            raise TypeError(
                f"`{name}` entries must be `range`s or `(start, stop)` pairs of layer indices, got {stage!r}."
                " HINT: forward_stages=[(0, 3), (3, 6)] covers layers 0..5 in two stages;"
                " from the command line: strategy.forward_stages=[[0,3],[3,6]]."
            )
    return tuple(out)


@dataclass(kw_only=True, frozen=True)
class DataParallel:
    """Settings of the data parallelism across nodes (used only when ``world_size > 1``).

    A field of :class:`RoundPipeConfig` (``RoundPipeStrategy(data_parallel=DataParallel(...))``; from the
    command line ``strategy.data_parallel.timeout_s=60``).

    Attributes:
        timeout_s: the process group's timeout, seconds: a collective that waits longer for a
            peer raises on every rank still alive (gloo; default 1800 as torch's
            ``default_pg_timeout``). A process that exits or is killed closes its connections, so
            its peers fail at their next collective within seconds whatever this is.
        bucket_bytes: largest all-reduce bucket, bytes of fp32 gradients (default 25 MiB, as
            DistributedDataParallel's ``bucket_cap_mb``); an int, or a float holding a whole number.
        overlap: start a bucket's all-reduce as soon as its layers' gradients are complete, while
            the backward stages of earlier layers still run (transparent path; fused path on the
            first backward of an optimizer step; not with ``optimizer="async"``); ``False``: all
            buckets after the backward.
        global_num_items: Hugging Face causal LMs called with ``labels`` and no
            ``num_items_in_batch``: normalise the loss by the label tokens of the *global* batch
            (all-reduced; :func:`~lightning_roundpipe.runtime.host.allreduce.global_item_count`), so the
            averaged gradient equals one process on the global batch also with unequal token
            counts per process (as transformers' Trainer does for DDP). ``False``: each process
            normalises by its own batch (as plain DDP would).
    """

    timeout_s: float = 1800.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    overlap: bool = True
    global_num_items: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"`DataParallel(timeout_s=...)` must be a positive number of seconds, got {self.timeout_s!r}."
                             " HINT: 1800 (torch's default); a few seconds only in tests.")
        object.__setattr__(self, "bucket_bytes", _bytes("DataParallel(bucket_bytes=...)", self.bucket_bytes,
                                                        hint="25 * 2**20 (25 MiB, as DDP)"))
        for name in ("overlap", "global_num_items"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`DataParallel({name}=...)` must be a bool, got {getattr(self, name)!r}.")


@dataclass(kw_only=True, frozen=True)
class RoundPipeConfig:
    """Arguments of RoundPipe pipeline training (arXiv 2604.27085), validated at construction.

    Raises:
        ValueError: for a value out of range or not among the valid options (named in the message).
        TypeError: for an ill-typed ``module``, ``fused_loss``, ``balance_microbatches`` or stage list.
    """

    num_microbatches: int | None = None
    """``int >= 1`` or ``None``; default ``None``: the number of devices + 1. Microbatches each batch is cut
    into along dim 0 (paper section 3: bubbles nearly vanish once microbatches >= devices + 1)."""

    module: str | None = None
    """``str`` or ``None``; default ``None``: the one child of the LightningModule that is a supported model
    (HF causal LM, also under PEFT, or ``nn.Sequential``). Attribute of the LightningModule to pipeline
    (dotted paths allowed)."""

    partition: str = "auto"
    """``"auto"`` or ``"default"``; default ``"auto"``: run the simple partition (forward stages of 3
    layers, backward stages of 1) while every layer is profiled for ``profile_steps`` training steps,
    then re-cut the stages with the automatic partitioner (DESIGN.md section 6); ``"default"``: keep the
    simple partition. Ignored when ``forward_stages``/``backward_stages`` are given."""

    profile_steps: int = 3
    """``int >= 2``, training steps; default 3. Steps profiled per layer before the automatic partition
    and the simulator's ``roundpipe/predicted_step(s)`` (the first is warm-up and dropped)."""

    fused_loss: bool = True
    """``bool``; default ``True``. When the model computes its own loss (HF causal LM called with
    ``labels``), run forward stages, the fused tail (last layers, LM head and loss: never recomputed,
    logits never leave the device) and the backward stages as one plan inside the forward call; the
    output then carries the loss only (reading ``.logits`` raises). ``False``: always the
    autograd-transparent path, which returns logits."""

    forward_stages: tuple[range, ...] | None = None
    """``range`` s or ``(start, stop)`` pairs of layer indices (ascending, tiling the layer sequence), or
    ``None``; default ``None``. Explicit forward stage boundaries (overrides ``partition``; needs
    ``backward_stages``). From the command line: ``strategy.forward_stages=[[0,3],[3,6]]``."""

    backward_stages: tuple[range, ...] | None = None
    """Like ``forward_stages``, in execution order (the tail, i.e. the last layers, first); default ``None``."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """``int > 0``, bytes (a float holding a whole number, ``6.4e7``, is taken as that int; any other float
    raises ``ValueError``, a non-number ``TypeError``); default 67108864 (64 MiB). Largest weight upload chunk;
    activation uploads go between chunks (paper section 3.3)."""

    microbatches_per_round: int | None = None
    """``int > 0`` or ``None``, microbatches; default ``None``: one round, every stage loaded once per
    step, except that ``partition="auto"`` then also times rounds of ``ceil(M / devices)``, of
    ``devices`` and of 1 with every candidate partition and keeps the fastest (with the whole model as
    one fused stage, rounds hand whole microbatches to the devices in turn, with no recomputation).
    Dispatch the microbatches in rounds of at most this many (the paper's artifact uses rounds of
    ``devices``); a value here is kept by the automatic choice."""

    balance_microbatches: bool = True
    """``bool``; default ``True``. With ``partition="auto"``, the automatic choice also times the batch cut
    into the next multiple of the device count of microbatches, ``ceil(num_microbatches / devices) *
    devices`` (never more than one per row), and runs it when the simulator finds that at least 2 %
    faster: with ``num_microbatches`` not a multiple of the devices, the last round leaves devices idle
    (8 rows as 3, 3, 2 on 2 devices: 5 rows on one, 3 on the other; as 4 x 2 rows: 4 each). The
    microbatches only get smaller (less activation memory each) and the loss stays normalised by the
    whole batch. Never with one device, a ``microbatches_per_round`` of yours, random layers (dropout
    masks are drawn per microbatch) or a routing (MoE) model. Chosen once, from the rows of the last
    profiled batch, and kept for the run (and in its checkpoints). ``False``: always
    ``num_microbatches``."""

    cpu_link_bytes_per_s: float | None = None
    """``float >= 1e6`` or ``None``, bytes/s per direction; default ``None``: copies at memory speed. CPU
    virtual devices only: every copy takes ``bytes / rate``, so a CPU run reproduces a PCIe-bound regime
    (``25e9`` models PCIe 4.0 x16 one way)."""

    debug_copy_delay_s: float = 0.0
    """``float >= 0``, seconds; default 0 (off). CPU virtual devices only, for debugging the runtime:
    every copy lands this many seconds late and its destination holds NaN meanwhile, so a missing
    dependency shows up as a wrong result."""

    check_streams: bool | None = None
    """``bool`` or ``None``; default ``None``: on when the environment variable
    ``LIGHTNING_ROUNDPIPE_CHECK_STREAMS=1`` is set (the test suite sets it), else off. CPU virtual devices
    only: the checking mode of the CPU driver, which raises, naming the op, when an op reads or overwrites
    a buffer whose producer or last reader its stream has not waited for (a missing dependency), at the
    cost of some host time per op."""

    device_memory_bytes: int | tuple[int, ...] | None = None
    """``int > 0``, a list of them (one per device: devices of unequal memory) or ``None``, bytes (a float
    holding a whole number, ``1.5e9`` as a command line writes it, is taken as that int; any other float raises
    ``ValueError``, a non-number ``TypeError``); default ``None``: unlimited on CPU virtual devices, the GPU's memory on CUDA. Memory of one device. CPU virtual
    devices enforce it: a step that would hold more on a device (weights, saved activations, per-op outputs)
    raises ``DeviceMemoryError`` (a ``torch.OutOfMemoryError``) naming the stage, the bytes asked and the
    budget. On GPUs it replaces the device's total memory in the automatic partition's per-stage budget
    (half of it). With a list, the round robin needs every stage within half of the smallest; the weighted
    ``dispatch`` places each stage only on devices whose half holds it (DESIGN.md section 12)."""

    cpu_device_speeds: tuple[float, ...] | None = None
    """A list of finite numbers > 0, one per device, or ``None``; default ``None``: every CPU virtual device
    at the host's speed. CPU virtual devices only: relative compute speeds (scaled so the fastest is 1.0),
    e.g. ``[1.0, 0.5]``: device 1's compute thread sleeps as long as each op ran, so its work really takes
    twice as long and its stream order is unchanged; mixed GPUs reproduced on a CPU (DESIGN.md section 12).
    The speeds are measured like a GPU's after the warm-up step."""

    dispatch: str = "auto"
    """``"auto"``, ``"round_robin"`` or ``"weighted"``; default ``"auto"``. Which device runs each stage:
    ``"round_robin"``, the paper's (stage k on device k mod D); ``"weighted"``, each stage to the device
    that would finish it first given its measured speed and load, only on devices whose memory holds it
    (faster devices take more stages, larger ones larger stages); ``"auto"``: the round robin until the
    profiled steps are over, then, on devices that differ in measured speed or in memory, the one the
    simulator times faster (the weighted one by a 3 % margin), said in the automatic choice's line."""

    optimizer: str = "sync"
    """``"sync"`` or ``"async"``; default ``"sync"``: Lightning's exact semantics, the optimizer step runs
    between two pipelines. ``"async"``: the paper's mode (section 4): the CPU optimizer step of step k
    runs on a background thread while the pipeline of step k+1 runs on the weights from before it."""

    staleness_correction: str | None = None
    """``None`` (or ``"none"``), ``"weight_prediction"``, ``"delay_compensation"`` or ``"gradient_extrapolation"``;
    default ``None``: ``optimizer="async"``'s one-step-stale update as the paper runs it. A correction of
    the stale step computed on the host (no extra PCIe bytes), with ``optimizer="async"`` only; each keeps
    one fp32 copy per trainable parameter (4 bytes/parameter of host memory):

    - ``"weight_prediction"``: the snapshot a stale step computes on is ``W + (W - W_prev)``, the weights
      extrapolated by the last update (SpecTrain, Chen et al. 2018, arXiv 1809.02839; PipeMare, Yang et al.
      2021); the optimizer steps the true weights.
    - ``"delay_compensation"``: DC-ASGD (Zheng et al., ICML 2017): the stale gradient ``g`` becomes
      ``g + lambda * g * g * (W_now - W_stale)`` before the hooks and clipping see it.
    - ``"gradient_extrapolation"``: the stale gradient becomes ``g_k + (g_k - g_{k-1})``, a first-order
      predictor of the gradient at the fresh weights (not the error feedback of arXiv 2606.30634).

    A step that computes on the current weights (the first of a fit, the first after a validation) is
    not corrected. ``docs/usage.md``, *Sync or async?*, says what each does and costs."""

    staleness_correction_lambda: float = DEFAULT_STALENESS_LAMBDA
    """``float >= 0``; default 0.04: ``lambda`` of ``staleness_correction="delay_compensation"`` (the constant
    variance-control factor of DC-ASGD, Zheng et al. 2017; not tuned: the paper tunes it per task). Ignored
    by the other corrections."""

    overlap_batches: bool = True
    """``bool``; default ``True``: issue the next batch's pipeline while this batch's backward stages
    still drain (DESIGN.md section 11): with ``optimizer="sync"`` the accumulated batches that do not
    step the optimizer (``accumulate_grad_batches > 1``, exact); with ``optimizer="async"`` every
    step, the paper's steady state (weights one step stale, as without it). ``False``: every batch's
    pipeline drains before its backward returns (for comparison). ``docs/usage.md`` says what the
    hooks see."""

    trace_every_n_steps: int | None = DEFAULT_TRACE_EVERY_N_STEPS
    """``int >= 0`` or ``None``, training batches; default 50. Write a Chrome/Perfetto trace and a timeline
    PNG (measured step beside the simulator's) of one training batch every this many batches, counted from
    the first batch after the profiled steps, into ``<trainer.log_dir>/roundpipe/`` and to W&B
    (``docs/usage.md``, *Traces*); none without a logger that has a folder; ``0`` or ``None``: off."""

    peak_flops: float | None = None
    """``float > 0`` or ``None``, FLOP/s of one device in the compute dtype (dense); default ``None``:
    looked up by GPU name (``runtime.flops.PEAK_FLOPS``), no ``roundpipe/mfu(%)`` on CPU."""

    frozen_weights: str | None = None
    """``"fp8"``, ``"nf4"`` or ``None``; default ``None``: frozen matmul weights held and uploaded in the compute dtype
    (bf16 under ``bf16-mixed``), as ever. ``"fp8"``: the frozen matmul weights (2-D ``nn.Linear`` /
    Hugging Face ``Conv1D`` weights with ``requires_grad=False``: a LoRA base's projections) are converted
    once, when the strategy sets up, layer by layer, to fp8 (e4m3) with one fp32 scale per output channel,
    held so on the host (about 1 byte per parameter), uploaded so (half of bf16's bytes) and dequantised
    to the compute dtype on the devices right before use. Norms, embeddings, tied or trainable weights stay
    as they are. Checkpoints leave the fp8 weights out; after the run they hold their fp8-rounded values
    (docs/usage.md, *fp8 frozen weights*). ``"nf4"``: the same weights (``nn.Linear`` ones) quantised once with
    bitsandbytes' ``quantize_4bit`` (NF4, blocks of 64, double-quantised absmax: about 0.53 bytes per parameter),
    uploaded packed with their quantisation state and dequantised on the devices by bitsandbytes
    (``dequantize_4bit``), as ``Linear4bit`` computes; needs ``bitsandbytes`` (the ``qlora`` extra). Weights a
    model was *loaded* with in 4 or 8 bits (``BitsAndBytesConfig``) are streamed packed whatever this is."""

    data_parallel: DataParallel = field(default_factory=DataParallel)
    """:class:`DataParallel` (or a mapping of its fields); default ``DataParallel()``. Data parallelism
    across nodes (``Trainer(num_nodes=N)``, one process per node): process group timeout, all-reduce
    bucket size, overlap with the backward, global token count. Ignored with one node."""

    def __post_init__(self) -> None:
        n = self.num_microbatches
        if n is not None and (not _is_int(n) or n < 1):
            raise ValueError(f"`num_microbatches` must be a positive int or None (devices + 1), got {n!r}."
                             " HINT: e.g. `num_microbatches=9` for 8 devices.")
        if self.module is not None and not isinstance(self.module, str):
            raise TypeError(f"`module` must be the name of a LightningModule attribute (str) or None,"
                            f" got {type(self.module).__name__}. HINT: `module='model'` for `self.model`.")
        if isinstance(self.module, str) and not all(part.isidentifier() for part in self.module.split(".")):
            raise ValueError(f"`module` must be an attribute path of the LightningModule such as 'model' or"
                             f" 'backbone.lm', got {self.module!r}. HINT: None picks the one supported model it holds.")
        if self.partition not in PARTITION_MODES:
            near = self.partition.strip().lower() if isinstance(self.partition, str) else None
            hint = (f"use {near!r} (lowercase, no spaces)" if near in PARTITION_MODES
                    else "pass explicit stages with `forward_stages=` and `backward_stages=`")
            raise ValueError(f"`partition` must be one of {list(PARTITION_MODES)}, got {self.partition!r}. HINT: {hint}.")
        if not _is_int(self.profile_steps) or self.profile_steps < 2:
            raise ValueError(f"`profile_steps` must be an int >= 2 (the first step is warm-up),"
                             f" got {self.profile_steps!r}. HINT: the default is 3.")
        if not isinstance(self.overlap_batches, bool):
            raise TypeError(f"`overlap_batches` must be a bool, got {self.overlap_batches!r}."
                            " HINT: `overlap_batches=False` drains the pipeline at every batch.")
        if not isinstance(self.fused_loss, bool):
            raise TypeError(f"`fused_loss` must be a bool, got {self.fused_loss!r}."
                            " HINT: `fused_loss=False` returns logits from a training call with `labels`.")
        if not isinstance(self.balance_microbatches, bool):
            raise TypeError(f"`balance_microbatches` must be a bool, got {self.balance_microbatches!r}."
                            " HINT: pass `True` (the default) or `False` (always cut into `num_microbatches`);"
                            " from the command line `strategy.balance_microbatches=true` or `=false`.")
        fwd = _as_ranges("forward_stages", self.forward_stages)
        bwd = _as_ranges("backward_stages", self.backward_stages)
        if (fwd is None) != (bwd is None):
            raise ValueError("Pass both `forward_stages` and `backward_stages`, or neither (default partition)."
                             " HINT: backward_stages=[(3, 6), (0, 3)] lists the tail first.")
        object.__setattr__(self, "forward_stages", fwd)
        object.__setattr__(self, "backward_stages", bwd)
        object.__setattr__(self, "chunk_bytes", _bytes("chunk_bytes", self.chunk_bytes, hint="e.g. 64 * 2**20 (64 MiB)"))
        if self.microbatches_per_round is not None:
            _check_positive("microbatches_per_round", self.microbatches_per_round, integer=True,
                            hint="e.g. the number of devices")
        if self.cpu_link_bytes_per_s is not None:
            _check_positive("cpu_link_bytes_per_s", self.cpu_link_bytes_per_s, integer=False,
                            hint="25e9 models PCIe 4.0 x16 one way")
            check_link_rate(self.cpu_link_bytes_per_s)
        delay = self.debug_copy_delay_s
        if not _is_number(delay) or not 0 <= delay < math.inf:
            raise ValueError(f"`debug_copy_delay_s` must be a finite number of seconds >= 0, got {delay!r}."
                             " HINT: 0.05 makes a missing dependency show; 0 turns the delay off.")
        object.__setattr__(self, "debug_copy_delay_s", float(delay))
        if self.check_streams is not None and not isinstance(self.check_streams, bool):
            raise TypeError(f"`check_streams` must be True, False or None, got {self.check_streams!r}."
                            " HINT: None follows LIGHTNING_ROUNDPIPE_CHECK_STREAMS.")
        if isinstance(self.device_memory_bytes, Sequence) and not isinstance(self.device_memory_bytes, (str, bytes)):
            per_device = tuple(self.device_memory_bytes)
            if not per_device:
                raise ValueError("`device_memory_bytes` is an empty list. HINT: one int (bytes) per device, one int"
                                 " for all devices, or None.")
            object.__setattr__(self, "device_memory_bytes", tuple(
                _bytes(f"device_memory_bytes[{index}]", value,
                       hint="one positive int (bytes) per device, e.g. [256 * 2**20, 64 * 2**20]")
                for index, value in enumerate(per_device)))
        elif self.device_memory_bytes is not None:
            object.__setattr__(self, "device_memory_bytes", _bytes(
                "device_memory_bytes", self.device_memory_bytes,
                hint="e.g. 67108864 (64 MiB) per device, or one int per device"))
        speeds = self.cpu_device_speeds
        if speeds is not None:
            if isinstance(speeds, (str, bytes)) or not isinstance(speeds, Sequence) or not speeds:
                what = "is an empty list" if isinstance(speeds, Sequence) and not speeds else f"got {speeds!r}"
                raise ValueError(f"`cpu_device_speeds` must be a list of relative speeds, one per device, or None; it"
                                 f" {what}. HINT: cpu_device_speeds=[1.0, 0.5] makes device 1 half as fast.")
            for index, value in enumerate(speeds):
                _check_positive(f"cpu_device_speeds[{index}]", value, integer=False,
                                hint="relative speeds, one per device, e.g. [1.0, 0.5]")
            if min(speeds) < MIN_RELATIVE_SPEED * max(speeds):
                raise ValueError(f"`cpu_device_speeds={list(speeds)}`: the slowest device is more than"
                                 f" {1 / MIN_RELATIVE_SPEED:.0f}x slower than the fastest; each of its ops would sleep"
                                 " that many times its work and the run would look hung. HINT: relative speeds within"
                                 f" {MIN_RELATIVE_SPEED} of each other, e.g. [1.0, 0.25], or leave the slow device out.")
            object.__setattr__(self, "cpu_device_speeds", tuple(float(v) for v in speeds))
        if not isinstance(self.dispatch, str) or self.dispatch not in DISPATCH_MODES:
            near = self.dispatch.strip().lower() if isinstance(self.dispatch, str) else None
            hint = (f"use {near!r} (lowercase, no spaces)" if near in DISPATCH_MODES else
                    "'auto' keeps the round robin unless the simulator times the weighted dispatch faster on devices"
                    " of unequal speed or memory")
            raise ValueError(f"`dispatch` must be one of {list(DISPATCH_MODES)}, got {self.dispatch!r}. HINT: {hint}.")
        if not isinstance(self.optimizer, str) or self.optimizer not in OPTIMIZER_MODES:
            near = self.optimizer.strip().lower() if isinstance(self.optimizer, str) else None
            hint = (f"use {near!r} (lowercase, no spaces)" if near in OPTIMIZER_MODES else
                    "'sync' (default) keeps Lightning's exact semantics; 'async' overlaps the CPU optimizer step with"
                    " the next step's pipeline (weights one step stale, RoundPipe paper section 4)")
            raise ValueError(f"`optimizer` must be one of {list(OPTIMIZER_MODES)}, got {self.optimizer!r}. HINT: {hint};"
                             " from the command line `strategy.optimizer=async`.")
        self._check_staleness_correction()

        every = self.trace_every_n_steps
        if every is not None and (not _is_int(every) or every < 0):
            raise ValueError(f"`trace_every_n_steps` must be an int >= 0 or None, got {every!r}."
                             f" HINT: {DEFAULT_TRACE_EVERY_N_STEPS} traces the first step after the profiled ones and"
                             f" every {DEFAULT_TRACE_EVERY_N_STEPS}th after it; 0 or None turns tracing off.")
        peak = self.peak_flops
        if peak is not None:
            if not _is_number(peak) or not 0 < peak < math.inf:
                raise ValueError(f"`peak_flops` must be a finite number of FLOP/s > 0 per device, or None, got {peak!r}."
                                 " HINT: 165.2e12 is an RTX 4090's dense bf16 peak; None looks known GPUs up by name.")
            object.__setattr__(self, "peak_flops", float(peak))
        if isinstance(self.frozen_weights, str) and self.frozen_weights.strip().lower() in ("none", "null"):
            object.__setattr__(self, "frozen_weights", None)  # as `staleness_correction` reads "none"
        if self.frozen_weights not in FROZEN_WEIGHT_MODES:
            near = self.frozen_weights.strip().lower() if isinstance(self.frozen_weights, str) else None
            hint = (f"use {near!r} (lowercase)" if near is not None and near in FROZEN_WEIGHT_MODES else
                    "use None (the default): the base stays as loaded, which `roundpipe plan --frozen-weights"
                    " bf16` models" if near in ("bf16", "bfloat16") else
                    "'fp8' holds the frozen matmul weights (a LoRA base) in fp8 with per-channel scales, 'nf4' in"
                    " bitsandbytes' 4-bit NormalFloat; None (the default) keeps them in the compute dtype")
            raise ValueError(f"`frozen_weights` must be one of {list(FROZEN_WEIGHT_MODES)}, got {self.frozen_weights!r}."
                             f" HINT: {hint}; from the command line `strategy.frozen_weights=fp8`, `=nf4` or `=null`.")

        data_parallel = self.data_parallel
        if isinstance(data_parallel, Mapping):  # e.g. a dict or a Hydra DictConfig
            given = {k: v for k, v in data_parallel.items() if k != "_target_"}
            valid = [f.name for f in fields(DataParallel)]
            unknown = sorted(set(given) - set(valid))
            if unknown:
                raise TypeError(f"`data_parallel` has no field {', '.join(f'`{k}`' for k in unknown)}; valid: {valid}."
                                " HINT: strategy.data_parallel.timeout_s=60 from the command line.")
            data_parallel = DataParallel(**given)
        if not isinstance(data_parallel, DataParallel):
            raise TypeError(f"`data_parallel` must be a `DataParallel` or None, got {type(data_parallel).__name__}."
                            " HINT: `RoundPipeStrategy(data_parallel=DataParallel(timeout_s=60))`.")
        object.__setattr__(self, "data_parallel", data_parallel)

    def _check_staleness_correction(self) -> None:
        correction = self.staleness_correction
        if isinstance(correction, str) and correction.strip().lower() in ("none", "null"):
            correction = None
        if correction not in STALENESS_CORRECTIONS:
            near = correction.strip().lower().replace("-", "_") if isinstance(correction, str) else None
            hint = (f"use {near!r}" if near in STALENESS_CORRECTIONS else "None (default) keeps the paper's one-step-stale"
                    " update; docs/usage.md, *Sync or async?*, says what each correction does and costs")
            raise ValueError(f"`staleness_correction` must be one of {list(STALENESS_CORRECTIONS)} (or 'none'), got"
                             f" {self.staleness_correction!r}. HINT: {hint}; from the command line"
                             " `strategy.staleness_correction=weight_prediction`.")
        if correction is not None and self.optimizer != "async":
            raise ValueError(f"`staleness_correction={correction!r}` corrects the one-step-stale update of"
                             f" `optimizer='async'`, but `optimizer={self.optimizer!r}` has no stale step. HINT: pass"
                             " `optimizer='async'` too (command line: `strategy.optimizer=async`), or leave"
                             " `staleness_correction=None`.")
        object.__setattr__(self, "staleness_correction", correction)
        lam = self.staleness_correction_lambda
        if not _is_number(lam) or not 0 <= lam < math.inf:
            raise ValueError(f"`staleness_correction_lambda` must be a finite number >= 0, got {lam!r}. HINT:"
                             f" {DEFAULT_STALENESS_LAMBDA} (the default) for DC-ASGD's `lambda`; 0 turns the delay"
                             " compensation off.")
        if float(lam) != DEFAULT_STALENESS_LAMBDA and correction != "delay_compensation":
            raise ValueError(f"`staleness_correction_lambda={lam!r}` is read only by"
                             f" `staleness_correction='delay_compensation'`, but `staleness_correction={correction!r}`:"
                             " the value would be ignored. HINT: pass `staleness_correction='delay_compensation'` (command"
                             " line: `strategy.staleness_correction=delay_compensation`), or leave"
                             f" `staleness_correction_lambda` at its default {DEFAULT_STALENESS_LAMBDA}.")
        object.__setattr__(self, "staleness_correction_lambda", float(lam))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The fields, in declaration order (the keys of ``conf/strategy/roundpipe.yaml`` besides ``_target_``)."""
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (stages as ``[start, stop]`` lists), e.g. for logged hyperparameters."""
        out = asdict(self)  # data_parallel becomes a dict of its fields
        for key in ("forward_stages", "backward_stages"):
            if out[key] is not None:
                out[key] = [[r.start, r.stop] for r in out[key]]
        return out
