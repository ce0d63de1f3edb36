"""PEFT LoRA: only adapter weights change, the frozen base is bitwise unchanged, parity holds."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

import lightning_roundpipe
from _helpers import (CausalLMModule, TokenData, fit_params, jitter_seeds, loader, max_diff, params, tiny_hf, trainer,
                      use_jitter)


def _lora_module():
    model = get_peft_model(tiny_hf("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        lora_dropout=0.0, init_lora_weights="gaussian"))
    return CausalLMModule(model, lr=0.5)


@pytest.mark.parametrize("devices,num_microbatches,jitter_seed", [
    (1, 2, None), (2, 5, None), (3, 3, None),
    *(pytest.param(2, 3, *seed.values, marks=seed.marks) if hasattr(seed, "values") else (2, 3, seed)
      for seed in jitter_seeds(1))])
def test_lora_parity_and_frozen_base(devices, num_microbatches, jitter_seed, monkeypatch):
    """Accumulation overlaps the batches of a step; also under schedule jitter (``jitter_seed``)."""
    before = params(_lora_module())
    ref = fit_params(_lora_module, TokenData(), max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
    use_jitter(monkeypatch, jitter_seed)
    got = fit_params(_lora_module, TokenData(), strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=num_microbatches),
                     devices=devices, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
    assert max_diff(ref, got) <= 1e-5
    lora = [k for k in got if "lora_" in k]
    base = [k for k in got if "lora_" not in k]
    assert lora and base
    assert all((got[k] == before[k]).all() for k in base)  # frozen base bitwise unchanged
    assert all(not (got[k] == before[k]).all() for k in lora)  # every adapter trained


def _matmul_weights(layers) -> set[int]:
    """``id`` of the parameters only ``nn.Linear`` modules register, as their ``weight`` (PEFT's base
    linears and LoRA A/B): what autocast casts anyway, uploaded in bf16 under bf16-mixed."""
    linear, other = set(), set()
    for layer in layers:
        for module in layer.modules():
            for name, p in module.named_parameters(recurse=False):
                (linear if isinstance(module, torch.nn.Linear) and name == "weight" else other).add(id(p))
    return linear - other


def _upload_bytes(layers, matmul: set[int]) -> int:
    """Formula: one upload of a stage under bf16-mixed (DESIGN.md section 5): the matmul weights in
    bf16 (2 bytes, frozen or trainable), every other parameter (norms, the tied embedding) and the
    buffers in their own dtype (fp32), each tensor padded to 16 bytes; tied tensors once."""
    seen, total = set(), 0
    for layer in layers:
        for t in [*layer.parameters(), *layer.buffers()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            nbytes = t.numel() * (2 if id(t) in matmul else t.element_size())
            total += -(-nbytes // 16) * 16
    return total


def test_lora_bf16_mixed_frozen_base_holds_only_its_bf16_copy():
    """Under bf16-mixed the frozen base linears are bf16 on the host during fit (2 bytes per parameter:
    no fp32 master, no shadow, no gradient, no optimizer state), the frozen norms and the tied
    embedding stay fp32 (what Lightning's autocast reads), no gradient of the base moves D2H, the
    weight H2D of a step is the size of its stages (a formula: matmul weights bf16, the rest fp32),
    and after fit the base is fp32 again: the linears with their bf16-rounded values (the values the
    pipeline computed with), the norms and the embedding bitwise unchanged."""
    from lightning_roundpipe.runtime.host.memory import host_memory

    def make():
        return CausalLMModule(get_peft_model(tiny_hf("llama"), LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights="gaussian")),
            lr=1e-2, optimizer="adamw")

    seen: list[dict] = []

    class Spy(lightning_roundpipe.RoundPipeMetricsCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            engine = trainer.strategy.engine
            named = dict(pl_module.named_parameters())
            matmul = _matmul_weights(engine.seq.layers)
            frozen = {n: p for n, p in named.items() if not p.requires_grad}
            trainable = {n: p for n, p in named.items() if p.requires_grad}
            programs, timelines = list(engine._step_programs), list(engine._timelines)
            # counted before the parent pops the gradient-buffer peak: the parent logs the same figure
            memory = host_memory(engine.store, trainer.optimizers, engine.executor.peak_grad_bytes)
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            layers = engine.seq.layers
            stages = [s for program in programs for s in program.plan.stages]
            seen.append(dict(
                frozen_dtypes={n: p.dtype for n, p in frozen.items()},
                frozen_matmul={n for n, p in frozen.items() if id(p) in matmul},
                frozen_grads=[n for n, p in frozen.items() if p.grad is not None],
                trainable_dtypes={p.dtype for p in trainable.values()},
                frozen_separate_shadow=[n for n, p in frozen.items()
                                        if engine.store.tensors[id(p)].shadow.data_ptr() != p.data_ptr()],
                h2d_weights=sum(i.nbytes for tl in timelines for i in tl.intervals if i.stream == "weights"),
                h2d_formula=sum(_upload_bytes([layers[i] for i in s.layers], matmul) for s in stages),
                wd2h=sum(i.nbytes for tl in timelines for i in tl.intervals if "WD2H" in i.label),
                wd2h_formula=sum(4 * p.numel() for s in stages if s.kind == "backward" for i in s.layers
                                 for p in layers[i].parameters() if p.requires_grad),
                memory=memory, logged=float(self.last_metrics["roundpipe/host_memory(GiB)"]),
                trainable_numel=sum(p.numel() for p in trainable.values()), trainable_tensors=len(trainable),
                frozen_matmul_numel=sum(p.numel() for p in frozen.values() if id(p) in matmul)))

    module = make()
    before = params(module)
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default")
    trainer(strategy, devices=2, max_steps=2, precision="bf16-mixed", callbacks=[Spy()]).fit(module, loader(TokenData()))
    assert len(seen) == 2
    for step in seen:
        frozen_matmul = step["frozen_matmul"]
        assert {n for n in frozen_matmul if "lm_head" in n or "embed" in n} == set()  # tied: not a matmul weight
        assert frozen_matmul and len(frozen_matmul) < len(step["frozen_dtypes"])  # the norms and embedding are not
        assert step["frozen_dtypes"] == {n: torch.bfloat16 if n in frozen_matmul else torch.float32
                                         for n in step["frozen_dtypes"]}
        assert step["trainable_dtypes"] == {torch.float32}
        assert step["frozen_grads"] == [] and step["frozen_separate_shadow"] == []
        assert step["h2d_weights"] == step["h2d_formula"] > 0
        assert step["wd2h"] == step["wd2h_formula"] > 0  # fp32 gradients of the adapters only
        memory = step["memory"]
        frozen_bytes = 2 * step["frozen_matmul_numel"] + 4 * (memory.frozen.num_params - step["frozen_matmul_numel"])
        assert 2.0 < memory.frozen.per_param()["master"] < 4.0
        assert memory.frozen.per_param() == {"master": frozen_bytes / memory.frozen.num_params, "shadow": 0.0,
                                             "grad": 0.0, "grad_buffer": 0.0, "optimizer": 0.0,
                                             "total": frozen_bytes / memory.frozen.num_params}
        per_trainable = memory.trainable.per_param()
        n, k = step["trainable_numel"], step["trainable_tensors"]
        assert (per_trainable["master"], per_trainable["shadow"], per_trainable["grad"]) == (4.0, 2.0, 4.0)
        assert memory.trainable.optimizer_bytes == 8 * n + 4 * k  # AdamW: two fp32 moments, one fp32 step per tensor
        # peak gradient memory: every fp32 gradient once (the fused path's host buffers become the `.grad`),
        # plus, from the second step on, the last step's `.grad` (Lightning zeroes it after `training_step`,
        # whose forward call runs the fused pipeline)
        assert memory.trainable.grad_bytes + memory.trainable.grad_buffer_bytes == 4 * n * (1 if step is seen[0] else 2)
        assert step["logged"] == pytest.approx(memory.total_bytes / 2**30, rel=1e-6)
    after = params(module)
    base = [k for k in after if "lora_" not in k]
    assert all(after[k].dtype == torch.float32 for k in after)
    base_linear = [k for k in base if k.endswith("proj.weight") or k.endswith("base_layer.weight")]
    assert base_linear and len(base_linear) < len(base)
    assert all(torch.equal(after[k], before[k].bfloat16().float()) for k in base_linear)
    assert all(torch.equal(after[k], before[k]) for k in base if k not in base_linear)  # norms, embedding: exact
    assert all(not torch.equal(after[k], before[k]) for k in after if "lora_" in k)
