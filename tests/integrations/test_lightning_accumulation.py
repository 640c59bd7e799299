"""Lightning with ``accumulate_grad_batches``: a trainwatch step is an optimizer step (the
framework's ``global_step``), as docs/own-trainer.md asks of any loop. Each batch used to be
a step: every step number came N times (steps/s and step time off by N, samples per step a
micro-batch's), and a due checkpoint was written again at every micro-batch of the next
step: ``step-0`` before any optimizer step, ``step-5`` N times, the last copy
mid-accumulation."""

import pytest

from trainwatch.rundir import RunDir

ACCUMULATE, BATCH, STEPS, EVERY = 4, 4, 12, 5


def test_a_step_is_an_optimizer_step_and_each_due_save_is_written_once(tmp_path):
    L = pytest.importorskip("lightning")
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainwatch.integrations.lightning import TrainwatchCallback

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
    run = RunDir(tmp_path / "run")
    cb = TrainwatchCallback(run.root, every_steps=EVERY)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[cb],
                        accumulate_grad_batches=ACCUMULATE, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(data, batch_size=BATCH))

    assert trainer.global_step == STEPS
    steps = [r for r in run.metrics(0).records if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert {r["samples"] for r in steps} == {ACCUMULATE * BATCH}
    assert all(set(r["phase_seconds"]) >= {"forward", "backward", "optimizer"} for r in steps)
    saved = [e["step"] for e in run.events("checkpoint_saved")]
    assert saved == [5, 10], saved
    state = torch.load(run.checkpoint_dir / "step-00000005" / "lightning.ckpt",
                       weights_only=False)
    assert state["global_step"] == 5
    loop = state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert loop["processed"] == 5 * ACCUMULATE  # at the optimizer step, not inside the next
