"""One small Lightning training script, run two ways by tests/lightning/test_kernel_lightning.py: under torchrun with
strategy="ddp" (``python -m torch.distributed.run --nproc-per-node 2 parity_script.py OUT``), and in a notebook
kernel with strategy="mesh" (the kernel execs this file with PARITY_STRATEGY=mesh). Rank 0's final weights go to OUT.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class ParityModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class ParityData(L.LightningDataModule):
    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(512, 16, generator=g)
        self.train = TensorDataset(x, (x[:, :4].argmax(1)))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=32, shuffle=True)


def train(out: str) -> None:
    L.seed_everything(0)
    model = ParityModel()
    trainer = L.Trainer(strategy=os.environ.get("PARITY_STRATEGY", "ddp"), accelerator="cpu", devices=2,
                        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, datamodule=ParityData())
    if trainer.is_global_zero:
        torch.save(model.state_dict(), out)


if __name__ == "__main__":
    train(sys.argv[1])
