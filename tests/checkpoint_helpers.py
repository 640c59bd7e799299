"""A run directory whose checkpoint saves failed, written by the checkpoint library itself
(journal events and status facts exactly as its writer writes them)."""

from __future__ import annotations

from pathlib import Path

import torch

from trainwatch import Checkpoints, Telemetry
from trainwatch.rundir.run_dir import RunDir


def failed_saves(root: Path, *, steps: int = 4, every: int = 2) -> RunDir:
    """A one-rank loop whose checkpoint folder cannot be made (its parent is a file):
    every save fails (ENOTDIR) while the loop trains on and finishes."""
    run = RunDir(root).create()
    (run.root / "blocker").write_text("a file where the checkpoint folder's parent should be")
    tel = Telemetry(run.root, heartbeat_interval=3600, exchange_every=0).start()
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpoints.from_env(run.root, telemetry=tel, every_steps=every, dir="blocker/ckpt",
                                fsync=False)
    for step in range(steps):
        with tel.step(step):
            pass
        ckpt.maybe_save(step + 1, model=model)
    ckpt.close(final=False)
    tel.close()
    return run


def two_saved_steps(tmp_path: Path) -> tuple[Path, Path]:
    """A data-parallel checkpoint of one rank at steps 1 and 2: its folder, and the
    newest's directory."""
    run = RunDir(tmp_path / "run")
    ckpt = Checkpoints.from_env(run.root, every_steps=1, mode="sync", fsync=False,
                                memory_snapshots="off")
    for step in (1, 2):
        ckpt.maybe_save(step, model=torch.nn.Linear(4, 2))
    ckpt.close(final=False)
    return run.checkpoint_dir, run.checkpoint_dir / "step-00000002"
