"""The Hugging Face callback records each optimizer step's samples (all its micro-batches),
so samples/s and TrainingThroughputDrop work for a Trainer job; it recorded none, and the
throughput alert could never fire for one."""

import os

import pytest

from trainwatch.rundir import RunDir

BATCH, ACCUMULATE, STEPS = 4, 3, 5


def test_each_step_records_the_samples_of_all_its_micro_batches(tmp_path):
    pytest.importorskip("transformers")
    import torch
    from transformers import Trainer, TrainingArguments

    from trainwatch.integrations.transformers import TrainwatchCallback

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    data = [{"x": x, "labels": y} for x, y in zip(torch.randn(256, 8), torch.randn(256, 1))]
    run = RunDir(tmp_path / "run")
    args = TrainingArguments(output_dir=os.path.join(run.root, "hf"), max_steps=STEPS,
                             per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUMULATE, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0, remove_unused_columns=False)
    cb = TrainwatchCallback(run.root)
    Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[cb]).train()
    steps = [r for r in run.metrics(0).records if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert [r.get("samples") for r in steps] == [BATCH * ACCUMULATE] * STEPS
    assert all(r.get("samples_per_second") for r in steps)
