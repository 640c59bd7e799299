"""Two TrainwatchCallbacks in one Lightning Trainer (a script that already had one, and the
docs' line pasted in): each started its own telemetry for the same rank and every
checkpoint was written twice, silently. Now the run ends with exit 2 naming the key, as any
bad input does (the rank's status says bad_input, so it is not restarted)."""

import os
import subprocess
import sys
import textwrap

import pytest

from trainwatch.errors import EXIT_USAGE
from trainwatch.rundir.run_dir import RunDir

SCRIPT = textwrap.dedent("""
    import lightning as L, torch
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

    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    cb = TrainwatchCallback(every_steps=5)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, logger=False,
                        callbacks=[cb, TrainwatchCallback(every_steps=5)],
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), DataLoader(data, batch_size=4), ckpt_path=cb.resume_path())
""")


def test_a_second_trainwatch_callback_is_bad_input_exit_2_naming_the_key(tmp_path):
    pytest.importorskip("lightning")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = RunDir(tmp_path / "run")
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run.root), "--no-live",
         "--", sys.executable, str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == EXIT_USAGE, done.stdout[-2000:] + done.stderr[-2000:]
    assert "key 'callbacks'" in done.stderr and "TrainwatchCallback" in done.stderr, \
        done.stderr[-2000:]
    assert not run.events("checkpoint_saved")
