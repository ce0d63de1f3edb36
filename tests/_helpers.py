"""Tiny models, LightningModules and a `fit` helper shared by the tests.

This module never imports `lightning_roundpipe`, so a checkpoint can be loaded with it in a process
where the package was never imported.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB = 512
SEQ = 8

#: Schedule jitter (DESIGN.md section 4 (d), ``runtime/execution/jitter.py``): the seeds the overlap,
#: async, accumulation and dropout tests run under in the default run, and the further seeds of the
#: slow run (``pytest -m slow``).
JITTER_ENV = "LIGHTNING_ROUNDPIPE_JITTER_SEED"
JITTER_SEEDS = (0, 1)
SLOW_JITTER_SEEDS = (2, 3, 4, 5)


def jitter_seeds(default: int = len(JITTER_SEEDS)) -> list:
    """``pytest.mark.parametrize`` values: the first ``default`` of :data:`JITTER_SEEDS` in the default
    run, the rest of them and :data:`SLOW_JITTER_SEEDS` marked ``slow``."""
    import pytest

    rest = JITTER_SEEDS[default:] + SLOW_JITTER_SEEDS
    return [*JITTER_SEEDS[:default], *(pytest.param(seed, marks=pytest.mark.slow) for seed in rest)]


def use_jitter(monkeypatch: Any, seed: int | None) -> None:
    """Turn schedule jitter on with ``seed`` for the rest of the test (``None``: leave it off)."""
    if seed is not None:
        monkeypatch.setenv(JITTER_ENV, str(seed))


def tiny_hf(kind: str = "llama", dropout: float = 0.0, layers: int = 5, seed: int = 0) -> nn.Module:
    """A tiny random Llama or Qwen3 causal LM (fp32, tied embeddings, eager attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=True, attention_dropout=dropout)
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = LlamaConfig(**common)
        cfg._attn_implementation = "eager"
        return LlamaForCausalLM(cfg)
    if kind == "qwen3":
        cfg = Qwen3Config(head_dim=8, **common)
        cfg._attn_implementation = "eager"
        return Qwen3ForCausalLM(cfg)
    raise ValueError(kind)


def tiny_mlp(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)]
    return nn.Sequential(*layers)


class TokenData(Dataset):
    """Random tokens with right padding on some rows (labels -100 there): unequal label counts."""

    def __init__(self, n: int = 64, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.mask = torch.ones(n, SEQ, dtype=torch.long)
        for i in range(n):
            pad = int(torch.randint(0, 4, (1,), generator=g))
            if pad:
                self.mask[i, SEQ - pad:] = 0
        self.labels = self.ids.masked_fill(self.mask == 0, -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class VectorData(Dataset):
    def __init__(self, n: int = 64, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class CausalLMModule(L.LightningModule):
    """``loss = self.model(**batch).loss``, written as for one device."""

    def __init__(self, model: nn.Module, lr: float = 0.1, optimizer: str = "sgd") -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.optimizer = optimizer

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val/loss", self.model(**batch).loss)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)


class MLPModule(L.LightningModule):
    """``logits = self.model(x); loss = F.cross_entropy(logits, y)``."""

    def __init__(self, dropout: float = 0.0, seed: int = 0, lr: float = 0.1, scheduler: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = tiny_mlp(seed, dropout)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.cross_entropy(self.model(x), y))

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        if not self.hparams.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return [opt], [sched]


def loader(ds: Dataset, batch_size: int = 7) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, shuffle=False)


_SCRATCH: list[str] = []


def scratch_dir() -> str:
    """A temporary folder of this test process: the default ``default_root_dir`` of :func:`trainer`,
    so what a Trainer without logger writes (RoundPipe's step traces) stays out of the repository."""
    if not _SCRATCH:
        import tempfile

        _SCRATCH.append(tempfile.mkdtemp(prefix="roundpipe-tests-"))
    return _SCRATCH[0]


def trainer(strategy: Any = "auto", devices: int = 1, **kw) -> L.Trainer:
    args = dict(accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                default_root_dir=scratch_dir())
    args.update(kw)
    return L.Trainer(**args)


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def fit_params(make: Callable[[], L.LightningModule], data: Dataset, strategy: Any = "auto", devices: int = 1,
               batch_size: int = 7, **kw) -> dict[str, torch.Tensor]:
    module = make()
    t = trainer(strategy, devices, **kw)
    t.fit(module, loader(data, batch_size))
    return params(module)


class SigintAfter(L.Callback):
    """Sends this process a real SIGINT (as Ctrl+C does; or ``signal_name="SIGTERM"``, as SLURM and
    ``timeout`` send) after ``steps`` optimizer steps of ``fit``, from inside ``on_train_batch_end``, and
    waits there until the handler has run: for SIGINT, Python's handler raises ``KeyboardInterrupt``
    in this (the main) thread, which ends the wait; for SIGTERM, Lightning's handler sets
    ``trainer.received_sigterm`` and Lightning raises at the end of the same batch. So the interrupt
    lands at step ``steps`` however loaded the machine is, not whenever the signal gets handled.

    Raises:
        RuntimeError: in the hook, if this process ignores the signal (a SIGINT ignored since the
            process started: the shell's ``&`` or ``nohup``; the test must start the job with SIGINT at
            its default), or if the handler has not run ``timeout_s`` seconds after the signal (a
            safeguard against a hang, not a timing condition).
    """

    def __init__(self, steps: int, signal_name: str = "SIGINT", timeout_s: float = 120.0) -> None:
        if signal_name not in ("SIGINT", "SIGTERM"):
            raise ValueError(f"`signal_name={signal_name!r}`: SIGINT or SIGTERM")
        self.steps = steps
        self.signal_name = signal_name
        self.timeout_s = timeout_s
        self.sent = False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step < self.steps or self.sent:
            return
        import os
        import signal
        import time

        signum = getattr(signal, self.signal_name)
        if signal.getsignal(signum) is signal.SIG_IGN:
            raise RuntimeError(f"this process ignores {self.signal_name} (inherited, e.g. from `nohup` or `&`):"
                               " start it with the signal at its default")
        self.sent = True
        os.kill(os.getpid(), signum)
        deadline = time.monotonic() + self.timeout_s
        while not (signum == signal.SIGTERM and trainer.received_sigterm):  # a SIGINT raises in here
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.signal_name} sent at step {trainer.global_step}; its handler had not run"
                                   f" {self.timeout_s} s later")
            time.sleep(0.001)


def hold_devices_until_issued(executor: Any, on_issued: Callable[[Any], None]) -> tuple[threading.Thread, threading.Event]:
    """Pause every device of ``executor`` until the host has issued the whole of the next program run
    (every op's ``issued`` flag set, a state, not a time), call ``on_issued(run)`` then, and let the
    devices go (also when the returned event is set first). Returns the watcher thread and that event."""
    before = executor.current_run
    for backend in executor.backends:
        backend.pause()
    done = threading.Event()

    def watch() -> None:
        try:
            while not done.wait(0.01):
                run = executor.current_run
                if run is not None and run is not before and all(f.is_set() for f in run.issued.values()):
                    on_issued(run)
                    return
        finally:
            for backend in executor.backends:
                backend.resume()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher, done


def tiny_family_model(kind: str, attention: str = "sdpa", use_cache: bool = True, layers: int = 4) -> nn.Module:
    """A tiny random causal LM of the Hugging Face family ``kind`` (fp32), with ``attention`` as its attention
    implementation (Gemma 2 and GPT-OSS: eager, they have no sdpa path); configs that switch each family's
    peculiarity on (soft-capping, sliding windows, the multipliers, experts) at values where it changes the outputs."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=use_cache)
    sliding = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
    gemma = dict(head_dim=8, sliding_window=4, final_logit_softcapping=0.1, attn_logit_softcapping=0.05,
                 layer_types=sliding)
    configs = {
        "llama": lambda: tf.LlamaConfig(**common),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(head_dim=8, **common),
        "mistral": lambda: tf.MistralConfig(sliding_window=4, **common),
        "gemma2": lambda: tf.Gemma2Config(**gemma, **common),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**gemma, **common),
        "phi3": lambda: tf.Phi3Config(sliding_window=4, pad_token_id=0, eos_token_id=1, bos_token_id=1, **common),
        "olmo2": lambda: tf.Olmo2Config(eos_token_id=1, pad_token_id=0, **common),
        "granite": lambda: tf.GraniteConfig(embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=3.0,
                                            attention_multiplier=0.3, **common),
        "olmo": lambda: tf.OlmoConfig(eos_token_id=1, pad_token_id=0, **common),  # the generic entry
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                               mlp_only_layers=[1], norm_topk_prob=True, head_dim=8,
                                               output_router_logits=True, router_aux_loss_coef=0.1, **common),
        "gpt_oss": lambda: tf.GptOssConfig(**{**common, "intermediate_size": 16}, num_local_experts=8,
                                           num_experts_per_tok=2, sliding_window=4, head_dim=8,
                                           output_router_logits=True, router_aux_loss_coef=0.1,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    }
    cfg = configs[kind]()
    cfg._attn_implementation = "eager" if kind in ("gemma2", "gpt_oss") else attention  # no sdpa path
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg)
