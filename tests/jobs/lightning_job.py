"""A tiny PyTorch Lightning job with trainwatch's callback (2 CPU ranks under torchrun)."""

import os
import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainwatch.integrations.lightning import TrainwatchCallback

STEPS, PACE = int(sys.argv[1]), float(sys.argv[2])


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(PACE)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(4096, 8, generator=g), torch.randn(4096, 1, generator=g))
cb = TrainwatchCallback(heartbeat_interval=0.5, replica_every=5)
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                    strategy="ddp", max_steps=STEPS, callbacks=[cb], logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Tiny(), DataLoader(data, batch_size=4), ckpt_path=cb.resume_path())
