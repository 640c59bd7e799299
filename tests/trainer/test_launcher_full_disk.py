"""`trainwatch train`'s launcher on a full run directory (a real tmpfs filled to the brim), as
when a supervisor restarts a job there: its run.json and journal writes and its copy of
torchrun's output cost what they cannot write, never the launch."""

from __future__ import annotations

import sys

from conftest import fill_to_the_brim, tmpfs_mount
from trainwatch.rundir.run_dir import RunDir
from trainwatch.trainer import launcher
from trainwatch.trainer.config import load_config

# Stands in for torchrun: 300 KB of output, then exit 0.
_TORCHRUN = [sys.executable, "-c",
             "for i in range(3000): print(f'torchrun line {i:04d} ' + 'x' * 80, flush=True)"]


def test_the_launcher_runs_its_job_on_a_full_run_directory(tmp_path, monkeypatch, capfd):
    """Before: run.json's write raised ENOSPC out of the launcher (a traceback, exit 1)."""
    run = RunDir(tmp_path / "run")
    monkeypatch.setattr(launcher, "torchrun_command", lambda spec, run: list(_TORCHRUN))
    with tmpfs_mount(run.root, "4m"):
        run.create()
        fill_to_the_brim(run.root)
        code = launcher._launch(launcher.LaunchSpec(run.root, 1), run, load_config(None, []))
        torchrun_log = (run.logs_dir / "torchrun.log").read_bytes()
    out, err = capfd.readouterr()
    assert code == 0
    assert "torchrun line 2999" in out  # the console copy is whole
    assert len(torchrun_log) < 3000 * 100  # the log's copy lost what did not fit
    for what in ("run.json", "launcher_started", "launcher_exited"):
        assert f"trainwatch train: could not record {what}: No space left on device" in err, err
