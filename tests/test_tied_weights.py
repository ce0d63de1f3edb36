"""A weight tied between the embedding and the LM head in the stage tables (`describe_stages`).

Each stage uploads the weights of its layers once: a stage holding both the embedding and the LM
head (the whole model as one fused stage) uploads the tied weight once, and a stage table row must
say so. Two stages that each hold one end both upload it, so their rows both count it. The oracle
is the model's own distinct tensors, never the code under test.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from _helpers import tiny_hf
from lightning_roundpipe.adapters import make_layer_sequence
from lightning_roundpipe.cli import plan_cmd
from lightning_roundpipe.partition import LayerProfile, PartitionPlan, describe_stages, preset_hf_config
from lightning_roundpipe.runtime.host.store import WeightStore


def matmul_weights(modules) -> set[int]:
    """``id`` of the parameters that only ``nn.Linear`` modules register, as their ``weight``: the
    operands autocast casts to its dtype anyway (DESIGN.md section 5), uploaded in the compute dtype
    under mixed precision. A weight tied to an ``nn.Embedding`` is not one (the embedding reads fp32)."""
    linear, other = set(), set()
    for m in modules:
        for module in m.modules():
            for name, p in module.named_parameters(recurse=False):
                (linear if isinstance(module, nn.Linear) and name == "weight" else other).add(id(p))
    return linear - other


def distinct_bytes(modules, dtype_bytes: int | None = None, half: set[int] = frozenset()) -> tuple[int, int]:
    """``(weights, gradients)`` bytes of the distinct parameters and buffers of ``modules``: each tensor
    once, the matmul weights ``half`` (of the whole model) at ``dtype_bytes`` each when given (the upload
    dtype of mixed precision), everything else in its own dtype."""
    params = {id(p): p for m in modules for p in m.parameters()}
    buffers = {id(b): b for m in modules for b in m.buffers()}
    half = half if dtype_bytes else set()
    size = {k: p.numel() * (dtype_bytes if k in half else p.element_size()) for k, p in params.items()}
    grads = sum(p.numel() * 4 for k, p in params.items() if p.requires_grad)  # fp32 gradient download
    return sum(size.values()) + sum(b.numel() * b.element_size() for b in buffers.values()), grads


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_stage_rows_count_a_tied_weight_once_per_stage(compute_dtype):
    model = tiny_hf(layers=5)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    seq = make_layer_sequence(model)
    L = len(seq)
    dtype_bytes = None if compute_dtype is None else torch.finfo(compute_dtype).bits // 8
    # no padding to account for: every tensor is a multiple of the store's 16-byte alignment
    assert all(p.numel() * (dtype_bytes or 4) % 16 == 0 for p in model.parameters())
    store = WeightStore(seq.layers, compute_dtype=compute_dtype)
    # the profiles as the engine builds them: one upload of each single layer
    profiles = [LayerProfile(forward_s=1e-3, backward_s=2e-3, param_bytes=store.stage_bytes(range(i, i + 1)),
                             activation_bytes=0, trainable_param_bytes=store.stage_grad_bytes(range(i, i + 1)))
                for i in range(L)]
    shared = store.shared_weights()
    # the tied embedding / LM head, and the rotary buffers every decoder layer holds to rebuild the
    # rotary tables on its stage's device (they are not carried across stage boundaries)
    rotary_buffers = len(list(model.model.rotary_emb.buffers()))
    assert rotary_buffers >= 1
    assert [w.layers for w in shared] == [(0, L - 1)] + [tuple(range(1, L - 1))] * rotary_buffers

    whole = range(0, L)
    (stage,) = describe_stages(PartitionPlan((whole,), (whole,)), profiles, shared_weights=shared)
    half = matmul_weights([model])
    assert id(model.lm_head.weight) not in half and id(model.model.layers[0].mlp.up_proj.weight) in half
    weights, grads = distinct_bytes([model], dtype_bytes, half)
    assert stage.param_bytes == weights == store.stage_bytes(whole)
    assert stage.grad_bytes == grads == store.stage_grad_bytes(whole)

    plan = PartitionPlan((range(0, 2), range(2, 5), range(5, L)), (range(5, L), range(2, 5), range(0, 2)))
    stages = describe_stages(plan, profiles, shared_weights=shared)
    for s in stages:
        w, g = distinct_bytes([seq.layers[i] for i in s.layers], dtype_bytes, half)
        assert s.param_bytes == w == store.stage_bytes(s.layers), s
        assert s.grad_bytes == (0 if s.kind == "forward" else g), s
    # the forward rows tile the layers once, yet add up to more than the model: the embedding stage
    # and the LM head stage both upload the tied weight (what a sum of the column shows), and every
    # stage with a decoder layer uploads the rotary buffers
    tied = model.lm_head.weight.numel() * 4  # fp32 also under mixed precision: the embedding reads it
    rotary = sum(b.numel() * b.element_size() for b in model.model.rotary_emb.buffers())
    forward = [s for s in stages if s.kind != "backward"]
    with_decoder = sum(1 for s in forward if any(1 <= i <= L - 2 for i in s.layers))
    assert sum(s.param_bytes for s in forward) == weights + tied + rotary * (with_decoder - 1)


def test_plan_one_stage_counts_the_tied_embedding_once():
    """`roundpipe plan` on one device puts Qwen3-1.7B (tied embeddings) in one fused stage: its row's
    weights are the model's distinct weights (the real model class, built on the meta device)."""
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser()
    plan_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--preset", "qwen3-1.7b", "--devices", "1", "--seq-len", "256",
                              "--microbatch-size", "1"])
    report = plan_cmd.make_report(args)
    (stage,) = report.stages
    cfg = preset_hf_config("qwen3-1.7b")
    assert cfg.tie_word_embeddings
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    distinct = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert stage.param_bytes == distinct * args.dtype_bytes
    assert stage.grad_bytes == distinct * args.dtype_bytes


def test_engine_recut_table_row_is_what_the_stage_uploads(monkeypatch):
    """The table the engine prints when the automatic partition re-cuts the stages: the whole model as
    one fused stage (what it picks on CPU virtual devices) shows the model's distinct bytes."""
    import re

    from lightning_roundpipe.runtime.execution import engine as engine_module
    from lightning_roundpipe.runtime.tuning.autopartition import PlanChoice

    model = tiny_hf(layers=5)
    seq = make_layer_sequence(model)
    L = len(seq)
    eng = engine_module.RoundPipeEngine(seq, [torch.device("cpu")] * 2, 3, auto_partition_after_steps=2)
    try:
        lines: list[str] = []
        eng.info = lines.append

        class Measured:  # the profiler after its steps: every layer timed
            enabled = ready = True
            steps_seen, skip_steps = 2, 0

            def end_step(self):
                pass

            def profiles(self, param_bytes, grad_bytes, names=None):
                return [LayerProfile(forward_s=1e-3, backward_s=2e-3, param_bytes=p, activation_bytes=0,
                                     trainable_param_bytes=g) for p, g in zip(param_bytes, grad_bytes)]

        eng.executor.profiler = Measured()
        whole = range(0, L)
        monkeypatch.setattr(engine_module, "choose_partition",
                            lambda engine, profiles: PlanChoice(PartitionPlan((whole,), (whole,), 1e-3), None))
        assert eng.end_step() is not None
        (row,) = [line for line in lines[-1].splitlines() if line.lstrip().startswith("stage")]
        weights, _ = distinct_bytes([model])
        assert re.search(r"params\s+([\d.]+) MiB", row).group(1) == f"{weights / 2**20:.2f}"
    finally:
        eng.close()
