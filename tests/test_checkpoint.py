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
    # saved at every epoch end, each epoch its own file, and last.ckpt
    callbacks = [ModelCheckpoint(dirpath=tmp, save_last=True, save_top_k=-1)] if save else []
    # profile_steps=2: the automatic choice is made at step 2, before the checkpoint of that epoch is
    # saved, so the checkpoint holds it (`roundpipe_plan`) and the resumed run goes on with it
    t = trainer(lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, profile_steps=2), devices=2, max_steps=max_steps,
                enable_checkpointing=save, callbacks=callbacks)
    # one batch per epoch: Lightning restarts a resumed epoch's dataloader, so every step must see the same batch
    t.fit(module, loader(VectorData(n=7)), ckpt_path=ckpt_path)
    return module


def test_resume_is_bitwise(tmp_path):
    """Resumed from its step-2 checkpoint, a run ends bitwise where it ended straight. The oracle is the
    run that wrote the checkpoint, not a second straight run: this MLP's layers take microseconds, so
    the automatic choice (made from timings) can differ between two runs, and a different cut of the
    batch sums the gradients in another order."""
    straight = params(_fit(tmp_path / "a", 4, save=True))
    (ckpt,) = (tmp_path / "a").glob("*step=2.ckpt")
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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    sums = json.loads(out.stdout.strip().splitlines()[-1])
    for n, p in module.named_parameters():
        assert abs(sums[n] - p.sum().item()) < 1e-6
