"""Actions through the webhook receiver and the supervisor, on a real job process.

The "job" is a small real Python process that writes rank status files like the
trainer does (a step counter), so restarts, SIGSTOP and crash loops are real.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from agent_helpers import wait_for
from control_helpers import JOB_SCRIPT, TOKEN, _payload, _post, _starts
from trainwatch.control.actions import ActionRequest, ActionRunner, Policy
from trainwatch.control.controller import JobController
from trainwatch.alerts.engine import Engine
from trainwatch.alerts.evaluate import History
from trainwatch.control.receiver import Receiver
from trainwatch.alerts.rules import load_rules
from trainwatch.alerts.silences import Silences
from trainwatch.control.supervise import Supervisor
from trainwatch.rundir.run_dir import RunDir


@pytest.fixture
def job(tmp_path):
    """A controller running the fake job; every process is stopped at the end."""
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    run_dir = tmp_path / "exp1"
    controllers = []

    def make(**env):
        full_env = {**os.environ, **env}
        c = JobController(run_dir, [sys.executable, str(script), str(run_dir)], env=full_env,
                          stop_grace_seconds=3)
        controllers.append(c)
        return c

    yield make
    for c in controllers:
        if c.alive():
            c.stop("test teardown")


@pytest.fixture
def receiver_for():
    started = []

    def make(controller, **policy):
        ruleset = load_rules()
        runner = ActionRunner(controller.run.root, controller,
                              Policy(**{"min_interval_seconds": 300, "guard_max_restarts": 3,
                                        **policy}),
                              silences=Silences(controller.run.root / "alerts" / "silences.json"))
        rec = Receiver(ruleset, runner, TOKEN).start()
        started.append(rec)
        return rec

    yield make
    for rec in started:
        rec.stop()




def _supervise_until_done(c, runner) -> Supervisor:
    """Start the job under a supervisor and wait (60 s at most) until it gives up."""
    sup = Supervisor(c, runner, poll_seconds=0.1)
    c.start()
    sup.start()
    try:
        assert sup.finished.wait(60)
    finally:
        sup.stop()
    return sup


def test_bad_requests_are_refused_and_nothing_acts(job, receiver_for, caplog):
    c = job()
    c.start()
    rec = receiver_for(c)
    wait_for(lambda: _starts(c.run))
    caplog.set_level("DEBUG")
    assert _post(rec.url, _payload(), token=None)[0] == 401
    assert _post(rec.url, _payload(), token="wrong")[0] == 401
    cases = [(b"not json", "not JSON"), (b"[]", "JSON object"),
             (json.dumps({**_payload(), "version": "3"}).encode(), "version"),
             (json.dumps({**_payload(), "alerts": "x"}).encode(), "'alerts' must be a list")]
    bad_alert = _payload()
    del bad_alert["alerts"][0]["fingerprint"]
    cases.append((json.dumps(bad_alert).encode(), "fingerprint"))
    bad_alert = _payload()
    bad_alert["alerts"][0]["labels"]["rank"] = 0
    cases.append((json.dumps(bad_alert).encode(), "strings"))
    bad_alert = _payload(starts="yesterday")
    cases.append((json.dumps(bad_alert).encode(), "RFC 3339"))
    for raw, reason in cases:
        code, body = _post(rec.url, None, raw=raw)
        assert code == 400 and reason in body["error"], (raw, body)
    assert not c.run.events("action_taken", "action_skipped")
    assert len(_starts(c.run)) == 1 and c.alive()
    assert TOKEN not in caplog.text


def test_stall_webhook_captures_evidence_restarts_once_and_dedups(job, receiver_for):
    c = job()
    first_pid = c.start()
    rec = receiver_for(c)
    wait_for(lambda: c.rank_pids())
    os.kill(c.rank_pids()[0], signal.SIGSTOP)  # the rank freezes, as in a real hang

    code, body = _post(rec.url, _payload())
    assert code == 200 and body["results"][0]["outcome"] == "taken", body
    taken = c.run.events("action_taken")
    assert len(taken) == 1 and taken[0]["action"] == "stall_restart"
    evidence = Path(taken[0]["evidence"])
    assert (evidence / "rank-00000.json").exists()
    assert "stopped" in (evidence / "py-spy-rank-00000.txt").read_text()
    assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == "zombie"
    wait_for(lambda: len(_starts(c.run)) == 2)
    assert c.alive() and c.proc.pid != first_pid
    stopped = c.run.events("job_stopped")
    assert stopped[0]["hard"] and stopped[0]["returncode"] == -signal.SIGKILL

    # Alertmanager re-sends the same alert (same fingerprint and startsAt): no second restart.
    code, body = _post(rec.url, _payload())
    assert body["results"][0]["outcome"] == "skipped"
    assert "duplicate delivery" in body["results"][0]["reason"]
    # A new firing of the alert soon after: rate limited, and not answered for good: its
    # repeat is looked at again (rate limited again, not a "duplicate").
    for _ in range(2):
        code, body = _post(rec.url, _payload(starts="2026-12-02T10:01:00Z"))
        assert "rate limited" in body["results"][0]["reason"], body
    assert len(_starts(c.run)) == 2 and len(c.run.events("action_taken")) == 1
    # Resolved alerts and alerts without an action never act.
    _, body = _post(rec.url, _payload(status="resolved"))
    assert body["results"][0]["outcome"] == "ignored"
    _, body = _post(rec.url, _payload(alertname="GPUXidErrors", fingerprint="ff"))
    assert body["results"][0]["reason"] == "no automatic action for this alert"


def test_dry_run_hold_silence_and_foreign_job_do_not_act(job, receiver_for):
    c = job()
    c.start()
    rec = receiver_for(c, dry_run=True)
    wait_for(lambda: c.rank_pids())
    _, body = _post(rec.url, _payload(fingerprint="01"))
    # the fake job is healthy: the controller's own look refutes the stall first
    assert "stall not confirmed: rank 0 is progressing" in body["results"][0]["reason"]
    os.kill(c.rank_pids()[0], signal.SIGSTOP)
    _, body = _post(rec.url, _payload(fingerprint="01"))  # asked again: not kept as handled
    assert "dry run: would stall_restart" in body["results"][0]["reason"]
    os.kill(c.rank_pids()[0], signal.SIGCONT)
    rec.runner.policy.dry_run = False
    _, body = _post(rec.url, _payload(fingerprint="02", job="other"))
    assert body["results"][0]["outcome"] == "dropped"  # another run's: not journaled
    (c.run.control_dir / "hold-actions").touch()
    _, body = _post(rec.url, _payload(fingerprint="03"))
    assert body["results"][0]["reason"].startswith("held")
    (c.run.control_dir / "hold-actions").unlink()
    # a silence of the page (TrainingStalled) holds the alert that acts before it
    Silences(c.run.root / "alerts" / "silences.json").add({"alertname": "TrainingStalled"}, 600)
    _, body = _post(rec.url, _payload(fingerprint="04"))
    assert body["results"][0]["reason"] == "silenced"
    assert len(_starts(c.run)) == 1 and not c.run.events("action_taken")
    assert len(c.run.events("action_skipped")) == 4  # one not confirmed, then three


def test_crash_loop_trips_the_guard_and_raises_training_restart_loop(job):
    c = job(CRASH="1")
    ruleset = load_rules()
    history = History()
    engine = Engine(ruleset, history)

    def guard_tripped(job_name, tripped):
        history.add({"__name__": "trainwatch_action_restart_guard_tripped", "run": job_name},
                    time.time(), 1.0 if tripped else 0.0)

    runner = ActionRunner(c.run.root, c, Policy(min_interval_seconds=300, guard_max_restarts=2),
                          on_guard=guard_tripped)
    sup = _supervise_until_done(c, runner)
    assert sup.exit_code == 1
    assert len(_starts(c.run)) == 3  # the first start and two restarts, then the guard
    # The documented rule (docs/alerts.md): a job that exited is restarted at once, not
    # held by the 300 s rate limit; the guard is what bounds the loop.
    exits = [e["time"] for e in c.run.events("job_exited")]
    restarts = [e["time"] for e in c.run.events("action_taken")]
    assert len(restarts) == 2 and all(0 <= r - x < 30 for x, r in zip(exits, restarts))
    assert restarts[-1] - restarts[0] < 300
    skipped = c.run.events("action_skipped")
    assert "restart guard" in skipped[-1]["reason"]
    assert runner.guard_tripped
    engine.evaluate(time.time())
    assert [a.name for a in engine.firing()] == ["TrainingRestartLoop"]


def test_a_job_that_fails_before_any_rank_published_is_a_launch_failure_not_restarted(job):
    """A missing script or a bad launcher option fails the same way on every restart."""
    c = job(LAUNCH_FAIL="1")
    runner = ActionRunner(c.run.root, c, Policy(min_interval_seconds=0, guard_max_restarts=3))
    sup = _supervise_until_done(c, runner)
    assert sup.exit_code == 1 and sup.launch_failed
    assert len(_starts(c.run)) == 1 and not c.run.events("action_taken")
    assert c.run.events("job_exited")[-1].get("launch_failed") is True


def test_progress_resets_the_guard(job):
    c = job()
    runner = ActionRunner(c.run.root, c, Policy(min_interval_seconds=0, guard_max_restarts=1))
    c.start()
    for _ in range(3):  # each restart happens after the job made progress: never blocked
        before = wait_for(lambda: c.progress_step())
        wait_for(lambda before=before: (c.progress_step() or 0) > before)
        assert runner.restart_job("restart", None).taken
    wait_for(lambda: len(_starts(c.run)) == 4)
    assert not runner.guard_tripped and len(c.run.events("action_taken")) == 3


def test_nonfinite_loss_rolls_back_before_the_bad_step_and_skips_the_window(job,
                                                                            receiver_for):
    c = job()
    c.start()
    rec = receiver_for(c, skip_window_steps=2)
    wait_for(lambda: (c.progress_step() or 0) >= 45)
    # The metrics log says step 37 produced a NaN loss.
    with open(c.run.metrics_file(0), "w") as fh:
        for step in range(46):
            loss = float("nan") if step == 37 else 5.0 - step * 0.01
            fh.write(json.dumps({"v": 1, "kind": "step", "step": step, "loss": loss}) + "\n")
    code, body = _post(rec.url, _payload(alertname="TrainingLossNonFinite", fingerprint="nan1"))
    assert body["results"][0]["outcome"] == "taken", body
    taken = c.run.events("action_taken")[-1]
    assert taken["action"] == "rollback_skip" and taken["bad_step"] == 37
    assert taken["resume_step"] == 35
    assert {q["step"] for q in taken["quarantined"]} >= {40, 45}
    assert all(not os.path.exists(c.run.checkpoint_dir / f"step-{s:08d}") for s in (40, 45))
    skip = json.loads((c.run.control_dir / "skip-steps.json").read_text())
    assert skip["from_step"] == 36 and skip["to_step"] == 39
    # The restarted job resumes from the checkpoint before the bad step.
    wait_for(lambda: len(_starts(c.run)) == 2)
    assert _starts(c.run, field=1)[1] == 35


def test_receive_cli_supervises_a_job_and_acts_on_webhooks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    run = RunDir(tmp_path / "exp1")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "alerts", "receive", "--run-dir", str(run.root),
         "--listen", f"127.0.0.1:{port}",
         "--job-command", f"{sys.executable} {script} {run.root}"],
        env={**os.environ, "TRAINWATCH_RECEIVER_TOKEN": TOKEN}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(_starts(run)) == 1)
        wait_for(lambda: _healthy(f"http://127.0.0.1:{port}/healthz"))
        wait_for(lambda: run.statuses().records)
        os.kill(run.statuses().records[0]["pid"], signal.SIGSTOP)  # really stalled
        code, body = _post(f"http://127.0.0.1:{port}", _payload())
        assert code == 200 and body["results"][0]["outcome"] == "taken", body
        wait_for(lambda: len(_starts(run)) == 2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:  # never leave the receiver and its job behind
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
    assert TOKEN.encode() not in out
    stopped = run.events("job_stopped")
    assert stopped[-1]["reason"] == "receiver stopped"
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in _starts(run))


def test_trainwatch_run_refuses_bad_rules_before_starting_anything(tmp_path):
    bad = tmp_path / "rules.yaml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: TrainingX\n"
                   "        expr: nope_metric > 1\n        severity: critical\n"
                   "        summary: s\n        description: d\n")
    out = subprocess.run([sys.executable, "-m", "trainwatch", "run", "--nproc-per-node", "1",
                          "--run-dir", str(tmp_path / "exp1"), "--rules", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and f"{bad}:5" in out.stderr, out.stderr
    assert "nope_metric" in out.stderr and "metrics contract" in out.stderr
    assert not (tmp_path / "exp1").exists()


def _healthy(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rollback_quarantines_the_configured_dir_and_the_mirror_too(tmp_path):
    """checkpoint.dir and checkpoint.mirror_dir from run.json: no copy of a step at or after
    the bad one stays anywhere resume looks, so resume takes the one before it."""
    import torch

    from trainwatch.rank.checkpoint import CheckpointConfig, Checkpointer

    run = RunDir(tmp_path / "exp1").create()
    mirror = tmp_path / "other-disk" / "mirror"
    section = {"dir": "ckpt", "mirror_dir": str(mirror), "every_steps": 5, "mode": "sync",
               "fsync": False, "keep_last": 10}
    run.write_run_info({"job": "exp1", "config": {"checkpoint": section}})
    cfg = CheckpointConfig(**section)
    model = torch.nn.Linear(2, 1)
    ckpt = Checkpointer(cfg, run.root).start()
    try:
        for step in range(1, 16):
            ckpt.after_step(step, lambda step=step: {"model": model.state_dict(),
                                                     "data": {"s": step}},
                            final=step == 15)
    finally:
        ckpt.close()
    saved = lambda folder: sorted(p.name for p in folder.glob("step-*"))  # noqa: E731
    assert saved(run.root / "ckpt") == saved(mirror) == [f"step-{s:08d}" for s in (5, 10, 15)]
    with open(run.metrics_file(0), "w") as fh:  # step 12 produced a NaN loss
        for step in range(15):
            loss = float("nan") if step == 12 else 2.0
            fh.write(json.dumps({"v": 1, "kind": "step", "step": step, "loss": loss}) + "\n")

    controller = JobController(run.root, [sys.executable, "-c", "pass"], stop_grace_seconds=3)
    runner = ActionRunner(run.root, controller, Policy(min_interval_seconds=0))
    try:
        outcome = runner.restart_job("rollback_skip")
    finally:
        controller.stop("test teardown")
    assert outcome.taken, outcome.reason
    assert outcome.details["bad_step"] == 12 and outcome.details["resume_step"] == 10
    moved = {q["moved_from"]: q["moved_to"] for q in outcome.details["quarantined"]}
    assert set(moved) == {str(run.root / "ckpt" / "step-00000015"),
                          str(mirror / "step-00000015")}
    assert all(os.path.isdir(target) for target in moved.values())
    assert saved(run.root / "ckpt") == saved(mirror) == ["step-00000005", "step-00000010"]
    # The mirror copy lands beside the mirror (same mount), invisible to resume.
    assert Path(moved[str(mirror / "step-00000015")]).parent.parent == mirror
    restored = Checkpointer(cfg, run.root).resume()
    assert restored is not None and restored.step == 10


def test_a_later_nan_rolls_back_to_itself_not_to_one_already_rolled_back(tmp_path):
    """The metrics log keeps the NaN of an earlier, handled rollback; the next rollback
    must target the new bad step, or it would throw away everything trained since."""
    from trainwatch.control.bad_step import first_bad_step as _first_bad_step

    run = RunDir(tmp_path / "exp1").create()
    before = time.time() - 100

    def log(steps, nan_at, t0):
        with open(run.metrics_file(0), "a") as fh:
            for i, step in enumerate(steps):
                loss = float("nan") if step == nan_at else 3.0
                fh.write(json.dumps({"v": 1, "kind": "step", "step": step, "time": t0 + i * 0.1,
                                     "loss": loss}) + "\n")

    log(range(26), 24, before)
    assert _first_bad_step(run) == 24
    run.append_event("action_taken", "engine", action="rollback_skip", bad_step=24)
    log([20] + list(range(26, 90)), 80, time.time() + 1)
    (rolled_back,) = run.events("action_taken")
    assert _first_bad_step(run, rolled_back["time"]) == 80


def test_a_killed_orphan_left_as_a_zombie_counts_as_gone():
    """pid 1 of a container may never reap an orphan whose parent was killed with it; a
    hard restart must not wait out its whole timeout on such a zombie."""
    from trainwatch.process.proctree import wait_gone

    launcher = subprocess.Popen(["bash", "-c", "bash -c 'sleep 100 & wait' & wait"],
                                start_new_session=True)
    try:
        wait_for(lambda: len(psutil.Process(launcher.pid).children(recursive=True)) == 2)
        tree = psutil.Process(launcher.pid).children(recursive=True)
        for p in [psutil.Process(launcher.pid), *tree]:
            p.send_signal(signal.SIGKILL)
        launcher.wait()
        started = time.monotonic()
        assert wait_gone(tree, timeout=30) == []
        assert time.monotonic() - started < 10
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def test_deciding_a_rollback_does_not_import_torch(tmp_path):
    """The controller reads the checkpoint catalog before it stops a diverged job; an
    `import torch` there cost 10 s on a loaded node, long enough for the bad run to end."""
    code = ("import sys\n"
            "from trainwatch.control.controller import JobController\n"
            f"c = JobController({str(tmp_path / 'exp1')!r}, ['true'])\n"
            "c.run.create()\n"
            "assert c.progress_step() is None and c.checkpoints() == []\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_tripped_guard_clears_once_the_job_progresses_again(job):
    """A human fixed the cause and started the job again: once it has saved a newer
    checkpoint than at the last restart, a new failure is restarted, not paged."""
    c = job()
    changes = []
    runner = ActionRunner(c.run.root, c, Policy(min_interval_seconds=0, guard_max_restarts=1),
                          on_guard=lambda job_name, tripped: changes.append(tripped))
    c.start()
    wait_for(lambda: c.progress_step())
    assert runner.restart_job("restart", None).taken      # first restart
    assert not runner.restart_job("restart", None).taken  # no progress since: the guard
    assert runner.guard_tripped and changes == [True]
    c.stop("a human looks")
    stuck = c.progress_step()
    assert not runner.restart_job("restart", None).taken  # still none: stays tripped
    c.start("fixed by hand")
    wait_for(lambda: (c.progress_step() or 0) > stuck)   # the job trains again
    assert runner.restart_job("restart", None).taken
    assert not runner.guard_tripped and changes == [True, True, False]
    (cleared,) = c.run.events("action_guard_cleared")
    assert cleared["step"] > cleared["step_at_last_restart"]


@pytest.mark.parametrize("ranks, started, finished", [
    ({0: "finished", 1: "finished"}, +1, True),    # every rank of this start said finished
    ({0: "finished", 1: "running"}, +1, False),    # rank 1 crashed before its last status
    ({0: "finished"}, +1, False),                  # rank 1 never wrote one
    ({0: "finished", 1: "finished"}, -1, False),   # a finished run before this start
])
def test_a_job_counts_as_finished_only_when_every_rank_of_this_start_says_so(
        tmp_path, ranks, started, finished):
    c = JobController(tmp_path / "exp1", [sys.executable, "-c", "pass"])
    c.started_at = time.time()
    for rank, state in ranks.items():
        c.run.write_status(rank, {"job": "exp1", "rank": rank, "pid": 10 + rank, "node": "n1",
                                  "world_size": 2, "state": state, "step": 9,
                                  "started_at": c.started_at + started,
                                  "heartbeat_at": c.started_at + started})
    assert c.ranks_finished() is finished


def test_a_rollback_is_held_back_by_an_earlier_rollback_not_by_another_restart(job):
    """A stall restart and a NaN alert in the same minute: the restart resumed from the
    newest checkpoint, maybe past the bad step, so the rollback must still happen."""
    c = job()
    runner = ActionRunner(c.run.root, c, Policy(min_interval_seconds=300, guard_max_restarts=5))
    c.start()
    wait_for(lambda: (c.progress_step() or 0) >= 20)
    assert runner.restart_job("stall_restart").taken
    wait_for(lambda: len(_starts(c.run)) == 2)
    with open(c.run.metrics_file(0), "w") as fh:
        for step in range(21):
            loss = float("nan") if step == 12 else 5.0 - step * 0.01
            fh.write(json.dumps({"v": 1, "kind": "step", "step": step, "loss": loss}) + "\n")

    def nan_alert(fingerprint):
        return ActionRequest("TrainingLossNonFinite", "rollback_skip", {"run": "exp1"},
                             fingerprint, "2026-12-02T10:00:00Z", "engine")

    first = runner.handle(nan_alert("nan1"))
    assert first.taken and first.details["bad_step"] == 12, first.reason
    second = runner.handle(nan_alert("nan2"))
    assert not second.taken and "rate limited: the job was rolled back" in second.reason


def test_replica_rollback_acts_only_on_confirmed_digests_and_resumes_before_them(job):
    """TrainingReplicaDivergence's action reads the ranks' logged digests itself: one odd
    digest is not acted on (asked again later); two are, and every checkpoint saved after
    the newest agreeing digest is quarantined."""
    c = job()
    runner = ActionRunner(c.run.root, c, Policy(min_interval_seconds=300, guard_max_restarts=3))
    c.start()
    wait_for(lambda: (c.progress_step() or 0) >= 45)

    def log(odd_steps):
        now = time.time()
        for rank in range(3):
            with open(c.run.metrics_file(rank), "w") as fh:
                for step in (19, 24, 29, 34, 39):
                    bits = ("b" if rank == 1 and step in odd_steps else "a") * 16
                    fh.write(json.dumps({"v": 1, "kind": "replicas", "time": now, "rank": rank,
                                         "step": step, "group": 0, "bits": bits}) + "\n")

    def alert(fingerprint):
        return ActionRequest("TrainingReplicaDivergence", "replica_rollback",
                             {"run": "exp1", "suspects": "1"}, fingerprint,
                             "2026-12-02T10:00:00Z", "engine")

    log({34})
    first = runner.handle(alert("sdc1"))
    assert not first.taken and not first.final and "not confirmed" in first.reason
    log({34, 39})
    second = runner.handle(alert("sdc1"))  # the same alert, asked again
    assert second.taken, second.reason
    taken = c.run.events("action_taken")[-1]
    assert taken["action"] == "replica_rollback"
    assert taken["divergence"]["first_odd_step"] == 34
    assert taken["clean_checkpoint_step"] == 30
    assert {q["step"] for q in taken["quarantined"]} >= {35, 40, 45}
    assert all(q["step"] > 30 for q in taken["quarantined"])
    assert taken["suspects"] == [{"rank": 1, "node": None}]
    wait_for(lambda: len(_starts(c.run)) == 2)
    assert _starts(c.run, field=1)[1] == 30


def test_a_restart_held_by_the_rate_limit_is_done_when_the_window_ends(job, receiver_for):
    """A stall inside the rate limit's window is held back, not dropped: Alertmanager's
    repeats are looked at again (never "duplicate"), and the first one after the window
    ends restarts the still frozen job. Real timings: a 6 s window after a crash restart."""
    c = job()
    c.start()
    rec = receiver_for(c, min_interval_seconds=6)
    wait_for(lambda: c.rank_pids())
    assert rec.runner.restart_job("restart", None).taken  # the job exited: restarted at once
    restarted_at = c.run.events("action_taken")[-1]["time"]
    wait_for(lambda: len(_starts(c.run)) == 2 and c.rank_pids().get(0) == _starts(c.run)[-1])
    os.kill(c.rank_pids()[0], signal.SIGSTOP)
    code, body = _post(rec.url, _payload())
    assert "rate limited" in body["results"][0]["reason"], body
    assert "asked again in" in body["results"][0]["reason"]
    assert c.run.events("action_skipped")[-1]["retry_after"] <= 6
    # Alertmanager repeats the alert every minute; here, every 2 s until it acts.
    answers = [body["results"][0]]
    deadline = time.monotonic() + 60
    while answers[-1]["outcome"] != "taken" and time.monotonic() < deadline:
        time.sleep(2)
        answers.append(_post(rec.url, _payload())[1]["results"][0])
    assert all("rate limited" in a["reason"] for a in answers[:-1]), answers
    taken = c.run.events("action_taken")[-1]
    assert taken["action"] == "stall_restart" and taken["time"] - restarted_at >= 6
    wait_for(lambda: len(_starts(c.run)) == 3)


def test_a_loss_alert_still_firing_after_its_rollback_does_not_roll_back_again(job):
    """TrainingLossNonFinite keeps firing for nonfinite_window_seconds (5 min) after the
    NaN, and the engine asks again once the rate limit's window ends: if the restarted job
    has logged no new bad step by then, a second rollback would throw away good training
    on stale evidence. A new NaN after the rollback is acted on."""
    c = job()
    clock = [time.time()]
    runner = ActionRunner(c.run.root, c, Policy(min_interval_seconds=30, guard_max_restarts=5),
                          clock=lambda: clock[0])
    c.start()
    wait_for(lambda: (c.progress_step() or 0) >= 20)

    def log(steps, nan_at, t0):
        with open(c.run.metrics_file(0), "a") as fh:
            for i, step in enumerate(steps):
                loss = float("nan") if step == nan_at else 5.0 - step * 0.01
                fh.write(json.dumps({"v": 1, "kind": "step", "step": step, "time": t0 + i * 0.01,
                                     "loss": loss}) + "\n")

    def nan_alert(fingerprint):
        return ActionRequest("TrainingLossNonFinite", "rollback_skip", {"run": "exp1"},
                             fingerprint, "2026-12-02T10:00:00Z", "engine")

    log(range(21), 12, clock[0] - 10)
    first = runner.handle(nan_alert("nan1"))
    assert first.taken and first.details["bad_step"] == 12, first.reason
    # 40 s later the alert still fires; the restarted job logged steps 11-40, all finite,
    # with an ordinary wobble a "largest spike" would have picked.
    clock[0] += 40
    log(range(11, 41), None, time.time() + 1)
    again = runner.handle(nan_alert("nan2"))
    assert not again.taken and not again.final, again.reason
    assert "not confirmed" in again.reason and "since the last rollback" in again.reason
    assert len(_actions_taken(c.run, "rollback_skip")) == 1
    # A NaN the restarted job logs is new evidence: rolled back again.
    clock[0] += 40
    log(range(41, 50), 45, time.time() + 2)
    third = runner.handle(nan_alert("nan3"))
    assert third.taken and third.details["bad_step"] == 45, third.reason


def _actions_taken(run, action):
    return [e for e in run.events("action_taken") if e.get("action") == action]


def _nan_at(run: RunDir, bad: int, steps: int) -> None:
    with open(run.metrics_file(0), "w") as fh:
        for step in range(steps):
            loss = float("nan") if step >= bad else 5.0 - step * 0.01
            fh.write(json.dumps({"v": 1, "kind": "step", "step": step, "loss": loss}) + "\n")


def _nan_alert(fingerprint: str) -> ActionRequest:
    return ActionRequest("TrainingLossNonFinite", "rollback_skip", {"run": "exp1"},
                         fingerprint, "2026-12-02T10:00:00Z", "engine")


def test_a_rollback_asked_after_the_run_ended_takes_nothing_and_says_so(tmp_path):
    """A short run ends (exit 0: finished) before its NaN alert's rollback acts. The
    rollback must not start the job again behind the ending supervisor, nor leave a
    skip-steps request, a quarantine or a "rolled back" rate limit for a rollback that never
    happened, nor journal a stop of a job that had exited."""
    c = JobController(tmp_path / "exp1", [sys.executable, "-c", "pass"])
    runner = ActionRunner(c.run.root, c, Policy(min_interval_seconds=300))
    (c.run.checkpoint_dir / "step-00000010").mkdir(parents=True)
    _nan_at(c.run, 15, 20)
    _supervise_until_done(c, runner)
    try:
        first = runner.handle(_nan_alert("nan1"))
        second = runner.handle(_nan_alert("nan2"))
    finally:
        c.close("test teardown")
    assert not first.taken and "the run already ended" in first.reason, first.reason
    assert not second.taken and "rate limited" not in second.reason, second.reason
    names = [e["event"] for e in c.run.events()]
    assert names.count("job_started") == 1 and "job_stopped" not in names, names
    assert not c.run.skip_steps_file.exists()
    assert (c.run.checkpoint_dir / "step-00000010").is_dir()


def test_a_rollback_of_a_job_that_already_crashed_records_its_exit_not_a_stop(tmp_path):
    """The job crashed (exit 1) and its NaN rollback comes before the supervisor's next
    look: the rollback goes on (restarts it past the bad step), and the journal says the job
    exited with 1 by itself, once, not that trainwatch stopped it."""
    c = JobController(tmp_path / "exp1", [sys.executable, "-c", "import sys; sys.exit(1)"])
    runner = ActionRunner(c.run.root, c, Policy(min_interval_seconds=300))
    _nan_at(c.run, 15, 20)
    c.start()
    c.proc.wait(timeout=60)
    try:
        assert runner.handle(_nan_alert("nan1")).taken
    finally:
        c.close("test teardown")
    ends = [(e["event"], e.get("returncode")) for e in c.run.events()
            if e["event"] in ("job_stopped", "job_exited")]
    assert ends[0] == ("job_exited", 1), ends


def test_a_stop_on_purpose_is_said_in_the_job_log_after_the_launcher_s_traceback(tmp_path):
    """torchrun answers trainwatch's SIGTERM with a SignalException traceback at the end of
    job.log, which a user reads as the crash; the log says, after it, that this was a stop
    trainwatch made and why (and nothing when the job ended by itself)."""
    job = ("import signal, sys, time\n"
           "def stop(*_):\n"
           "    raise RuntimeError('SignalException: Process 1 got signal: 15')\n"
           "signal.signal(signal.SIGTERM, stop)\n"
           "print('ready', flush=True)\n"
           "time.sleep(600)\n")
    c = JobController(tmp_path / "exp1", [sys.executable, "-c", job], stop_grace_seconds=30)
    log = c.run.logs_dir / "job.log"
    c.start()
    try:
        wait_for(lambda: "ready" in log.read_text(), 60, what="the job to start")
        c.stop("interrupted")
    finally:
        c.close("test teardown")
    text = log.read_text()
    last = text.rstrip("\n").splitlines()[-1]
    assert text.index("got signal: 15") < text.index(last), text
    assert "stopped attempt 1" in last and "(interrupted)" in last, last
    assert "not a crash" in last, last
    c2 = JobController(tmp_path / "exp2", [sys.executable, "-c", "pass"])
    c2.start()
    c2.proc.wait(timeout=60)
    c2.close("test teardown")
    assert "stopped attempt" not in (c2.run.logs_dir / "job.log").read_text()
