"""A checkpoint directory on a small real tmpfs: saves that hit ENOSPC fail cleanly, the
older checkpoint survives, training goes on, journal and status say so."""

import errno
import json

import pytest
import torch

from conftest import tmpfs_mount
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rank.checkpoint import CheckpointConfig, Checkpointer
from trainwatch.checkpoint_format import catalog
from trainwatch.checkpoint_format.manifest import verify
from trainwatch.rank.telemetry import Telemetry


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs, unmounted afterwards (needs root, as in CI)."""
    with tmpfs_mount(tmp_path / "disk", "2m") as mount:
        yield mount


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_disk_full_fails_cleanly_and_keeps_the_previous(tmp_path, small_disk, mode):
    torch.manual_seed(0)
    # ~0.6 MB of weights + ~1.2 MB of Adam state: the first checkpoint (~1.8 MB) fits in
    # 2 MiB, a second one does not.
    model = torch.nn.Linear(400, 400)
    opt = torch.optim.Adam(model.parameters())
    tel = Telemetry(tmp_path / "run", heartbeat_interval=0.05, exchange_every=0).start()
    ckpt = Checkpointer(CheckpointConfig(dir=str(small_disk), mode=mode, every_steps=1,
                                         keep_last=1, save_final=False),
                        tmp_path / "run", telemetry=tel).start()
    def state():
        return {"model": model.state_dict(), "optimizer": opt.state_dict(),
                "data": {"index": step}}
    for step in range(1, 5):
        loss = model(torch.randn(4, 400)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.after_step(step, state)
        ckpt.wait()
    ckpt.close()
    tel.close()

    run = RunDir(tmp_path / "run")
    failed = run.events("checkpoint_failed")
    assert [e["step"] for e in failed] == [2, 3, 4]            # training went on to step 4
    assert all(e["errno"] == errno.ENOSPC for e in failed)
    assert all(e["previous"].endswith("step-00000001") for e in failed)
    entries = catalog.scan(small_disk)
    assert [(e.step, e.state) for e in entries] == [(1, "complete")]  # no partial left
    assert verify(small_disk / "step-00000001").ok
    assert not run.events("checkpoint_pruned")                  # keep_last=1, yet nothing pruned
    status = json.loads(run.status_file(0).read_text())["checkpoint"]
    assert status["ok"] is False and status["step"] == 1 and status["failures_total"] == 3
    assert "No space left" in status["last_error"]
