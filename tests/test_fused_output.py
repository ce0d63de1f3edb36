"""The fused path, visible and safe (issue 8 item 4).

- A plain script (no Hydra, default verbosity, a subprocess) shows the RoundPipe announcement (model,
  layers, devices, microbatches, stage table) once, and the fused-path warning once.
- `.logits` of a fused-path training output raises an error that explains and names
  `RoundPipeStrategy(fused_loss=False)`; `loss`, `keys()`, `to_tuple()`, pickling, Lightning's
  collection helpers and returning the output from `training_step` do not trip it.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lightning_utilities.core.apply_func import apply_to_collection

import lightning_roundpipe
from _helpers import CausalLMModule, TokenData, fit_params, loader, max_diff, tiny_hf, trainer

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import lightning as L
    import lightning_roundpipe
    from _helpers import CausalLMModule, TokenData, loader, tiny_hf

    trainer = L.Trainer(strategy="roundpipe", accelerator="cpu", devices=2, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = CausalLMModule(tiny_hf("llama"))
    trainer.validate(module, loader(TokenData(n=7)), verbose=False)
    trainer.fit(module, loader(TokenData()))
    print("DONE")
""")


CLI_SCRIPT = textwrap.dedent("""
    from lightning.pytorch.cli import LightningCLI
    import lightning_roundpipe  # registers strategy="roundpipe"
    from _helpers import CausalLMModule, TokenData, loader, tiny_hf

    class Module(CausalLMModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__(tiny_hf("llama"), lr=lr)

        def train_dataloader(self):
            return loader(TokenData())

        def val_dataloader(self):
            return loader(TokenData(n=7))

    LightningCLI(Module, args=["fit", "--trainer.strategy=roundpipe", "--trainer.accelerator=cpu", "--trainer.devices=2",
                               "--trainer.max_steps=2", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
                               "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
                               "--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=1"])
    print("DONE")
""")


@pytest.mark.parametrize("kind", ["plain", "lightning_cli"])
def test_script_shows_the_announcement_and_the_fused_warning_once(kind: str, tmp_path: Path) -> None:
    """Default verbosity, no Hydra: a plain script (validate, then fit) and a LightningCLI script."""
    if kind == "lightning_cli":
        pytest.importorskip("jsonargparse")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT if kind == "plain" else CLI_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), "WANDB_MODE": "disabled"}
    env.pop("PYTHONWARNINGS", None)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    text = out.stdout + out.stderr
    assert "DONE" in out.stdout
    # validate, then fit: the same plan is announced once
    assert text.count("RoundPipe: pipelining `LlamaForCausalLM` (llama, 5 decoder layers + prefix and tail: 7 layers) on 2 device(s)") == 1, text
    assert "3 microbatches" in text and "stage  kind" in text and "tail(norm,lm_head,loss)" in text
    assert text.count("on the fused path") == 1, text
    assert "RoundPipeStrategy(fused_loss=False)" in text
    # Lightning's own lines are shown once too (no doubled handler in a plain script)
    assert text.count("GPU available:") == 1, text


class LogitsInTraining(CausalLMModule):
    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        out.logits.argmax(-1)
        return out.loss


def test_logits_of_a_fused_output_are_explained() -> None:
    with pytest.raises(AttributeError, match=r"fused path returned the loss only.*HINT: `RoundPipeStrategy\(fused_loss=False\)`"):
        trainer(lightning_roundpipe.RoundPipeStrategy(), 2, max_steps=1).fit(LogitsInTraining(tiny_hf()), loader(TokenData()))
    # the hint works: with fused_loss=False the logits are there (the default strategy is the oracle)
    module = LogitsInTraining(tiny_hf())
    trainer(lightning_roundpipe.RoundPipeStrategy(fused_loss=False), 2, max_steps=1).fit(module, loader(TokenData()))


class Inspect(CausalLMModule):
    """Returns the whole output from `training_step` (Lightning reads its `loss` key) after probing it."""

    seen: list = []

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        record = {"keys": list(out.keys()), "tuple_len": len(out.to_tuple()), "hasattr": hasattr(out, "logits"),
                  "get": out.get("logits"), "first_is_loss": out[0] is out.loss, "repr": repr(out),
                  "pickled": pickle.loads(pickle.dumps(apply_to_collection(out, torch.Tensor, torch.Tensor.detach))).loss,
                  "type": type(out)}
        Inspect.seen.append(record)
        return out


def test_fused_output_survives_lightning_and_hf_helpers() -> None:
    Inspect.seen = []
    got = fit_params(lambda: Inspect(tiny_hf()), TokenData(), strategy=lightning_roundpipe.RoundPipeStrategy(), devices=2,
                     max_steps=2)
    ref = fit_params(lambda: CausalLMModule(tiny_hf()), TokenData(), max_steps=2)
    assert max_diff(ref, got) <= 1e-5  # returning the output trains exactly as returning its loss
    assert len(Inspect.seen) == 2
    record = Inspect.seen[0]
    assert issubclass(record["type"], __import__("transformers").modeling_outputs.CausalLMOutputWithPast)
    assert record["keys"] == ["loss"] and record["tuple_len"] == 1 and record["first_is_loss"]
    assert record["hasattr"] is False and record["get"] is None
    assert "loss=tensor(" in record["repr"] and torch.isfinite(record["pickled"])


def test_evaluation_and_unfused_outputs_keep_their_logits() -> None:
    """Only fused training calls lose the logits: validation and `fused_loss=False` return them."""

    class Check(CausalLMModule):
        def validation_step(self, batch, batch_idx):
            out = self.model(**batch)
            assert out.logits.shape == (*batch["input_ids"].shape, 512)
            self.log("val/loss", out.loss)

    t = trainer(lightning_roundpipe.RoundPipeStrategy(), 2, max_steps=1, limit_val_batches=1)
    t.validate(Check(tiny_hf()), loader(TokenData(n=7)), verbose=False)
