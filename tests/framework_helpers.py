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


def stop_job(tmp_path: Any, job: Any, *, signal_torchrun: bool, late: bool = False) -> Any:
    """Run ``job`` (tests/jobs/*_job.py) on 2 CPU ranks under torchrun; once both ranks
    trained a few steps SIGTERM both (and torchrun if ``signal_torchrun``), and rank 0 again
    20 ms later; ``late``: rank 0 alone, and rank 1 SIGTERMs itself while it writes its final
    status (the job's LATE_SIGTERM). The run directory and the launcher's output."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from agent_helpers import wait_for
    from conftest import kill_tree
    from trainwatch.rundir.run_dir import RunDir

    run = RunDir(tmp_path / "run")
    log = tmp_path / "job.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(job), "400", "0.1"], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRAINWATCH_RUN_DIR": str(run.root),
             **({"LATE_SIGTERM": "1"} if late else {})})
    try:
        def running():
            status = {s["rank"]: s for s in run.statuses().records}
            return len(status) == 2 and all((s.get("step") or 0) >= 3 for s in status.values())\
                and status
        status = wait_for(running, timeout=240, what="both ranks past step 3")
        pids = [status[r]["pid"] for r in ((0,) if late else (0, 1))]
        pids += [proc.pid] if signal_torchrun else []
        for pid in pids:  # Slurm's SIGTERM to every process of the step
            os.kill(pid, signal.SIGTERM)
        if not late:
            time.sleep(0.02)
            os.kill(pids[0], signal.SIGTERM)  # a copy that reached rank 0 alone (forwarded)
        proc.wait(timeout=120)
    finally:
        kill_tree(proc)
    return run, log.read_text()
