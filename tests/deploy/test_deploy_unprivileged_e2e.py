"""The agent as its own unprivileged user, watching a job of another user, as shipped.

A real 2-rank gloo job runs as user ``twjob`` with umask 027 under a setgid runs root of
group ``trainwatch`` (docs/run-directory.md, "Permissions"). The agent runs with the
systemd unit's User, Group, capabilities and NoNewPrivileges (setpriv, from the unit
file), over a procfs mounted ``hidepid=invisible`` as the unit's ProtectProc=invisible
gives it. It must see both ranks and their processes; once the group's permission is
taken away it must say so: health degraded with the reason, the unreadable gauge and the
permission_denied counter, and TrainwatchRunUnreadable firing in the alert engine.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from agent_helpers import free_port, get_json, http_get, stop_process, wait_for
from conftest import kill_tree
from deploy_configs import unit_service_settings, unit_setpriv
from users_helpers import _ensure_user, _python_for_others

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("useradd")),
    reason="needs root, setpriv and useradd (other users)")]

JOB_USER = "twjob"



def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.rindex("}") + 1]))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def base():
    """A world-traversable scratch folder (pytest's tmp_path is root's 0700), with a
    hidepid=invisible procfs in it; unmounted and removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="tw-unpriv-"))
    path.chmod(0o755)
    proc = path / "proc"
    proc.mkdir()
    subprocess.run(["mount", "-t", "proc", "-o", "hidepid=invisible", "proc", str(proc)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(proc)], check=False)
        shutil.rmtree(path, ignore_errors=True)


def test_agent_as_its_own_user_sees_the_ranks_and_says_when_it_may_not(base):
    unit = unit_service_settings()
    _ensure_user(unit["User"])
    _ensure_user(JOB_USER)
    agent_uid, agent_gid = pwd.getpwnam(unit["User"]).pw_uid, grp.getgrnam(unit["Group"]).gr_gid
    job_uid = pwd.getpwnam(JOB_USER).pw_uid
    # The runs root: the job's user writes, the agent's group reads, setgid passes it on.
    runs, home = base / "runs", base / "home"
    runs.mkdir()
    os.chown(runs, job_uid, agent_gid)
    runs.chmod(0o2750)
    home.mkdir()
    os.chown(home, job_uid, -1)
    run_dir = runs / "exp1"

    python, pythonpath = _python_for_others()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": pythonpath, "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    train = subprocess.Popen(
        ["setpriv", f"--reuid={JOB_USER}", f"--regid={JOB_USER}", "--init-groups", "--",
         "sh", "-c", 'umask 027; exec "$@"', "sh",
         python, "-m", "trainwatch", "train", "--nproc-per-node", "2",
         "--run-dir", str(run_dir), "--steps", "100000",
         "--set", "telemetry.heartbeat_interval=0.2", "--set", "train.eval_interval=0",
         "--set", "checkpoint.every_steps=50", "--set", "checkpoint.fsync=false"],
        env=env, cwd=home, stdout=open(base / "train.log", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    config = base / "agent.yaml"
    config.write_text(f"proc_root: {base / 'proc'}\ncollectors:\n  ranks: {{interval: 0.5}}\n"
                      "  storage: {probe: false}\n")
    config.chmod(0o644)
    port = free_port()
    agent = subprocess.Popen(
        [*unit_setpriv(), python, "-m", "trainwatch", "agent", "--config", str(config),
         "--listen", f"127.0.0.1:{port}", "--run-dir", str(run_dir)],
        env={**env, "HOME": "/"}, cwd="/", stdout=open(base / "agent.log", "wb"),
        stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_get(url + "/healthz") == b"ok\n", 60,
                 what=f"agent /healthz: {(base / 'agent.log').read_text()[-2000:]}")
        me = psutil.Process(agent.pid)
        assert me.uids().effective == agent_uid and me.gids().effective == agent_gid

        # 1. Both ranks and their processes seen, as another user, through the group.
        def both_ranks():
            jobs = get_json(url + "/status")["jobs"]
            ranks = jobs[0]["ranks"] if jobs else []
            return len(ranks) == 2 and all(
                r["state"] == "running" and (r["process"] or {}).get("status")
                in ("running", "sleeping", "disk_sleep") for r in ranks) and jobs[0]
        try:
            job = wait_for(both_ranks, 120, interval=0.5, what="both ranks seen by the agent")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{(base / 'train.log').read_text()[-3000:]}\n"
                                 f"{(base / 'agent.log').read_text()[-3000:]}") from None
        assert job["unreadable"] == []
        status = get_json(url + "/status")
        assert not any("permission" in r for r in status["health_reasons"])
        text = http_get(url + "/metrics").decode()
        assert _metric(text, "trainwatch_collector_run_files_unreadable", run="exp1") == 0
        # Under hidepid=invisible only CAP_SYS_PTRACE (read mode) shows the job's processes.
        for rank in ("0", "1"):
            assert _metric(text, "trainwatch_process_threads", run="exp1", rank=rank) >= 1
        status_file = run_dir / "status" / "rank-00000.json"
        st = status_file.stat()
        assert st.st_uid == job_uid and st.st_gid == agent_gid and st.st_mode & 0o777 == 0o640
        assert run_dir.stat().st_mode & 0o2000  # setgid, inherited from the runs root

        # 2. The group's permission taken away: unseen, said so.
        (run_dir / "status").chmod(0o2700)
        (run_dir / "run.json").chmod(0o600)

        def degraded():
            doc = get_json(url + "/status")
            reasons = [r for r in doc["health_reasons"] if "permission denied" in r]
            return doc["health"] != "ok" and reasons and doc
        doc = wait_for(degraded, 60, what="health degraded by permission denied")
        assert len(doc["jobs"][0]["unreadable"]) == 2 and doc["jobs"][0]["ranks"] == []
        assert http_get(url + "/healthz") == b"ok\n"  # degraded, not dead: no restart loop
        text = wait_for(lambda: (t := http_get(url + "/metrics").decode()) and _metric(
            t, "trainwatch_collector_run_files_unreadable", run="exp1") == 2 and t, 10,
            what="/metrics with the unreadable files")  # it may serve a body 1 s old
        assert _metric(text, "trainwatch_collector_status_files_skipped_total", run="exp1",
                       reason="permission_denied") >= 1

        # 3. The alert fires, from the agent's own /metrics.
        from trainwatch.alerts.engine import Engine
        from trainwatch.alerts.evaluate import History
        from trainwatch.alerts.rules import load_rules
        from trainwatch.alerts.scrape import Scraper
        thresholds = base / "thresholds.yaml"
        thresholds.write_text("run_unreadable_for: 0s\n")
        history = History()
        engine = Engine(load_rules(thresholds_file=thresholds), history,
                        runbook_base="https://example.org/runbooks/")
        scraper = Scraper(history, [url])

        def fired():
            t = time.time()
            scraper.scrape_all(t)
            engine.evaluate(t)
            return [a for a in engine.firing() if a.name == "TrainwatchRunUnreadable"]
        alert = wait_for(fired, 30, interval=1, what="TrainwatchRunUnreadable firing")[0]
        assert alert.labels["run"] == "exp1" and alert.labels["severity"] == "warning"
        assert alert.annotations["runbook_url"].endswith("/runbooks/TrainwatchRunUnreadable.md")
        log = (base / "agent.log").read_text()
        assert "Traceback" not in log and log.count("ermission denied") <= 2, log[-2000:]
    finally:
        stop_process(agent)
        kill_tree(train)
