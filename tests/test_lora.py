"""PEFT LoRA: only adapter weights change, the frozen base is bitwise unchanged, parity holds."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, fit_params, loader, max_diff, params, tiny_hf, trainer


def _lora_module():
    model = get_peft_model(tiny_hf("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        lora_dropout=0.0, init_lora_weights="gaussian"))
    return CausalLMModule(model, lr=0.5)


@pytest.mark.parametrize("devices,num_microbatches", [(1, 2), (2, 5), (3, 3)])
def test_lora_parity_and_frozen_base(devices, num_microbatches):
    before = params(_lora_module())
    ref = fit_params(_lora_module, TokenData(), max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
    got = fit_params(_lora_module, TokenData(), strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=num_microbatches),
                     devices=devices, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5)
    assert max_diff(ref, got) <= 1e-5
    lora = [k for k in got if "lora_" in k]
    base = [k for k in got if "lora_" not in k]
    assert lora and base
    assert all((got[k] == before[k]).all() for k in base)  # frozen base bitwise unchanged
    assert all(not (got[k] == before[k]).all() for k in lora)  # every adapter trained


def _upload_bytes(layers) -> int:
    """Formula: one upload of a stage under bf16-mixed: every floating-point parameter in bf16 (2 bytes,
    frozen or trainable), buffers in their own dtype, each tensor padded to 16 bytes; tied tensors once."""
    seen, total = set(), 0
    for layer in layers:
        tensors = [(p, True) for p in layer.parameters()]
        tensors += [(b, False) for b in layer.buffers()]
        for t, is_param in tensors:
            if id(t) in seen:
                continue
            seen.add(id(t))
            nbytes = t.numel() * (2 if is_param and t.is_floating_point() else t.element_size())
            total += -(-nbytes // 16) * 16
    return total


def test_lora_bf16_mixed_frozen_base_holds_only_its_bf16_copy():
    """Under bf16-mixed the frozen base is bf16 on the host during fit (2 bytes per parameter: no fp32
    master, no shadow, no gradient, no optimizer state), no gradient of it moves D2H, the weight H2D
    of a step is the bf16 size of its stages (a formula), and after fit the base is fp32 again with
    its bf16-rounded values (the values the pipeline computed with)."""
    from lightning_roundpipe.runtime.memory import host_memory

    def make():
        return CausalLMModule(get_peft_model(tiny_hf("llama"), LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights="gaussian")),
            lr=1e-2, optimizer="adamw")

    seen: list[dict] = []

    class Spy(lightning_roundpipe.RoundPipeMetricsCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            engine = trainer.strategy.engine
            named = dict(pl_module.named_parameters())
            frozen = {n: p for n, p in named.items() if not p.requires_grad}
            trainable = {n: p for n, p in named.items() if p.requires_grad}
            programs, timelines = list(engine._step_programs), list(engine._timelines)
            # counted before the parent pops the gradient-buffer peak: the parent logs the same figure
            memory = host_memory(engine.store, trainer.optimizers, engine.executor.peak_grad_bytes)
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            layers = engine.seq.layers
            stages = [s for program in programs for s in program.plan.stages]
            seen.append(dict(
                frozen_dtypes={p.dtype for p in frozen.values()}, frozen_grads=[n for n, p in frozen.items() if p.grad is not None],
                trainable_dtypes={p.dtype for p in trainable.values()},
                frozen_separate_shadow=[n for n, p in frozen.items()
                                        if engine.store.tensors[id(p)].shadow.data_ptr() != p.data_ptr()],
                h2d_weights=sum(i.nbytes for tl in timelines for i in tl.intervals if i.stream == "weights"),
                h2d_formula=sum(_upload_bytes([layers[i] for i in s.layers]) for s in stages),
                wd2h=sum(i.nbytes for tl in timelines for i in tl.intervals if "WD2H" in i.label),
                wd2h_formula=sum(4 * p.numel() for s in stages if s.kind == "backward" for i in s.layers
                                 for p in layers[i].parameters() if p.requires_grad),
                memory=memory, logged=float(trainer.callback_metrics["roundpipe/host_memory(GiB)"]),
                trainable_numel=sum(p.numel() for p in trainable.values()), trainable_tensors=len(trainable)))

    module = make()
    before = params(module)
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default")
    trainer(strategy, devices=2, max_steps=2, precision="bf16-mixed", callbacks=[Spy()]).fit(module, loader(TokenData()))
    assert len(seen) == 2
    for step in seen:
        assert step["frozen_dtypes"] == {torch.bfloat16} and step["trainable_dtypes"] == {torch.float32}
        assert step["frozen_grads"] == [] and step["frozen_separate_shadow"] == []
        assert step["h2d_weights"] == step["h2d_formula"] > 0
        assert step["wd2h"] == step["wd2h_formula"] > 0  # fp32 gradients of the adapters only
        memory = step["memory"]
        assert memory.frozen.per_param() == {"master": 2.0, "shadow": 0.0, "grad": 0.0, "grad_buffer": 0.0,
                                             "optimizer": 0.0, "total": 2.0}
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
    assert all(torch.equal(after[k], before[k].bfloat16().float()) for k in base)
    assert all(not torch.equal(after[k], before[k]) for k in after if "lora_" in k)
