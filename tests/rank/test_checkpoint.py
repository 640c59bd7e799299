"""Checkpoint library on plain torch modules in one process: format, atomicity, resume
with fallback, retention, requests, the non-finite guard and the CLI."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from agent_helpers import wait_for

from trainwatch.errors import ConfigError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rank.checkpoint import (EXIT_STOPPED, CheckpointConfig, Checkpointer,
                                           NonFiniteHalt)
from trainwatch.checkpoint_format import catalog
from trainwatch.rank.checkpoint import retention
from trainwatch.rank.checkpoint.digest import checkpoint_digest, state_digest
from trainwatch.checkpoint_format.manifest import verify
from trainwatch.rank.checkpoint.snapshot import HostSnapshot


class Counter:
    """A loader position: which batch of which epoch comes next."""

    def __init__(self, per_epoch: int = 5):
        self.epoch, self.index, self.per_epoch = 0, 0, per_epoch

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.epoch * 1000 + self.index)
        self.index += 1
        if self.index == self.per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return torch.randn(8, 6, generator=g)

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state):
        self.epoch, self.index = state["epoch"], state["index"]


class Job:
    """A tiny model trained with dropout and python/numpy noise, so every RNG matters."""

    def __init__(self):
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3),
                                         torch.nn.Linear(16, 1))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        self.data = Counter()
        self.step = 0

    def state(self):
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "data": self.data.state_dict()}

    def load(self, restored):
        self.model.load_state_dict(restored.shared["model"])
        self.opt.load_state_dict(restored.shared["optimizer"])
        self.sched.load_state_dict(restored.shared["scheduler"])
        self.data.load_state_dict(restored.data)
        restored.restore_rng()
        self.step = restored.step

    def loss(self, poison: bool = False):
        x = self.data.next() + random.random() + float(np.random.rand())
        loss = self.model(x).pow(2).mean()
        return loss * float("nan") if poison else loss

    def run(self, ckpt, until, poison_at=()):
        while self.step < until:
            loss = self.loss(self.step in poison_at)
            self.opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1e9)
            if ckpt.check_step(self.step, loss, norm, data=self.data.state_dict):
                self.opt.step()
                self.sched.step()
            self.step += 1
            if ckpt.after_step(self.step, self.state, final=self.step == until):
                return True
        return False


OPEN: list = []


@pytest.fixture(autouse=True)
def close_checkpointers():
    """Every checkpointer a test started gives its signal handlers back."""
    yield
    while OPEN:
        OPEN.pop().close()


def make(tmp_path, **cfg):
    cfg.setdefault("fsync", False)
    ckpt = Checkpointer(CheckpointConfig(**cfg), tmp_path / "run", config_hash="cfg1")
    RunDir(tmp_path / "run").create()
    OPEN.append(ckpt)
    return ckpt.start()


def events(tmp_path, *names):
    return RunDir(tmp_path / "run").events(*names)


def steps(folder):
    return [e.step for e in catalog.complete(folder)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_is_exact(tmp_path, mode):
    ref = Job()
    ref_ckpt = make(tmp_path / "a", every_steps=4, mode=mode)
    ref.run(ref_ckpt, 12)
    ref_ckpt.close()

    first = Job()
    ckpt = make(tmp_path / "b", every_steps=4, mode=mode)
    first.run(ckpt, 7)          # checkpoints at 4; steps 5-7 are lost in the "crash"
    ckpt.close()
    assert steps(tmp_path / "b/run/checkpoints") == [7, 4]
    # Crash: drop the final checkpoint so resume must continue from step 4, mid-epoch.
    import shutil
    shutil.rmtree(tmp_path / "b/run/checkpoints/step-00000007")
    second = Job()
    ckpt = make(tmp_path / "b", every_steps=4, mode=mode)
    restored = ckpt.resume()
    assert restored.step == 4 and restored.data == {"epoch": 0, "index": 4}
    second.load(restored)
    second.run(ckpt, 12)
    ckpt.close()
    assert state_digest(second.model.state_dict()) == state_digest(ref.model.state_dict())
    a = tmp_path / "a/run/checkpoints/step-00000012"
    b = tmp_path / "b/run/checkpoints/step-00000012"
    assert checkpoint_digest(a) == checkpoint_digest(b)
    assert second.opt.state_dict()["state"][0]["exp_avg"].equal(
        ref.opt.state_dict()["state"][0]["exp_avg"])
    manifest = json.loads((b / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["world_size"] == 1
    assert manifest["weights_config_digest"] == "cfg1" and manifest["versions"]["torch"] == torch.__version__
    assert set(manifest["files"]) == {"model.pt", "optimizer.pt", "scheduler.pt", "rank-00000.pt"}
    saved = events(tmp_path / "b", "checkpoint_saved")
    assert all(e["bytes"] > 0 and e["blocking_seconds"] >= 0 and e["mode"] == mode
               for e in saved)
    assert events(tmp_path / "b", "checkpoint_resumed")[0]["step"] == 4


def test_snapshot_is_isolated_from_later_updates():
    snap = HostSnapshot()
    weights = {"w": torch.ones(4), "nested": [torch.zeros(2), 3]}
    copy1 = snap.capture(weights)
    weights["w"].add_(1)
    assert copy1["w"].equal(torch.ones(4)) and copy1["nested"][1] == 3
    copy2 = snap.capture(weights)   # buffers are reused: the same memory, new values
    assert copy2["w"].data_ptr() == copy1["w"].data_ptr() and copy2["w"].equal(torch.full((4,), 2.0))


def corrupt_flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def corrupt_truncate(path):
    path.write_bytes(path.read_bytes()[:-10])


@pytest.mark.parametrize("damage,expect", [
    (lambda d: corrupt_flip(d / "model.pt"), "model.pt: xxh3_128 mismatch"),
    (lambda d: corrupt_truncate(d / "optimizer.pt"), "optimizer.pt: size"),
    (lambda d: (d / "manifest.json").unlink(), "manifest.json: missing"),
])
def test_corrupt_newest_falls_back(tmp_path, damage, expect):
    job = Job()
    ckpt = make(tmp_path, every_steps=3, mode="sync")
    job.run(ckpt, 6)
    ckpt.close()
    newest = tmp_path / "run/checkpoints/step-00000006"
    damage(newest)
    assert expect in verify(newest).reason
    fresh = Job()
    ckpt = make(tmp_path, every_steps=3)
    restored = ckpt.resume()
    assert restored.step == 3
    fresh.load(restored)
    fallback = events(tmp_path, "checkpoint_fallback")
    assert fallback[-1]["path"] == str(newest) and expect in fallback[-1]["reason"]
    assert fallback[-1]["next"].endswith("step-00000003")


def test_incomplete_save_is_ignored_and_cleaned(tmp_path):
    job = Job()
    ckpt = make(tmp_path, every_steps=3, mode="sync")
    job.run(ckpt, 3)
    ckpt.close()
    folder = tmp_path / "run/checkpoints"
    partial = folder / ".tmp-step-00000006-123-456"
    partial.mkdir()
    (partial / "model.pt").write_bytes(b"half")
    assert [e.state for e in catalog.scan(folder)] == ["complete", "incomplete"]
    ckpt = make(tmp_path)            # start() clears leftovers
    assert not partial.exists()
    assert ckpt.resume().step == 3
    assert any("incomplete" in e["reason"] for e in events(tmp_path, "checkpoint_pruned"))


def test_other_config_is_refused_another_world_size_resumes(tmp_path):
    job = Job()
    ckpt = make(tmp_path, every_steps=2, mode="sync")
    job.run(ckpt, 2)
    ckpt.close()
    other = Checkpointer(CheckpointConfig(), tmp_path / "run", config_hash="cfg2")
    with pytest.raises(ConfigError, match="weights_config_digest cfg1, this run's is cfg2"):
        other.resume()
    bigger = Checkpointer(CheckpointConfig(), tmp_path / "run", config_hash="cfg1", world_size=4)
    assert bigger.resume().step == 2  # data-parallel replicas: nothing to reshard
    (resharded,) = events(tmp_path, "checkpoint_resharded")
    assert (resharded["from_world_size"], resharded["to_world_size"]) == (1, 4)


def test_no_checkpoint_verifies_is_refused(tmp_path):
    job = Job()
    ckpt = make(tmp_path, every_steps=2, mode="sync")
    job.run(ckpt, 2)
    ckpt.close()
    corrupt_flip(tmp_path / "run/checkpoints/step-00000002/model.pt")
    with pytest.raises(ConfigError, match="no checkpoint verifies"):
        make(tmp_path).resume()
    assert make(tmp_path, resume="never").resume() is None


def test_retention_keeps_last_best_and_newest_verified(tmp_path):
    job = Job()
    ckpt = make(tmp_path, every_steps=1, mode="sync", keep_last=2, keep_best=1)
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 2.0, 6: 6.0}
    while job.step < 6:
        ckpt.note_metrics(val_loss=losses[job.step + 1])
        job.run(ckpt, job.step + 1)
    ckpt.close()
    assert steps(tmp_path / "run/checkpoints") == [6, 5, 2]
    pruned = {e["step"] for e in events(tmp_path, "checkpoint_pruned")}
    assert pruned == {1, 3, 4}


def test_retention_never_prunes_newest_verified():
    entries = [catalog.Entry(__import__("pathlib").Path(f"/c/step-{s:08d}"), s, "complete",
                             {"files": {}, "metrics": {}}) for s in (5, 4, 3)]
    # Steps 5 and 4 exist but do not verify; 3 is the newest verified and must survive.
    doomed = retention.to_prune(entries, keep_last=1, keep_best=0,
                                newest_verified=entries[2].path)
    assert [e.step for e, _ in doomed] == [4]
    assert retention.to_prune(entries, keep_last=1, keep_best=0, newest_verified=None) == []


def test_async_when_busy_skip_and_wait_are_journaled(tmp_path, monkeypatch):
    from trainwatch.rank.checkpoint import checkpointer as mod
    real = mod.write_checkpoint

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "write_checkpoint", slow)
    for policy in ("skip", "wait"):
        job = Job()
        ckpt = make(tmp_path / policy, every_steps=1, when_busy=policy, keep_last=10)
        job.run(ckpt, 2)
        ckpt.close()
        saved = [e["step"] for e in events(tmp_path / policy, "checkpoint_saved")]
        skipped = events(tmp_path / policy, "checkpoint_skipped")
        if policy == "skip":
            assert saved == [1, 2] or saved == [1]  # 2 is final: it always waits
            assert 2 in saved
        else:
            assert saved == [1, 2] and not skipped
            assert events(tmp_path / policy, "checkpoint_saved")[1]["waited_seconds"] > 0
    # A third, non-final save while one is in flight is skipped under "skip".
    job = Job()
    ckpt = make(tmp_path / "skip3", every_steps=1, when_busy="skip", save_final=False)
    job.run(ckpt, 3)
    ckpt.close()
    skipped = events(tmp_path / "skip3", "checkpoint_skipped")
    assert skipped and skipped[0]["policy"] == "skip" and skipped[0]["step"] == 2


def test_sigusr1_control_file_and_sigterm(tmp_path):
    job = Job()
    before = signal.getsignal(signal.SIGTERM)  # another test's framework may have left one
    ckpt = make(tmp_path, every_steps=0, mode="sync", save_final=False)
    job.run(ckpt, 1)
    os.kill(os.getpid(), signal.SIGUSR1)
    job.run(ckpt, 2)
    assert steps(tmp_path / "run/checkpoints") == [2]
    ckpt.requests.ask_save("control file")  # what the telemetry handler does on a touch
    job.run(ckpt, 3)
    os.kill(os.getpid(), signal.SIGTERM)
    assert job.run(ckpt, 10) is True and ckpt.exit_code == EXIT_STOPPED
    ckpt.close()
    assert steps(tmp_path / "run/checkpoints") == [4, 3, 2]
    reasons = [e["reason"] for e in events(tmp_path, "checkpoint_saved")]
    assert reasons == ["request", "request", "stop"]
    OPEN.remove(ckpt)
    assert signal.getsignal(signal.SIGTERM) is before  # handlers given back


def test_control_file_via_telemetry(tmp_path):
    from trainwatch.rank.telemetry import Telemetry
    tel = Telemetry(tmp_path / "run", heartbeat_interval=0.05, exchange_every=0).start()
    ckpt = Checkpointer(CheckpointConfig(every_steps=0, mode="sync", fsync=False,
                                         save_final=False),
                        tmp_path / "run", telemetry=tel).start()
    job = Job()
    job.run(ckpt, 1)
    time.sleep(0.02)
    (tmp_path / "run/control/checkpoint").touch()
    wait_for(lambda: ckpt.requests.save, 10, interval=0.05, what="the checkpoint request seen")
    job.run(ckpt, 2)
    ckpt.close()
    tel.close()
    assert steps(tmp_path / "run/checkpoints") == [2]
    status = json.loads((tmp_path / "run/status/rank-00000.json").read_text())
    assert status["checkpoint"]["step"] == 2 and status["checkpoint"]["ok"] is True


def test_nonfinite_step_is_skipped_or_halts(tmp_path):
    job = Job()
    ckpt = make(tmp_path, every_steps=0, mode="sync", save_final=False)
    job.run(ckpt, 2)
    before = {k: v.clone() for k, v in job.model.state_dict().items()}
    job.run(ckpt, 3, poison_at={2})
    after = job.model.state_dict()
    assert all(before[k].equal(after[k]) for k in before)   # the NaN step changed nothing
    job.run(ckpt, 4)
    assert not before["0.weight"].equal(job.model.state_dict()["0.weight"])
    event = events(tmp_path, "nonfinite_detected")[0]
    assert event["step"] == 2 and event["action"] == "skipped"
    assert event["data_position"] == {"epoch": 0, "index": 3}
    assert ckpt.facts["nonfinite_skipped_total"] == 1
    halt = make(tmp_path / "halt", nonfinite="halt")
    with pytest.raises(NonFiniteHalt):
        Job().run(halt, 3, poison_at={1})


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="checkpoint.mode.*one of async, sync"):
        CheckpointConfig.from_mapping({"mode": "fast"}, file="c.yaml")
    with pytest.raises(ConfigError, match="checkpoint.keep_lats.*unknown"):
        CheckpointConfig.from_mapping({"keep_lats": 2}, file="c.yaml")
    with pytest.raises(ConfigError, match="checkpoint.keep_last"):
        CheckpointConfig.from_mapping({"keep_last": 0})
    with pytest.raises(ConfigError, match="checkpoint.peer_copies': must be one of ring, "
                                          "clique, off, got 'star'"):
        CheckpointConfig.from_mapping({"peer_copies": "star"})
    with pytest.raises(ConfigError, match="checkpoint.peer_copies_clique_size': must be an "
                                          "integer >= 2, got 1"):
        CheckpointConfig.from_mapping({"peer_copies": "clique", "peer_copies_clique_size": 1})
    assert CheckpointConfig.from_mapping({"peer_copies": "off"}).peer_copies == "off"


def cli(*args):
    from click.testing import CliRunner
    from trainwatch.rank.checkpoint.cli import checkpoint
    return CliRunner().invoke(checkpoint, list(args))


def test_cli_list_verify_digest(tmp_path):
    job = Job()
    ckpt = make(tmp_path, every_steps=2, mode="sync", keep_last=5)
    job.run(ckpt, 4)
    ckpt.close()
    run = tmp_path / "run"
    listed = json.loads(cli("list", str(run), "--json").output)
    assert [e["step"] for e in listed] == [4, 2] and all(e["state"] == "complete" for e in listed)
    ok = cli("verify", str(run), "--json")
    assert ok.exit_code == 0 and json.loads(ok.output)["ok"] is True
    digest = cli("digest", str(run / "checkpoints/step-00000004"))
    assert digest.exit_code == 0
    assert digest.output.split()[0] == state_digest(job.model.state_dict())
    corrupt_flip(run / "checkpoints/step-00000002/scheduler.pt")
    bad = cli("verify", str(run))
    assert bad.exit_code == 1 and "scheduler.pt: xxh3_128 mismatch" in bad.output
    bad_json = json.loads(cli("verify", str(run), "--json").output)
    assert bad_json["ok"] is False
    missing = subprocess.run([sys.executable, "-m", "trainwatch", "checkpoint", "verify",
                              str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such directory" in missing.stderr


def test_mirror_copy_is_used_when_the_primary_is_corrupt(tmp_path):
    job = Job()
    ckpt = make(tmp_path, every_steps=2, mode="async", keep_last=1, mirror_dir="mirror")
    job.run(ckpt, 4)
    ckpt.close()
    primary, mirror = tmp_path / "run/checkpoints", tmp_path / "run/mirror"
    assert steps(primary) == [4] and steps(mirror) == [4]      # both pruned to keep_last
    assert verify(mirror / "step-00000004").ok
    copies = [e for e in events(tmp_path, "checkpoint_saved") if e.get("copy") == "mirror"]
    assert [e["step"] for e in copies] == [2, 4]
    corrupt_truncate(primary / "step-00000004/model.pt")
    restored = make(tmp_path, mirror_dir="mirror").resume()
    assert restored.step == 4 and restored.path == mirror / "step-00000004"
    assert events(tmp_path, "checkpoint_fallback")[-1]["next"] == str(mirror / "step-00000004")


def test_a_manifest_written_before_the_rename_still_resumes(tmp_path):
    """Manifests of earlier versions call the weights' config digest config_hash."""
    from trainwatch.checkpoint_format.compat import check_compatible

    old = {"config_hash": "cfg1", "world_size": 1}
    check_compatible(old, tmp_path, config_hash="cfg1")
    with pytest.raises(ConfigError, match="weights_config_digest cfg1, this run's is cfg2"):
        check_compatible(old, tmp_path, config_hash="cfg2")


def test_a_manifest_that_is_a_fifo_or_a_link_to_dev_zero_never_blocks_list_or_verify(tmp_path):
    """`checkpoint list|verify`, diagnose and the controller read every manifest: one that
    is a FIFO blocked them for ever (no writer), one linked to /dev/zero read without end.
    Each is a checkpoint that does not verify, said as such, and the others are listed."""
    job = Job()
    ckpt = make(tmp_path, every_steps=2, mode="sync", keep_last=5)
    job.run(ckpt, 6)
    ckpt.close()
    run = tmp_path / "run"
    (run / "checkpoints/step-00000004/manifest.json").unlink()
    os.mkfifo(run / "checkpoints/step-00000004/manifest.json")
    (run / "checkpoints/step-00000006/manifest.json").unlink()
    os.symlink("/dev/zero", run / "checkpoints/step-00000006/manifest.json")
    for command in ("list", "verify"):
        done = subprocess.run([sys.executable, "-m", "trainwatch", "checkpoint", command,
                               str(run), "--json"], capture_output=True, text=True, timeout=60)
        assert done.returncode in (0, 1), done.stderr[-2000:]
        assert "fifo" in done.stdout and "character device" in done.stdout, done.stdout
    listed = json.loads(subprocess.run(
        [sys.executable, "-m", "trainwatch", "checkpoint", "list", str(run), "--json"],
        capture_output=True, text=True, timeout=60).stdout)
    assert [e["step"] for e in listed if e["state"] == "complete"] == [2], listed
