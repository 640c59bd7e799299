"""A tiny Hugging Face Trainer job with trainwatch's callback (2 CPU ranks under torchrun)."""

import os
import sys
import time

import torch
from transformers import Trainer, TrainingArguments

from trainwatch.integrations.transformers import TrainwatchCallback

STEPS, PACE = int(sys.argv[1]), float(sys.argv[2])


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def forward(self, x, labels=None):
        time.sleep(PACE)
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


g = torch.Generator().manual_seed(0)
data = [{"x": x, "labels": y} for x, y in zip(torch.randn(4096, 8, generator=g),
                                              torch.randn(4096, 1, generator=g))]
args = TrainingArguments(output_dir=os.path.join(os.environ["TRAINWATCH_RUN_DIR"], "hf"),
                         max_steps=STEPS, per_device_train_batch_size=4, logging_steps=1,
                         save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                         dataloader_num_workers=0, remove_unused_columns=False,
                         ddp_backend="gloo")
cb = TrainwatchCallback(heartbeat_interval=0.5, replica_every=5)
trainer = Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[cb])
trainer.train(resume_from_checkpoint=cb.resume_path(args.output_dir))
