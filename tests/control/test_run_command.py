"""`trainwatch run -- COMMAND` with jobs that are not torchrun DDP loops: bad input, a job
that ends at once, one that never publishes telemetry, and one that keeps its own
checkpoint files and declares them (restart guard and CheckpointTooOld)."""

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from agent_helpers import free_port, wait_for
from conftest import kill_tree
from trainwatch.rundir.run_dir import RunDir

HERE = Path(__file__).resolve().parent


def _run(run_dir, *args, thresholds=None, env=None, **popen):
    cmd = [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run_dir), "--no-live"]
    if thresholds:
        cmd += ["--thresholds", str(thresholds)]
    return subprocess.Popen([*cmd, *args], env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)


def test_a_command_that_does_not_exist_is_exit_2_naming_it(tmp_path):
    out = _run(tmp_path / "r", "--", "no-such-trainer", "--lr", "1").communicate(timeout=60)[0]
    assert b"no-such-trainer" in out and b"not found" in out
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_trainer_options_with_a_command_are_exit_2(tmp_path):
    proc = _run(tmp_path / "r", "--steps", "5", "--", sys.executable, "-c", "pass")
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 2 and b"--steps" in out


def test_a_job_that_exits_0_at_once_is_finished_not_restarted(tmp_path):
    # the run directory as RUN_DIR, as every other command takes it
    proc = subprocess.Popen([sys.executable, "-m", "trainwatch", "run", str(tmp_path / "r"),
                             "--no-live", "--", sys.executable, "-c", "pass"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    run = RunDir(tmp_path / "r")
    assert len(run.events("job_started")) == 1 and not run.events("action_taken")
    assert run.run_info()["command"] == [sys.executable, "-c", "pass"]


def test_a_job_without_telemetry_is_reported_while_it_runs(tmp_path):
    proc = _run(tmp_path / "r", "--telemetry-grace", "2", "--", sys.executable, "-c",
                "import time; time.sleep(300)")
    lines = []
    try:
        for line in proc.stdout:  # waits on the message, not on time
            lines.append(line)
            if b"no rank has published telemetry" in line:
                break
        assert proc.poll() is None, b"".join(lines)  # said so; the job keeps running
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        kill_tree(proc)
    assert proc.returncode == 130
    assert RunDir(tmp_path / "r").events("job_silent")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trainwatch.agent.daemon") is None,
                    reason="needs the agent")
def test_declared_saves_keep_the_guard_quiet_and_drive_checkpoint_too_old(tmp_path):
    thresholds = tmp_path / "thresholds.yaml"
    thresholds.write_text("evaluation_interval: 1s\ncheckpoint_max_age_seconds: 3\n"
                          "restart_guard_max_restarts: 1\n")
    proc = _run(tmp_path / "r", "--", sys.executable, str(HERE.parent / "jobs" / "declared_job.py"),
                thresholds=thresholds)
    try:
        out = proc.communicate(timeout=400)[0]
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, out[-3000:]
    run = RunDir(tmp_path / "r")
    restarts = [e for e in run.events("action_taken") if e.get("action") == "restart"]
    # two crashes, each after progress: two restarts, more than the guard's 1 allows
    # without progress
    assert len(restarts) == 2, run.events("action_skipped")
    assert all(r["resume_from"]["kind"] == "declared" for r in restarts)
    assert "trainwatch did not verify" in restarts[-1]["reason"]
    assert not [e for e in run.events("action_skipped") if "guard" in e.get("reason", "")]
    assert any(e.get("alert") == "CheckpointTooOld" for e in run.events("alert_firing"))
    assert [e for e in run.events("action_taken") if e.get("action") == "checkpoint_now"]
    assert run.events("finished")


@pytest.mark.slow
def test_a_rank_that_aborts_after_finishing_is_not_restarted_one_that_aborts_before_is(
        tmp_path):
    """gloo can abort a finished script on its way out ("terminate called without an
    active exception"): the launcher exits non-zero, but every rank said ``finished``, so
    the job is done. The same abort before the last status is a crash: restarted."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", str(HERE.parent / "jobs" / "teardown_abort_job.py")]
    outcomes = {}
    for when in ("after", "before"):
        proc = _run(tmp_path / when, "--", *torchrun, when,
                    env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        try:
            out = proc.communicate(timeout=300)[0].decode(errors="replace")
        finally:
            kill_tree(proc)
        run = RunDir(tmp_path / when)
        exits = run.events("job_exited")
        outcomes[when] = (proc.returncode, len(run.events("job_started")),
                          [(e["returncode"], e.get("ranks_finished", False)) for e in exits])
        assert proc.returncode == 0, out[-3000:]
        assert all(s["state"] == "finished" for s in run.statuses().records)
    assert outcomes["after"][1:] == (1, [(1, True)]), outcomes  # done: one start, no restart
    # a crash: restarted once
    assert outcomes["before"][1:] == (2, [(1, False), (0, False)]), (outcomes, out[-3000:])


def test_a_job_that_fails_before_any_rank_starts_is_not_restarted(tmp_path):
    """torchrun with a script that does not exist: every rank fails before it publishes
    anything, and every restart would too. It used to be restarted 3 times until the guard."""
    proc = _run(tmp_path / "r", "--", sys.executable, "-m", "torch.distributed.run",
                "--standalone", "--nproc-per-node", "2", str(tmp_path / "no-such-script.py"),
                env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    try:
        out = proc.communicate(timeout=300)[0].decode(errors="replace")
    finally:
        kill_tree(proc)
    run = RunDir(tmp_path / "r")
    assert proc.returncode == 1, out[-3000:]
    assert len(run.events("job_started")) == 1 and not run.events("action_taken")
    assert run.events("job_exited")[-1].get("launch_failed") is True
    assert "failed before any rank started" in out and "exitcode" in out, out[-3000:]
    assert "Traceback (most recent call last)" not in out.split("end of its log")[0]
    # Why, from the top of the launch's log: the failure table at its end does not say.
    said = out.split("failed before any rank started")[1]
    assert "can't open file" in said and "no-such-script.py" in said, out[-3000:]


def test_the_agent_listens_on_the_port_given_and_a_busy_one_is_exit_2(tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        busy = _run(tmp_path / "busy", "--agent-port", str(port), "--", sys.executable, "-c",
                    "pass")
        out = busy.communicate(timeout=60)[0].decode()
        assert busy.returncode == 2 and "--agent-port" in out and str(port) in out, out
        assert not (tmp_path / "busy").exists()
    # The job itself reaches the agent there (it may start before the agent answers).
    job = ("import time, urllib.request\n"
           "for _ in range(300):\n"
           "    try:\n"
           f"        urllib.request.urlopen('http://127.0.0.1:{port}/healthz', timeout=5)\n"
           "        break\n"
           "    except OSError:\n"
           "        time.sleep(0.2)\n"
           "else:\n"
           "    raise SystemExit(3)\n")
    proc = _run(tmp_path / "r", "--agent-port", str(port), "--", sys.executable, "-c", job)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, out
    assert f"agent http://127.0.0.1:{port}" in out


def test_the_summary_of_a_run_that_ended_in_nan_says_so(tmp_path):
    """A batch poisons the weights at step 20 and nothing rolls back (--dry-run; in a short
    run the job can also finish first): the loss is NaN to the end. The summary's final
    loss is that NaN, since when, not the last finite loss before it (which read as a
    healthy run)."""
    example = HERE.parents[1] / "examples" / "own_loop.py"
    proc = _run(tmp_path / "r", "--dry-run", "--", sys.executable, str(example), "--steps",
                "30", "--checkpoint-every", "10", "--poison-step", "20")
    out = proc.communicate(timeout=180)[0].decode()
    assert "final loss  │ NaN since step 20" in out, out
    # Not exit 0 ("finished"): CI would pass a model of NaN weights. 1, saying why, once.
    assert proc.returncode == 1, out
    assert "trainwatch run failed" in out and "ended with a NaN loss since step 20" in out, out
    stopped = RunDir(tmp_path / "r").events("controller_stopped")
    assert [e["exit_code"] for e in stopped] == [1], stopped


def test_a_job_that_finished_after_its_saves_failed_is_not_exit_0(tmp_path):
    """The run directory's disk filled up: every save since step 10 failed (ENOSPC), the
    loop trained on to its last step and exited 0. `trainwatch run` said "finished", exit
    0, while what was trained after step 10 was on no disk. It exits 1 naming the last
    good checkpoint and the failed save; a save that failed once and was followed by a good
    one (or by a failed mirror copy, which names no step) is no such end."""
    job = ("import os, sys\n"
           "from trainwatch.rundir.run_dir import RunDir\n"
           "run = RunDir(os.environ['TRAINWATCH_RUN_DIR'])\n"
           "run.append_event('checkpoint_saved', 'rank0', rank=0, step=10, path='x')\n"
           "run.append_event('checkpoint_failed', 'rank0', rank=0, step=20, errno=28,\n"
           "                 error='No space left on device')\n"
           "if sys.argv[1] == 'recovered':\n"
           "    run.append_event('checkpoint_saved', 'rank0', rank=0, step=30, path='x')\n"
           "    run.append_event('checkpoint_failed', 'rank0', rank=0, path='x',\n"
           "                     error='mirroring step-00000030 failed')\n")
    proc = _run(tmp_path / "r", "--", sys.executable, "-c", job, "lost")
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 1, out
    assert "trainwatch run failed" in out, out
    assert "save of step 20 failed" in out and "No space left on device" in out, out
    assert "the newest saved is step 10" in out, out
    ok = _run(tmp_path / "ok", "--", sys.executable, "-c", job, "recovered")
    out = ok.communicate(timeout=120)[0].decode()
    assert ok.returncode == 0, out


@pytest.mark.parametrize("supervisor", ["run", "alerts receive"])
def test_a_second_sigterm_while_stopping_does_not_cut_the_stop_short(tmp_path, supervisor):
    """Ctrl-C twice, or Slurm's SIGTERM reaching the supervisor again while the job saves:
    the stop under way goes on to its end. Before, the second signal raised
    KeyboardInterrupt inside the shutdown: 'Aborted.', the job killed by its dead parent
    before its save was done, and the stop not journaled."""
    job = tmp_path / "job.py"
    job.write_text(
        "import os, pathlib, signal, sys, time\n"
        "here = pathlib.Path(sys.argv[1])\n"
        "def stop(*_):\n"
        "    (here / 'stopping').write_text('')\n"
        "    time.sleep(3)  # a checkpoint on its way to disk\n"
        "    (here / 'saved').write_text('')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "(here / 'pid').write_text(str(os.getpid()))\n"
        "while True:\n"
        "    time.sleep(0.1)\n")
    run = RunDir(tmp_path / "r")
    if supervisor == "run":
        proc = _run(run.root, "--", sys.executable, str(job), str(tmp_path))
    else:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainwatch", "alerts", "receive", "--run-dir", str(run.root),
             "--listen", f"127.0.0.1:{free_port()}",
             "--job-command", f"{sys.executable} {job} {tmp_path}"],
            env={**os.environ, "TRAINWATCH_RECEIVER_TOKEN": "t" * 32},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (tmp_path / "pid").exists() and run.events("job_started"), 60,
                 what="the job")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: (tmp_path / "stopping").exists(), 30, what="the job stopping")
        proc.send_signal(signal.SIGTERM)  # while the job saves
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        kill_tree(proc)
    assert proc.returncode == (130 if supervisor == "run" else 0), out
    assert (tmp_path / "saved").exists(), out  # the job's save was not cut short
    assert b"Aborted" not in out and b"Traceback" not in out, out
    assert [e["returncode"] for e in run.events("job_stopped")] == [0], out
    if supervisor == "run":
        stopped = run.events("controller_stopped")
        assert len(stopped) == 1 and stopped[0]["interrupted"], out
    assert not psutil.pid_exists(int((tmp_path / "pid").read_text()))


def test_a_job_that_dies_of_a_config_error_before_any_rank_started_is_exit_2_naming_it(
        tmp_path):
    """A framework callback made with a misspelt keyword raises trainwatch's ConfigError
    before any telemetry starts, so no rank can say "bad input": the run ended as a launch
    failure, exit 1. The traceback's last line in the job's log says it: exit 2 with it."""
    proc = _run(tmp_path / "r", "--", sys.executable, "-c",
                "from trainwatch.errors import ConfigError; "
                "raise ConfigError('unknown keyword', key='TrainwatchCallback.every_step')")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2, out
    assert b"rejected its input" in out and b"TrainwatchCallback.every_step" in out, out
    run = RunDir(tmp_path / "r")
    assert [e["exit_code"] for e in run.events("controller_stopped")] == [2]
    assert len(run.events("job_started")) == 1  # not restarted
