"""A tiny Lightning fit on CPU for the Lightning callback's tests (in-process)."""

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
