"""trainwatch rehearse for real: a healthy rehearsal passes; one with a version pin on one rank,
a learning rate too small to move the weights, the checkpoint directory on a full tmpfs and a
receiver that refuses its token fails each of those checks, for its own reason."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import REPO, kill_tree, tmpfs_mount

TOKEN = "rehearsal-test-token"
REHEARSE = [sys.executable, "-m", "trainwatch", "rehearse", "--json"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    """A real `trainwatch alerts receive` with a bearer token, on loopback."""
    run = tmp_path_factory.mktemp("receiver-run")
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "trainwatch", "alerts", "receive",
                             "--run-dir", str(run), "--listen", f"127.0.0.1:{port}"],
                            env={**os.environ, "TRAINWATCH_RECEIVER_TOKEN": TOKEN},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/healthz", timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
    yield f"{url}/webhook"
    kill_tree(proc)


def rehearse(*args, env=None, timeout=400):
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full.pop("TRAINWATCH_FAULT", None)
    done = subprocess.run([*REHEARSE, *args], capture_output=True, text=True, env=full,
                          timeout=timeout, cwd=REPO)
    try:
        report = json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"exit {done.returncode}, no JSON: {done.stdout[-2000:]} {done.stderr[-3000:]}")
    return done.returncode, {c["id"]: c for c in report["checks"]}, report


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, receiver):
    run = tmp_path_factory.mktemp("healthy") / "run"
    code, checks, report = rehearse("--nproc-per-node", "2", "--run-dir", str(run), "--steps",
                                    "8", "--webhook", receiver,
                                    env={"TRAINWATCH_RECEIVER_TOKEN": TOKEN})
    return code, checks, report, run


@pytest.mark.slow
def test_a_healthy_rehearsal_passes_every_check(healthy):
    code, checks, report, run = healthy
    assert code == 0, checks
    assert not [c for c in checks.values() if c["status"] == "FAIL"]
    for check in ("versions", "steps", "loss_falls", "checkpoint_round_trip", "allreduce",
                  "telemetry", "alert_receiver", "storage.space", "plan.checkpoint_bytes"):
        assert checks[check]["status"] == "PASS", checks[check]
    # The default model is a few MB: within process noise, so not judged (never a hollow PASS).
    assert checks["plan.memory"]["status"] == "SKIP", checks["plan.memory"]
    assert "config_digest" in checks["versions"]["evidence"]["ranks"]["1"]
    losses = checks["loss_falls"]["evidence"]["losses"]
    assert losses[-1] < losses[0] * 0.99
    reply = checks["alert_receiver"]["evidence"]["replies"][0]
    assert reply["status"] == 200 and "TrainwatchRehearsal" in reply["body"]
    # plan's checkpoint size against the checkpoint the rehearsal really wrote
    measured = checks["plan.checkpoint_bytes"]["evidence"]
    assert measured["estimate"] == pytest.approx(measured["measured"], rel=0.01)
    # the rehearsal leaves no checkpoint a real run could resume from
    assert not list((run / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_faulty_rehearsal_fails_each_check_for_its_own_reason(tmp_path, receiver):
    site = tmp_path / "site"
    site.mkdir()
    # One rank's environment differs: its torch reports another version (a stale install).
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1' and 'LOCAL_RANK' in os.environ:\n"
        "    import torch\n"
        "    torch.__version__ = '2.12.0+cpu'\n")
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    with tmpfs_mount(tmp_path / "full", "1m") as full:
        filler = full / "filler"
        with open(filler, "wb") as fh:  # fill it up: the checkpoint directory has no room
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError:
                pass
        code, checks, _ = rehearse(
            "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), "--steps", "6",
            "--set", "optim.lr=1e-12", "--set", f"checkpoint.dir={full}",
            "--webhook", receiver, "--token-file", str(wrong),
            env={"PYTHONPATH": os.pathsep.join(filter(None, [str(site),
                                                             os.environ.get("PYTHONPATH")]))})
    assert code == 1
    assert checks["versions"]["status"] == "FAIL"
    assert "rank 1 torch '2.12.0+cpu'" in checks["versions"]["reason"]
    assert checks["loss_falls"]["status"] == "FAIL"
    assert "did not fall" in checks["loss_falls"]["reason"]
    assert checks["storage.space"]["status"] == "FAIL"
    assert "MB free, the run's checkpoints need" in checks["storage.space"]["reason"]
    # no probe file on a disk that has no room (it could be a live job's)
    assert checks["storage.throughput"]["status"] == "SKIP"
    assert checks["checkpoint_round_trip"]["status"] == "FAIL"
    assert "No space left on device" in checks["checkpoint_round_trip"]["reason"]
    assert checks["alert_receiver"]["status"] == "FAIL"
    assert "HTTP 401" in checks["alert_receiver"]["reason"]
    # what was not broken still passes
    for check in ("steps", "allreduce", "telemetry"):
        assert checks[check]["status"] == "PASS", checks[check]


def test_bad_config_is_exit_2_before_anything_runs(tmp_path):
    done = subprocess.run([*REHEARSE, "--run-dir", str(tmp_path / "run"), "--set",
                           "model.layerz=3"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 2 and "model.layerz" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_training_runs_directory_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")
    done = subprocess.run([*REHEARSE, "--run-dir", str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "--run-dir" in done.stderr and "new one" in done.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.json"]


USER_JOB = str(REPO / "tests" / "jobs" / "rehearse_user_job.py")


@pytest.mark.slow
def test_a_users_own_trainer_is_rehearsed_and_its_folder_is_not_run_again(tmp_path):
    """Its last rank aborts after training ended, as gloo's teardown can abort a finished
    script: a warning, not a failure (exit 0, every other check passes)."""
    code, checks, report = rehearse(
        "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), "--",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        USER_JOB, "--lr", "0.05", "--abort-on-exit")
    assert code == 0, checks
    assert checks["job"]["status"] == "WARN", checks["job"]
    assert "after every rank reported finished" in checks["job"]["reason"]
    for check in ("steps", "loss_falls", "telemetry", "checkpoint_round_trip",
                  "versions", "allreduce", "storage.space"):
        assert checks[check]["status"] == "PASS", checks[check]
    assert any("over-fitting one batch" in item for item in report["remains"])
    # `run -- CMD` in the rehearsal's folder would resume the rehearsal's checkpoint and
    # book the time since as downtime: exit 2 before anything starts.
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    done = subprocess.run([sys.executable, "-m", "trainwatch", "run", str(tmp_path / "run"),
                           "--no-live", "--", sys.executable, USER_JOB, "--lr", "0.05"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--run-dir" in done.stderr and "rehearse" in done.stderr and "new one" in done.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before


@pytest.mark.slow
def test_a_users_trainer_at_learning_rate_0_fails_loss_falls(tmp_path):
    code, checks, _ = rehearse("--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"),
                               "--", sys.executable, USER_JOB, "--lr", "0")
    assert code == 1
    assert checks["loss_falls"]["status"] == "FAIL", checks["loss_falls"]
    assert "did not fall" in checks["loss_falls"]["reason"]
    # a clean exit: the job check passes
    assert checks["steps"]["status"] == checks["job"]["status"] == "PASS"


