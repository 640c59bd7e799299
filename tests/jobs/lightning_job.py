"""A tiny PyTorch Lightning job with trainwatch's callback (2 CPU ranks under torchrun).

``WEIGHTS_LOG=FILE``: rank 0 appends a digest of the weights at each optimizer step's end and
where fit started (a restart's resumed weights, against the first run's at that step).
``LATE_SIGTERM=1``: rank 1 sends itself SIGTERM while it writes its final status (its
launcher's SIGTERM, late, as a stop another rank was asked for ends).
"""

import hashlib
import json
import os
import signal
import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainwatch.integrations.lightning import TrainwatchCallback
from trainwatch.rank.telemetry import Telemetry

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


class WeightsLog(L.Callback):
    def _write(self, trainer, module, key):
        path = os.environ.get("WEIGHTS_LOG")
        if path and trainer.global_rank == 0:
            digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                             for p in module.parameters())).hexdigest()
            with open(path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), key: trainer.global_step,
                                    "digest": digest}) + "\n")

    def on_train_start(self, trainer, module):
        self._write(trainer, module, "start")

    def on_train_batch_end(self, trainer, module, *args):
        self._write(trainer, module, "step")


if os.environ.get("LATE_SIGTERM") and os.environ.get("RANK") == "1":
    _close = Telemetry.close

    def close(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return _close(self, *args, **kwargs)

    Telemetry.close = close

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(4096, 8, generator=g), torch.randn(4096, 1, generator=g))
cb = TrainwatchCallback(heartbeat_interval=0.5, replica_every=5, memory_snapshots="every_step")
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                    strategy="ddp", max_steps=STEPS, callbacks=[cb, WeightsLog()], logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Tiny(), DataLoader(data, batch_size=4), ckpt_path=cb.resume_path())
