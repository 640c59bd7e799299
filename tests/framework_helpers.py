"""A tiny Lightning fit and Hugging Face Trainer run on CPU, for the framework callbacks'
tests (in-process)."""

from __future__ import annotations

from typing import Any


def fit(L: Any, torch: Any, callback: Any, steps: int, *, ckpt_path: str | None = None,
        accumulate: int = 1, batch: int = 4) -> Any:
    """``steps`` optimizer steps of a linear model on seeded random data, with ``callback``
    and nothing of Lightning's own (logger, checkpoints, progress bar); the Trainer."""
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[callback],
                        accumulate_grad_batches=accumulate, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(data, batch_size=batch), ckpt_path=ckpt_path)
    return trainer


def hf_train(callback: Any, output_dir: str, steps: int, *, accumulate: int = 1, batch: int = 4,
             save_steps: int | None = None, resume: str | None = None) -> Any:
    """``steps`` optimizer steps of a Trainer on a linear model and seeded random data, with
    ``callback``; checkpoints every ``save_steps`` (none without); the Trainer."""
    import torch
    from transformers import Trainer, TrainingArguments

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    g = torch.Generator().manual_seed(0)
    data = [{"x": x, "labels": y}
            for x, y in zip(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))]
    args = TrainingArguments(output_dir=output_dir, max_steps=steps,
                             per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulate, logging_steps=1,
                             save_strategy="steps" if save_steps else "no",
                             save_steps=save_steps or 500, report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0,
                             remove_unused_columns=False)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume)
    return trainer
