"""Smallest RoundPipe example: an `nn.Sequential` trained on 3 CPU virtual devices.

    python examples/sequential_mlp.py

The LightningModule is written as for one device; only the Trainer's `strategy` changes.
"""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_roundpipe


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                                   nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = (x[:, :10].argmax(1))  # a learnable target
    data = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    trainer = L.Trainer(
        strategy=lightning_roundpipe.RoundPipeStrategy(num_microbatches=4),
        accelerator="cpu", devices=3, max_epochs=2, logger=False, enable_checkpointing=False,
    )
    trainer.fit(Classifier(), data)
    print("final train/loss:", float(trainer.callback_metrics["train/loss"]))


if __name__ == "__main__":
    main()
