"""`trainwatch run` against a real full disk (a tmpfs filled to the brim while it trains).

Ctrl-C with the run directory itself on the full disk: the supervisor stops the job and the
agent (the mount is no longer busy), says what it could not record, prints its summary and
exits 130, never a traceback. With the checkpoint folder on the full disk: StorageFull names
the mount within 15 s of the first failed save. A full run directory stops nothing: an own
job that prints every step trains on through it, with no death and no restart, and
finishes (exit 0) once space returns (the reference trainer's run through a full run
directory is test_run_never_harm_e2e.py's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from agent_helpers import wait_for
from conftest import REPO, fill_to_the_brim, kill_tree, tmpfs_mount
from side_by_side import side_by_side
from control_helpers import fill_run_dir_and_logs, start_run
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow


def _start(tmp_path, run_dir, *sets: str) -> subprocess.Popen:
    (tmp_path / "train.yaml").write_text(
        "train: {steps: 100000, batch_size: 4, eval_interval: 0}\n"
        "checkpoint: {every_steps: 5, fsync: false}\n")
    return start_run(tmp_path, run_dir, *[arg for s in sets for arg in ("--set", s)],
                     nproc=1, env={"TRAINWATCH_FAULT": "slow:delay=0.2"})


def _use_the_journals_slack(run: RunDir) -> None:
    """Lines that fit in the free end of the journal's last page, as a long run would have
    written, until none does: only then does an append meet the full disk."""
    for _ in range(200):
        try:
            run.append_event("test_padding", "test", pad="x" * 64)
        except OSError:
            return


def _steps(run: RunDir) -> int:
    steps = [s.get("step") for s in run.statuses().records]
    return max((s for s in steps if isinstance(s, int)), default=-1)


def _ctrl_c_on_a_full_run_directory_stops_everything_and_exits_130(tmp_path):
    run = RunDir(tmp_path / "disk")
    with tmpfs_mount(run.root, "48m"):
        proc = _start(tmp_path, run.root)
        try:
            wait_for(lambda: _steps(run) >= 6 or proc.poll() is not None, 240, what="step 6")
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            started = psutil.Process(proc.pid).children(recursive=True)
            assert len(started) >= 3  # the agent, the launcher, torchrun and its rank
            fill_to_the_brim(run.root)
            proc.send_signal(signal.SIGINT)
            deadline = time.time() + 120
            while proc.poll() is None and time.time() < deadline:  # keep it full: the job
                fill_to_the_brim(run.root)                       # frees what it gives up
                _use_the_journals_slack(run)
                time.sleep(0.05)
            code = proc.wait(timeout=1)
        finally:
            kill_tree(proc)
        log = (tmp_path / "run.log").read_text()
        left = [p.pid for p in started if p.is_running() and p.status() != "zombie"]
        unmounted = subprocess.run(["umount", str(run.root)], capture_output=True, text=True)
    assert code == 130, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert left == [], log[-3000:]
    assert unmounted.returncode == 0, unmounted.stderr  # nothing of ours holds the mount
    assert "trainwatch run interrupted" in log  # the summary
    assert "could not record" in log and "controller_stopped" in log, log[-3000:]


def _storage_full_names_the_full_disk_within_15s_of_the_first_failed_save(tmp_path):
    run = RunDir(tmp_path / "run")
    disk = tmp_path / "ckpt"
    with tmpfs_mount(disk, "16m"):
        proc = _start(tmp_path, run.root, f"checkpoint.dir={disk}")
        try:
            wait_for(lambda: run.events("checkpoint_saved") or proc.poll() is not None, 240,
                     what="a first checkpoint")
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            fill_to_the_brim(disk)
            failed = wait_for(lambda: run.events("checkpoint_failed"), 120,
                              what="a failed save")
            firing = wait_for(lambda: [e for e in run.events("alert_firing")
                                       if e.get("alert") == "StorageFull"], 120,
                              what="StorageFull")
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            finally:
                kill_tree(proc)
    after = firing[0]["time"] - failed[0]["time"]
    print(f"StorageFull fired {after:.1f} s after the first failed save")
    assert after <= 15, (after, firing[0])
    assert firing[0]["labels"]["mountpoint"] == str(disk)


# A job that publishes its telemetry, fills the disk its run directory is on and crashes.
_CRASH_ON_A_FULL_DISK = """
import os
from trainwatch import Telemetry
Telemetry.from_env().start()
with open(os.path.join(os.environ["TRAINWATCH_RUN_DIR"], "filler"), "ab", buffering=0) as fh:
    size = 1 << 20
    while size:
        try:
            fh.write(b"\\0" * size)
        except OSError:
            size //= 2
os._exit(1)
"""


def _a_crash_that_cannot_be_restarted_on_a_full_disk_ends_the_run_not_hangs(tmp_path):
    """The job crashes with its run directory full: the restart cannot record itself (the
    restart guard's ledger), so it is not taken. `trainwatch run` says why and ends with
    exit 1 (before: a traceback in the supervisor thread, and the run waited forever)."""
    run = RunDir(tmp_path / "run")
    with tmpfs_mount(run.root, "16m"):
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainwatch", "run", str(run.root), "--no-live", "--",
             sys.executable, "-c", _CRASH_ON_A_FULL_DISK],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=90)
        finally:
            kill_tree(proc)
    assert proc.returncode == 1, out
    assert "Traceback" not in out, out
    assert "could not restart the job" in out and "No space left on device" in out, out


def _rank0(run: RunDir) -> dict:
    return next(s for s in run.statuses().records if s.get("rank") == 0)


def _no_death_no_restart(run: RunDir, pid: int, log: str) -> None:
    """One start, rank 0 the same process from before the disk filled to its finish."""
    assert len(run.events("job_started")) == 1, log[-3000:]
    assert [e for e in run.events("job_exited") if e.get("returncode")] == [], log[-3000:]
    assert run.events("restarted") == [], log[-3000:]
    status = _rank0(run)
    assert (status["pid"], status["state"]) == (pid, "finished"), (status, log[-3000:])


def _an_own_job_that_prints_every_step_trains_on_through_a_full_run_directory(tmp_path):
    """Before: the job's stdout was logs/job.log on the full disk; its next print died of
    ENOSPC, so did torchrun's restart, and the run failed. After: its output is missing
    from the log while the disk is full (the log says where and how much), nothing else;
    StorageFull names the disk meanwhile."""
    run = RunDir(tmp_path / "run")
    progress, gate = tmp_path / "progress", tmp_path / "gate"
    (tmp_path / "scratch").mkdir()
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "1", str(REPO / "tests" / "jobs" / "print_job.py"), str(progress), str(gate)]

    def step() -> int:
        return int(progress.read_text()) if progress.exists() else -1
    with tmpfs_mount(run.root, "16m"):
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainwatch", "run", str(run.root), "--no-live", "--", *job],
            stdout=open(tmp_path / "run.log", "wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "TMPDIR": str(tmp_path / "scratch"), "OMP_NUM_THREADS": "1"})
        try:
            wait_for(lambda: _steps(run) >= 3 or proc.poll() is not None, 240, what="step 3")
            pid = _rank0(run)["pid"]
            full_at = step()
            fill_run_dir_and_logs(run)
            wait_for(lambda: fill_to_the_brim(run.root) and step() >= full_at + 30
                     and "alert StorageFull firing" in (tmp_path / "run.log").read_text()
                     or proc.poll() is not None, 120, interval=0.05,
                     what="StorageFull, and 30 prints on the full disk")
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            (run.root / "filler").unlink()
            gate.touch()
            code = proc.wait(timeout=120)
        finally:
            kill_tree(proc)
        log = (tmp_path / "run.log").read_text()
        _no_death_no_restart(run, pid, log)
        job_log = (run.logs_dir / "job.log").read_text()
        stopped = run.events("controller_stopped")
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    missing = job_log.index("bytes of output are missing here")  # then it resumed
    assert "finished after step" in job_log[missing:], job_log[-3000:]
    assert "bytes of the job's output are missing from" in log, log[-3000:]
    assert stopped[-1]["output_dropped_bytes"] > 0, stopped


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The four runs side by side: paced steps and full disks are mostly waiting."""
    with side_by_side(request, tmp_path_factory, {
        "test_an_own_job_that_prints_every_step_trains_on_through_a_full_run_directory":
            _an_own_job_that_prints_every_step_trains_on_through_a_full_run_directory,
        "test_storage_full_names_the_full_disk_within_15s_of_the_first_failed_save":
            _storage_full_names_the_full_disk_within_15s_of_the_first_failed_save,
        "test_ctrl_c_on_a_full_run_directory_stops_everything_and_exits_130":
            _ctrl_c_on_a_full_run_directory_stops_everything_and_exits_130,
        "test_a_crash_that_cannot_be_restarted_on_a_full_disk_ends_the_run_not_hangs":
            _a_crash_that_cannot_be_restarted_on_a_full_disk_ends_the_run_not_hangs,
    }) as running:
        yield running


def test_an_own_job_that_prints_every_step_trains_on_through_a_full_run_directory(runs, request):
    runs.result(request)


def test_storage_full_names_the_full_disk_within_15s_of_the_first_failed_save(runs, request):
    runs.result(request)


def test_ctrl_c_on_a_full_run_directory_stops_everything_and_exits_130(runs, request):
    runs.result(request)


def test_a_crash_that_cannot_be_restarted_on_a_full_disk_ends_the_run_not_hangs(runs, request):
    runs.result(request)
