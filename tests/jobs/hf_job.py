"""A tiny Hugging Face Trainer job with trainwatch's callback (2 CPU ranks under torchrun).

``WEIGHTS_LOG=FILE``: rank 0 appends a digest of the weights at each optimizer step's end and
where training started (a restart's resumed weights, against the first run's at that step).
``LATE_SIGTERM=1``: rank 1 sends itself SIGTERM while it writes its final status (its
launcher's SIGTERM, late, as a stop another rank was asked for ends).
"""

import hashlib
import json
import os
import signal
import sys
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from trainwatch.integrations.transformers import TrainwatchCallback
from trainwatch.rank.telemetry import Telemetry

STEPS, PACE = int(sys.argv[1]), float(sys.argv[2])


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def forward(self, x, labels=None):
        time.sleep(PACE)
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class WeightsLog(TrainerCallback):
    def _write(self, state, model, key):
        path = os.environ.get("WEIGHTS_LOG")
        if path and state.is_world_process_zero:
            digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                             for p in model.parameters())).hexdigest()
            with open(path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), key: state.global_step,
                                    "digest": digest}) + "\n")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._write(state, model, "start")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._write(state, model, "step")


if os.environ.get("LATE_SIGTERM") and os.environ.get("RANK") == "1":
    _close = Telemetry.close

    def close(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return _close(self, *args, **kwargs)

    Telemetry.close = close

g = torch.Generator().manual_seed(0)
data = [{"x": x, "labels": y} for x, y in zip(torch.randn(4096, 8, generator=g),
                                              torch.randn(4096, 1, generator=g))]
args = TrainingArguments(output_dir=os.path.join(os.environ["TRAINWATCH_RUN_DIR"], "hf"),
                         max_steps=STEPS, per_device_train_batch_size=4, logging_steps=1,
                         save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                         dataloader_num_workers=0, remove_unused_columns=False,
                         ddp_backend="gloo")
cb = TrainwatchCallback(heartbeat_interval=0.5, replica_every=5, memory_snapshots="every_step")
trainer = Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[cb, WeightsLog()])
trainer.train(resume_from_checkpoint=cb.resume_path(args.output_dir))
