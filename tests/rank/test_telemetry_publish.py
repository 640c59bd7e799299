""""Cannot publish" means the run directory cannot be written, nothing else: a collective's
error from a dead peer or a value that cannot be read is a telemetry error, and must not
page TrainwatchCannotPublish (critical)."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from agent_helpers import wait_for
from conftest import torchrun_env
from trainwatch.rundir.beat import beat_path, read_beat
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rank.telemetry import Telemetry

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_killed_during_the_timing_exchange_is_not_a_publish_failure(tmp_path):
    port, run_dir = _free_port(), tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, str(HERE.parent / "jobs" / "dead_peer_job.py"), str(run_dir)],
                              env=torchrun_env(tmp_path, MASTER_ADDR="127.0.0.1",
                                               MASTER_PORT=str(port), WORLD_SIZE="2",
                                               RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert "Connection reset by peer" in err or "Connection closed by peer" in err, err[-2000:]
    assert result["counters"]["telemetry_errors_total"] >= 2  # seen, and counted as such
    assert result["beat"]["publish_errors_total"] == 0, result
    assert result["beat"]["publish_failing_since"] is None


class _Reset(torch.Tensor):
    """A recorded value whose read fails the way a collective's output does after its peer
    died (gloo's read error)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.item:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error "
                               "[127.0.0.1]:39608: Connection reset by peer")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_only_a_failed_write_counts_as_cannot_publish(tmp_path):
    tel = Telemetry(tmp_path, heartbeat_interval=0.05, exchange_every=0).start()
    try:
        with tel.step(0) as s:
            s.record(loss=torch.tensor(1.0).as_subclass(_Reset))
        wait_for(lambda: tel.snapshot()["counters"]["telemetry_errors_total"] >= 1, 30,
                 interval=0.05, what="the heartbeat to resolve the step")
        time.sleep(0.2)
        beat = read_beat(beat_path(tel.run.status_dir, 0))
        assert beat["publish_errors_total"] == 0 and beat["publish_failing_since"] is None
        # a metrics log that cannot be written is one
        (tmp_path / "metrics").rename(tmp_path / "metrics-gone")
        (tmp_path / "metrics").write_text("not a directory")
        with tel.step(1) as s:
            s.record(loss=torch.tensor(1.0))
        wait_for(lambda: read_beat(beat_path(tel.run.status_dir, 0))["publish_errors_total"] >= 1,
                 30, interval=0.05, what="the beat to tell the failed write")
        assert "NotADirectoryError" in read_beat(beat_path(tel.run.status_dir, 0))[
            "last_publish_error"]
    finally:
        tel.close()


def test_a_rank_dying_of_an_uncaught_error_publishes_its_last_steps(tmp_path):
    """An error nothing caught ends the rank before its next heartbeat (here 30 s away):
    its status and metrics log still hold every step it completed, for diagnose (not
    "step None, phase init") and report (the steps lost to it)."""
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "--max-restarts", "0", str(HERE.parent / "jobs" / "crash_job.py"), str(run_dir)],
        env=torchrun_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "a bug in the loss" in done.stdout + done.stderr
    for rank in (1, 0):
        steps = [json.loads(line)["step"] for line in
                 (run_dir / "metrics" / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
        assert steps == list(range(30)), (rank, steps)
        status = json.loads((run_dir / "status" / f"rank-{rank:05d}.json").read_text())
        assert status["steps_completed"] == 30 and status["step"] == 30, (rank, status)
    # The rank that raised says so, as the reference trainer's do: not "running" in phase
    # "step" (a dead rank read as alive, mid-step), and which error, for diagnose and report.
    status = json.loads((run_dir / "status" / "rank-00001.json").read_text())
    assert (status["state"], status["phase"]) == ("failed", "failed"), status
    assert status["failure"]["kind"] == "error", status
    assert "RuntimeError: a bug in the loss at step 30" in status["failure"]["message"]
    failed = [e for e in RunDir(run_dir).events("failed") if e.get("rank") == 1]
    assert failed and "a bug in the loss" in failed[0]["error"], failed


def test_a_metrics_log_line_on_a_full_disk_is_all_or_nothing(tmp_path):
    """The run directory's tmpfs fills up: the rank's metrics log took the part of its
    append that fitted, a torn `{"v":1,"kind":"st` that the next append (space freed) glued
    its first line to, and the beat did not say the write failed. Like the journal: the
    cut line is taken back and the append counted as a publish failure; after space is
    freed, whole lines only."""
    from conftest import fill_to_the_brim, tmpfs_mount
    with tmpfs_mount(tmp_path / "disk", "1m") as disk:
        tel = Telemetry(disk / "run", heartbeat_interval=0.05, exchange_every=0).start()
        try:
            with tel.step(0) as s:
                s.record(loss=torch.tensor(1.0))
            log = tel.run.metrics_file(0)
            wait_for(lambda: log.exists() and log.stat().st_size > 0, 30, interval=0.05,
                     what="the first step in the log")
            fill_to_the_brim(disk)
            before = log.read_bytes()
            for step in range(1, 40):  # a few KB of lines: more than the page's slack
                with tel.step(step) as s:
                    s.record(loss=torch.tensor(1.0), note="x" * 200)
            wait_for(lambda: read_beat(beat_path(tel.run.status_dir, 0))[
                "publish_errors_total"] >= 1, 30, interval=0.05, what="the failed append told")
            after = log.read_bytes()  # whole lines that fitted stay; the cut one is gone
            assert after.startswith(before) and after.endswith(b"\n"), after[-200:]
            (disk / "filler").unlink()
            with tel.step(40) as s:
                s.record(loss=torch.tensor(1.0))
        finally:
            tel.close()
        lines = log.read_text().splitlines()
    assert all(json.loads(line)["v"] == 1 for line in lines), lines[-3:]
    assert json.loads(lines[-1])["step"] == 40


def test_a_rank_starting_on_a_disk_with_no_inode_left_trains_on(tmp_path):
    """A restarted rank whose run directory's disk is full (here its inodes: `df -i`).
    Before: the layout's write probe (RunDir.create, which Telemetry.start, the reference
    trainer, Checkpoints and the framework callbacks call) raised ConfigError ("run
    directory is not writable"): the rank died as if its input were bad, not restarted."""
    import subprocess
    from conftest import tmpfs_mount
    disk = tmp_path / "disk"
    disk.mkdir()
    with tmpfs_mount(disk, "1m"):
        subprocess.run(["mount", "-o", "remount,nr_inodes=64", str(disk)], check=True)
        run = RunDir(disk / "run").create()  # the first start made the layout
        n = 0
        try:
            while True:
                (disk / f"inode-{n}").touch()
                n += 1
        except OSError:
            pass
        tel = Telemetry(run.root, heartbeat_interval=0.05, exchange_every=0).start()
        try:
            with tel.step(0) as s:
                s.record(loss=torch.tensor(1.0))
            assert tel.snapshot()["counters"]["telemetry_errors_total"] >= 1
        finally:
            tel.close()
