"""The memory model against the ledger (issue 30): per configuration, the predicted per-device peak
(:func:`lightning_roundpipe.runtime.tuning.device_memory.predicted_peaks`, the one memory model of
:mod:`lightning_roundpipe.partition.memory`) beside the peak the CPU virtual devices' memory ledger measured
(every device allocation while alive, :mod:`lightning_roundpipe.runtime.backends.budget`), on tiny models.

Run from the repository root (CPU only, about a minute)::

    PYTHONPATH=$PWD python benchmarks/memory_model.py

Prints one row per configuration and device: config, device, predicted bytes, measured bytes, ratio.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
os.environ.setdefault("LIGHTNING_ROUNDPIPE_MEASURE_DEVICE_MEMORY", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402

import lightning_roundpipe  # noqa: E402
from _helpers import CausalLMModule, TokenData, VectorData, loader, tiny_hf, trainer  # noqa: E402
from lightning_roundpipe.partition.memory import overlap_banks  # noqa: E402
from lightning_roundpipe.runtime.tuning.device_memory import predicted_peaks  # noqa: E402

BATCH, MICROBATCHES = 7, 3  # rows per microbatch: 3, 2, 2


def _lora() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_hf("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       lora_dropout=0.0, init_lora_weights="gaussian"))


def _qlora(**quantization) -> Callable[[], torch.nn.Module]:
    """A tiny Llama saved and loaded back as users load QLoRA bases (``BitsAndBytesConfig(**quantization)``,
    fp32 compute), with the LoRA of :func:`_lora`, in train mode."""

    def make() -> torch.nn.Module:
        import tempfile

        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        with tempfile.TemporaryDirectory() as folder:
            tiny_hf("llama").save_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu",
                                                         quantization_config=BitsAndBytesConfig(**quantization))
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0, init_lora_weights="gaussian"))
        return model.train()

    return make


class SequentialMLPModule(L.LightningModule):
    """An ``nn.Sequential`` MLP (7 layers: 8 -> 128 -> 128 -> 128 -> 4, Tanh, ReLU, GELU between) with the
    loss outside the sequence (``cross_entropy(self.model(x), y)``): a forward program, then a backward
    program whose first stage receives the logits' gradient. Its activations come from a shape-only pass
    (the cost model knows Hugging Face models only)."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@dataclass
class Config:
    name: str
    model: Callable[[], torch.nn.Module] | None = None
    strategy: dict = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)
    module: Callable[[], L.LightningModule] | None = None  # instead of ``CausalLMModule(model())`` on tokens


CONFIGS = [
    Config("sync, full FT, fp32", lambda: tiny_hf("llama")),
    Config("sync, full FT, bf16-mixed", lambda: tiny_hf("llama"), trainer=dict(precision="bf16-mixed")),
    Config("accumulation (2 banks)", lambda: tiny_hf("llama"), trainer=dict(accumulate_grad_batches=2)),
    Config("async (2 banks)", lambda: tiny_hf("llama"), strategy=dict(optimizer="async")),
    Config("LoRA, bf16-mixed", _lora, trainer=dict(precision="bf16-mixed")),
    Config("LoRA, fp8 base, bf16-mixed", _lora, strategy=dict(frozen_weights="fp8"), trainer=dict(precision="bf16-mixed")),
    Config("LoRA, nf4 base, bf16-mixed", _lora, strategy=dict(frozen_weights="nf4"), trainer=dict(precision="bf16-mixed")),
    Config("QLoRA loaded in 4 bits (nf4, double quant)",
           _qlora(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                  bnb_4bit_compute_dtype=torch.float32)),
    Config("loaded in 8 bits", _qlora(load_in_8bit=True)),
    Config("mixed devices (weighted, speeds 1, 0.5)", lambda: tiny_hf("llama"),
           strategy=dict(cpu_device_speeds=(1.0, 0.5), dispatch="weighted")),
    Config("nn.Sequential MLP, sync", module=SequentialMLPModule),
    Config("nn.Sequential MLP, async", module=SequentialMLPModule, strategy=dict(optimizer="async")),
    Config("nn.Sequential MLP, accumulation", module=SequentialMLPModule,
           trainer=dict(accumulate_grad_batches=2)),
]


class _Measure(L.Callback):
    """Predicts every program the executor starts, when it starts (the plan may change between steps: the
    weighted dispatch re-plans once it has measured the devices' speeds; the weight store still holds the
    fp8 blocks then), and reads the ledger's peaks at the end."""

    def __init__(self, banks: int, compute_bytes: int) -> None:
        self.banks, self.compute_bytes = banks, compute_bytes
        self.engine = None
        self.predicted: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        engine = self.engine = trainer.strategy.engine
        self.predicted = [0] * len(engine.backends)
        for backend in engine.backends:
            backend.memory.pop_peak()
        start = engine.executor.start

        def predicting_start(program, state):
            run = start(program, state)  # its check records the call's shape (the microbatch's packed bytes)
            # the banks the executor holds (one where it fell back, or where nothing overlaps: a loss outside
            # the sequence runs a forward and a backward program one after the other)
            banks = min(self.banks, len(engine.backends[0].banks))
            rows, seq_len, _, batch_bytes = engine.memory_shape  # the training call's, as the check's
            peaks = predicted_peaks(engine.seq, engine.store, program, rows=rows, seq_len=seq_len, banks=banks,
                                    compute_bytes=self.compute_bytes, batch_bytes=batch_bytes,
                                    sample=engine.memory_sample)
            self.predicted = [max(a, peak.peak_bytes) for a, peak in zip(self.predicted, peaks)]
            return run

        engine.executor.start = predicting_start

    def on_train_end(self, trainer, pl_module) -> None:
        self.peaks = [backend.memory.peak_bytes for backend in self.engine.backends]
        del self.engine.executor.start


def measure(config: Config, devices: int = 2, steps: int = 3) -> list[tuple[int, int, int]]:
    """``(device_index, predicted, measured)`` per device for ``config``."""
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=MICROBATCHES, partition="default",
                                                     **config.strategy)
    banks = overlap_banks(strategy.config.optimizer, config.trainer.get("accumulate_grad_batches", 1),
                          strategy.config.overlap_batches)
    watch = _Measure(banks, 2 if config.trainer.get("precision") == "bf16-mixed" else 4)
    module, data = (config.module(), VectorData()) if config.module else (CausalLMModule(config.model()), TokenData())
    trainer(strategy, devices, max_steps=steps, callbacks=[watch], **config.trainer).fit(module, loader(data, BATCH))
    return [(device, watch.predicted[device], measured) for device, measured in enumerate(watch.peaks)]


def main() -> None:
    warnings.filterwarnings("ignore")
    rows = []
    for config in CONFIGS:
        for device, predicted, measured in measure(config):
            rows.append((config.name, device, predicted, measured, predicted / measured))
    print(f"| {'config':<40} | device | predicted (bytes) | measured (bytes) | predicted / measured |")
    print(f"|{'-' * 42}|--------|-------------------|------------------|----------------------|")
    for name, device, predicted, measured, ratio in rows:
        print(f"| {name:<40} | {device:>6} | {predicted:>17} | {measured:>16} | {ratio:>20.3f} |")


if __name__ == "__main__":
    main()
