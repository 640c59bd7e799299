"""A Lightning job sharded with FSDP2 (ModelParallelStrategy, ``fully_shard`` in
``configure_model``) and trainwatch's callback: 2 CPU ranks under torchrun (gloo).

argv: STEPS EVERY OUT. AdamW, seeded data. At the end rank 0 appends to OUT the step it
resumed from and the digest of the gathered full model and optimizer state, so a run that
resumed from a checkpoint can be compared with one that did not stop.
"""

import hashlib
import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from trainwatch.integrations.lightning import TrainwatchCallback

STEPS, EVERY, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


class Sharded(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))
        self.resumed_at = None

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def on_train_start(self):
        self.resumed_at = self.trainer.global_step

    def on_train_end(self):
        model, optim = get_state_dict(self.net, self.trainer.optimizers[0],
                                      options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=True))
        if self.trainer.global_rank != 0:
            return
        h = hashlib.sha256()
        for key in sorted(model):
            h.update(key.encode() + model[key].numpy().tobytes())
        for fqn in sorted(optim["state"]):
            for name, value in sorted(optim["state"][fqn].items()):
                h.update(f"{fqn}.{name}".encode() + torch.as_tensor(value).numpy().tobytes())
        with open(OUT, "a") as fh:
            fh.write(json.dumps({"resumed_at": self.resumed_at, "step": self.trainer.global_step,
                                 "digest": h.hexdigest()}) + "\n")


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 1, generator=g))
cb = TrainwatchCallback(every_steps=EVERY, heartbeat_interval=0.5)
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                    strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                    max_steps=STEPS, callbacks=[cb], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Sharded(), DataLoader(data, batch_size=4), ckpt_path=cb.resume_path())
