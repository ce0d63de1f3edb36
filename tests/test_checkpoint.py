"""Checkpoints are ordinary Lightning checkpoints: resume is exact, and they load without this package."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_roundpipe
from _helpers import MLPModule, VectorData, loader, params, trainer


def _fit(tmp: Path, max_steps: int, ckpt_path=None, save=False):
    module = MLPModule(scheduler=False)
    callbacks = [ModelCheckpoint(dirpath=tmp, save_last=True)] if save else []  # saved at epoch end
    # profile_steps=2: the automatic choice is made at step 2, before the checkpoint is saved at the end
    # of that epoch, so the checkpoint holds it (`roundpipe_plan`) and the resumed run goes on with it; a
    # resume from inside the profiled steps chooses for itself, and this MLP's choice is timing noise
    # (its layers take microseconds), which may cut the batch differently (test_auto_rounds.py)
    t = trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, profile_steps=2), devices=2, max_steps=max_steps,
                enable_checkpointing=save, callbacks=callbacks)
    # one batch per epoch: Lightning restarts a resumed epoch's dataloader, so every step must see the same batch
    t.fit(module, loader(VectorData(n=7)), ckpt_path=ckpt_path)
    return module


def test_resume_is_bitwise(tmp_path):
    straight = params(_fit(tmp_path / "a", 4))
    _fit(tmp_path / "b", 2, save=True)
    ckpt = tmp_path / "b" / "last.ckpt"
    assert ckpt.exists()
    resumed = params(_fit(tmp_path / "c", 4, ckpt_path=ckpt))
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


def test_checkpoint_loads_without_package(tmp_path):
    module = _fit(tmp_path, 2, save=True)
    ckpt = tmp_path / "last.ckpt"
    code = f"""
import json, sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from _helpers import MLPModule
m = MLPModule.load_from_checkpoint({str(ckpt)!r}, map_location="cpu")
assert "lightning_roundpipe" not in sys.modules
print(json.dumps({{n: p.sum().item() for n, p in m.named_parameters()}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    sums = json.loads(out.stdout.strip().splitlines()[-1])
    for n, p in module.named_parameters():
        assert abs(sums[n] - p.sum().item()) < 1e-6
