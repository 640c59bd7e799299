"""The shipped deployment, verbatim, end to end, as an SRE installs it (issue #22).

docs/deploy.md's commands, as root: the agent's user and group, the `trainwatch-jobs`
group of the users who run jobs, the runs root (`3750 root:trainwatch` and an ACL for
`trainwatch-jobs`), the token files (one for the receivers, one for Alertmanager's user),
`deploy/agent.yaml` as /etc/trainwatch/agent.yaml and the rules exported to where
`deploy/prometheus/prometheus.yml` loads them. Only ports change in the shipped files.

* the agent runs as the systemd unit's User/Group/capabilities (setpriv);
* Prometheus and Alertmanager run as Debian's `prometheus` user, with the shipped
  timings; the people-facing webhooks go to a sink here that counts pages and tickets;
* job A (user `twjob`) is a Slurm job: the prolog (root) makes its run directory, the
  task prolog (as the job's user) gives its environment, and the job's receiver (as the
  job's user) runs `trainwatch train`;
* job B (user `twjob2`) runs outside Slurm in a run directory it makes itself, then stops
  cleanly (SIGTERM: checkpoint, stop) and stays in the watched folder.

A rank of A freezes (SIGSTOP): the chain restarts A exactly once, the job starting again
within 20 s of the freeze (the timeline to the first resumed step, 30 s on an idle
machine, is printed with the load average), nobody is paged or ticketed
(not for A's restart, not for B's clean stop), no storage probe fails, and the torchrun
stores listen on loopback only.
"""

from __future__ import annotations

import contextlib
import datetime
import grp
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
import yaml

from agent_helpers import REPO, free_port, get_json, http_get, stop_process, wait_for
from conftest import kill_tree
from deploy_configs import ALERTMANAGER_YML, PROMETHEUS_YML, unit_service_settings, unit_setpriv
from users_helpers import _ensure_user, _python_for_others
from trainwatch.alerts.promql import parse_duration
from trainwatch.rundir.run_dir import RunDir

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in (
        "setpriv", "useradd", "groupadd", "setfacl", "prometheus", "ss")) or not ALERTMANAGER,
    reason="needs root, setpriv, useradd, setfacl, ss, prometheus and alertmanager")]

JOB_A_USER, JOB_B_USER, JOBS_GROUP = "twjob", "twjob2", "trainwatch-jobs"
PROMETHEUS_USER = "prometheus"  # Debian's packages run both servers as this user
RUNS_ROOT = Path("/var/lib/trainwatch/runs")
ARCHIVE = Path("/var/lib/trainwatch/finished")
AGENT_CONFIG = Path("/etc/trainwatch/agent.yaml")
RECEIVER_TOKEN = Path("/etc/trainwatch/receiver-token")
RULES = Path("/etc/prometheus/rules/trainwatch.yml")
SLURM = REPO / "deploy" / "slurm"
# Freeze -> first resumed step: the target with the shipped timings on an idle machine.
CHAIN_TARGET_SECONDS = 30.0
# Freeze -> the job started again: what the shipped timings decide (the agent's 5 s stall
# floor, a 5 s scrape, a 5 s evaluation, 1 s group_wait, the controller's 2 s look, the
# kill). The rest is the job's own start (torch imports, rendezvous, checkpoint load),
# which a loaded machine stretches: measured and printed, not asserted.
DETECT_BUDGET_SECONDS = 20.0


def _am_token_file() -> Path:
    hook = yaml.safe_load(ALERTMANAGER_YML.read_text())["receivers"][0]["webhook_configs"][0]
    return Path(hook["http_config"]["authorization"]["credentials_file"])


@contextlib.contextmanager
def _installed(path: Path, text: str, owner: str, group: str, mode: int):
    """Install a file as the docs say; put back what was there before."""
    path.parent.mkdir(parents=True, exist_ok=True)
    before = path.read_bytes() if path.exists() else None
    path.write_text(text)
    os.chown(path, pwd.getpwnam(owner).pw_uid, grp.getgrnam(group).gr_gid)
    path.chmod(mode)
    try:
        yield path
    finally:
        if before is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(before)


def _setup_users() -> None:
    """docs/deploy.md, step 1."""
    _ensure_user(unit_service_settings()["User"])
    for user in (JOB_A_USER, JOB_B_USER):
        _ensure_user(user)
    try:
        grp.getgrnam(JOBS_GROUP)
    except KeyError:
        subprocess.run(["groupadd", "--system", JOBS_GROUP], check=True)
    for user in (JOB_A_USER, JOB_B_USER):
        subprocess.run(["usermod", "-aG", JOBS_GROUP, user], check=True)
    pwd.getpwnam(PROMETHEUS_USER)


def _setup_runs_root() -> None:
    """docs/deploy.md, step 1: the agent's group reads, the jobs' group may create.
    Runs an interrupted earlier test left behind go first: their ranks are gone without
    finishing, so TrainingRankDown would rightly page for them in this test's window."""
    for left in [*RUNS_ROOT.glob("slurm-2?????"), *RUNS_ROOT.glob("expB-*")]:
        shutil.rmtree(left, ignore_errors=True)
    subprocess.run(["install", "-d", "-o", "root", "-g", "trainwatch", "-m", "3750",
                    str(RUNS_ROOT)], check=True)
    subprocess.run(["setfacl", "-m", f"g:{JOBS_GROUP}:rwx", str(RUNS_ROOT)], check=True)


def _as(user: str, *, umask: str = "027") -> list[str]:
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--",
            "sh", "-c", f'umask {umask}; exec "$@"', "sh"]


class _Sink(BaseHTTPRequestHandler):
    """The people-facing webhooks (pager, tickets): counts what would reach a person."""
    got: list[tuple[str, list[str]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Sink.got.append((self.path, [f"{a['labels'].get('alertname')}/{a['labels'].get('run')}"
                                      f"/{a['status']}" for a in body.get("alerts", [])]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _shipped_prometheus(path: Path, agent: int, receiver: int, am: int) -> None:
    """deploy/prometheus/prometheus.yml with its ports changed, nothing else."""
    text = PROMETHEUS_YML.read_text()
    for old, new in (("127.0.0.1:9093", am), ("127.0.0.1:9464", agent),
                     ("127.0.0.1:9465", receiver)):
        assert old in text
        text = text.replace(old, f"127.0.0.1:{new}")
    path.write_text(text)


def _shipped_alertmanager(path: Path, receiver: int, sink: int) -> None:
    text = ALERTMANAGER_YML.read_text()
    for old, new in (("127.0.0.1:9465", receiver), ("127.0.0.1:9999", sink)):
        assert old in text
        text = text.replace(old, f"127.0.0.1:{new}")
    path.write_text(text)


def _exports(lines: str) -> dict[str, str]:
    return dict(line.removeprefix("export ").split("=", 1) for line in lines.splitlines()
                if line.startswith("export "))


def _events(run_dir: Path, name: str) -> list[dict]:
    return RunDir(run_dir).events(name) if run_dir.exists() else []


def _status(run_dir: Path, rank: int) -> dict:
    try:
        return json.loads((run_dir / "status" / f"rank-{rank:05d}.json").read_text())
    except (OSError, ValueError):
        return {}


def _webhooks_sent(am_port: int) -> float:
    """Notifications Alertmanager delivered by webhook (the receiver's, the people's)."""
    text = http_get(f"http://127.0.0.1:{am_port}/metrics").decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('alertmanager_notifications_total{integration="webhook"}'))


def _actions_group_interval() -> float:
    """The shipped root route's group_interval (the receiver's route inherits it): when
    Alertmanager sends a group again."""
    return parse_duration(yaml.safe_load(ALERTMANAGER_YML.read_text())["route"]["group_interval"])


def _pages_due(prom: str, run: str, by: float) -> list[str]:
    """The run's pages and tickets pending now that fire before ``by`` if they last."""
    due = []
    for group in get_json(f"{prom}/api/v1/rules?type=alert")["data"]["groups"]:
        for rule in group["rules"]:
            for alert in rule["alerts"]:
                labels = alert["labels"]
                if labels.get("run") == run and labels.get("severity") in ("critical", "warning") \
                        and _unix(alert["activeAt"]) + rule["duration"] <= by:
                    due.append(f"{rule['name']} {alert['state']} since {alert['activeAt']}")
    return due


def _unix(stamp: str) -> float:
    """Prometheus's RFC 3339 time (nanoseconds, Z) as Unix seconds."""
    day, _, rest = stamp.rstrip("Z").partition(".")
    fraction = float("0." + (rest or "0")[:6])
    return datetime.datetime.fromisoformat(day).replace(
        tzinfo=datetime.timezone.utc).timestamp() + fraction


@pytest.fixture
def scratch():
    path = Path(tempfile.mkdtemp(prefix="tw-shipped-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_shipped_deployment_restarts_a_stalled_job_once_and_pages_nobody(scratch):
    _setup_users()
    _setup_runs_root()
    python, pythonpath = _python_for_others()
    token = secrets.token_hex(32)
    ports = {k: free_port() for k in ("agent", "receiver", "am", "prom", "sink")}
    job_a_id, job_b_name = f"{os.getpid() % 100000 + 200000}", f"expB-{os.getpid()}"
    run_a, run_b = RUNS_ROOT / f"slurm-{job_a_id}", RUNS_ROOT / job_b_name
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": pythonpath, "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    homes = {}
    for user in (JOB_A_USER, JOB_B_USER):
        homes[user] = scratch / user
        homes[user].mkdir()
        os.chown(homes[user], pwd.getpwnam(user).pw_uid, -1)
        # Short steps, frequent checkpoints: a restart resumes close to where it froze.
        (homes[user] / "train.yaml").write_text(
            "train: {eval_interval: 0}\ntelemetry: {heartbeat_interval: 0.5}\n"
            "checkpoint: {every_steps: 20, fsync: false}\n")
    _Sink.got = []
    sink = ThreadingHTTPServer(("127.0.0.1", ports["sink"]), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    procs: list[subprocess.Popen] = []

    def start(cmd, name, **kw):
        p = subprocess.Popen(cmd, stdout=open(scratch / f"{name}.log", "wb"),
                             stderr=subprocess.STDOUT, start_new_session=True, **kw)
        procs.append(p)
        return p

    def log(name: str) -> str:
        path = scratch / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    agent_yaml = (REPO / "deploy" / "agent.yaml").read_text()
    assert "listen: 127.0.0.1:9464\n" in agent_yaml
    with contextlib.ExitStack() as stack:
        # docs/deploy.md, steps 2-4: the shipped files, only their ports changed.
        stack.enter_context(_installed(AGENT_CONFIG, agent_yaml.replace(
            "listen: 127.0.0.1:9464\n", f"listen: 127.0.0.1:{ports['agent']}\n"),
            "root", "root", 0o644))
        stack.enter_context(_installed(RECEIVER_TOKEN, token, "root", JOBS_GROUP, 0o640))
        stack.enter_context(_installed(_am_token_file(), token, "root", PROMETHEUS_USER,
                                       0o640))
        rules = subprocess.run([sys.executable, "-m", "trainwatch", "alerts", "export",
                                "--format", "prometheus"], capture_output=True, text=True,
                               check=True).stdout
        stack.enter_context(_installed(RULES, rules, "root", "root", 0o644))
        stack.callback(lambda: [shutil.rmtree(p, ignore_errors=True) for p in (
            run_a, run_b, ARCHIVE / run_a.name)])
        stack.callback(sink.shutdown)
        stack.callback(lambda: [kill_tree(p) if p.poll() is None else None
                                for p in reversed(procs)])
        prom_dir = scratch / "prometheus"
        prom_dir.mkdir()
        shutil.chown(prom_dir, PROMETHEUS_USER, PROMETHEUS_USER)
        _shipped_prometheus(prom_dir / "prometheus.yml", ports["agent"], ports["receiver"],
                            ports["am"])
        _shipped_alertmanager(prom_dir / "alertmanager.yml", ports["receiver"], ports["sink"])
        as_prometheus = ["setpriv", f"--reuid={PROMETHEUS_USER}",
                         f"--regid={PROMETHEUS_USER}", "--init-groups", "--"]
        start([*as_prometheus, ALERTMANAGER, f"--config.file={prom_dir / 'alertmanager.yml'}",
               f"--storage.path={prom_dir / 'am-data'}", "--cluster.listen-address=",
               f"--web.listen-address=127.0.0.1:{ports['am']}"], "alertmanager")
        start([*as_prometheus, "prometheus", f"--config.file={prom_dir / 'prometheus.yml'}",
               f"--storage.tsdb.path={prom_dir / 'prom-data'}",
               f"--web.listen-address=127.0.0.1:{ports['prom']}"], "prometheus")
        # The systemd unit's ExecStart, as its User/Group with its capabilities.
        agent = start([*unit_setpriv(), python, "-m", "trainwatch", "agent", "--config",
                       str(AGENT_CONFIG)], "agent", env={**env, "HOME": "/"}, cwd="/")
        agent_url = f"http://127.0.0.1:{ports['agent']}"

        # Job A under Slurm: prolog as root, task prolog and job as the job's user.
        slurm = {**env, "SLURM_JOB_ID": job_a_id, "SLURM_JOB_NAME": "expA",
                 "SLURM_JOB_USER": JOB_A_USER}
        subprocess.run(["bash", str(SLURM / "prolog.sh")], env=slurm, check=True)
        task_env = _exports(subprocess.run(
            [*_as(JOB_A_USER), "bash", str(SLURM / "task_prolog.sh")], env=slurm, check=True,
            capture_output=True, text=True, cwd=homes[JOB_A_USER]).stdout)
        assert task_env["TRAINWATCH_RUN_DIR"] == str(run_a)
        receiver = start(
            [*_as(JOB_A_USER), python, "-m", "trainwatch", "alerts", "receive",
             "--run-dir", task_env["TRAINWATCH_RUN_DIR"], "--token-file", str(RECEIVER_TOKEN),
             "--listen", f"127.0.0.1:{ports['receiver']}", "--nproc-per-node", "2",
             "--config", "train.yaml", "--steps", "100000"], "receiver-A",
            env={**env, **slurm, **task_env, "HOME": str(homes[JOB_A_USER])},
            cwd=homes[JOB_A_USER])
        # Job B outside Slurm, in a run directory its user makes in the runs root.
        job_b = start(
            [*_as(JOB_B_USER), python, "-m", "trainwatch", "train", "--nproc-per-node", "2",
             "--run-dir", str(run_b), "--config", "train.yaml", "--steps", "100000"], "job-B",
            env={**env, "HOME": str(homes[JOB_B_USER])}, cwd=homes[JOB_B_USER])

        try:
            wait_for(lambda: http_get(agent_url + "/healthz") == b"ok\n", 60, what="agent")

            def stepping(run_dir: Path, step: int):
                return all(_status(run_dir, r).get("step", 0) >= step for r in (0, 1))
            wait_for(lambda: stepping(run_a, 45) and stepping(run_b, 25), 150, interval=0.5,
                     what="both jobs past a checkpoint")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nA: {log('receiver-A')}\nB: {log('job-B')}\n"
                                 f"agent: {log('agent')}") from None

        # Permissions as documented: the job's user owns, the agent's group reads.
        for run_dir, user in ((run_a, JOB_A_USER), (run_b, JOB_B_USER)):
            st = (run_dir / "status" / "rank-00000.json").stat()
            assert st.st_uid == pwd.getpwnam(user).pw_uid
            assert st.st_gid == grp.getgrnam("trainwatch").gr_gid and st.st_mode & 0o007 == 0
        # One name per run (item 1): the directory's, in run.json, the status, the receiver.
        assert json.loads((run_a / "run.json").read_text())["job"] == run_a.name
        assert _status(run_a, 0)["job"] == run_a.name
        # Item 6: every listening socket of the jobs' processes is on loopback.
        listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
        job_pids = {p.pid for root in (receiver.pid, job_b.pid)
                    for p in [psutil.Process(root), *psutil.Process(root).children(True)]}
        wide = [line for line in listening.splitlines()
                if any(f"pid={pid}," in line for pid in job_pids)
                and not line.split()[3].startswith(("127.0.0.1:", "[::1]:"))]
        assert not wide, f"job sockets listening beyond loopback:\n{listening}"

        # Job B stops cleanly: SIGTERM, checkpoint, stop; its run stays where the agent looks.
        job_b.send_signal(signal.SIGTERM)
        job_b.wait(timeout=60)
        b_stopped = time.time()
        assert [_status(run_b, r).get("state") for r in (0, 1)] == ["stopped", "stopped"], \
            log("job-B")

        # Job A: a rank freezes.
        starts_before = len(_events(run_a, "job_started"))
        old_ranks = [_status(run_a, r)["pid"] for r in (0, 1)]
        assert all(psutil.pid_exists(pid) for pid in old_ranks) and starts_before == 1
        os.kill(old_ranks[1], signal.SIGSTOP)
        frozen = time.time()

        def resumed():
            status = _status(run_a, 0)
            if status.get("pid") in old_ranks or not status.get("pid"):
                return None
            back = _events(run_a, "checkpoint_resumed")
            from_step = back[-1]["step"] if back else 0
            return status.get("step", 0) > from_step and time.time()
        try:
            first_step = wait_for(resumed, 120, interval=0.1, what="job A's first resumed step")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nA: {log('receiver-A')}\nagent: {log('agent')}\n"
                                 f"alertmanager: {log('alertmanager')}") from None
        taken = _events(run_a, "action_taken")
        restarted = _events(run_a, "job_started")[-1]["time"]
        assert len(taken) == 1 and taken[0]["alert"] == "TrainingStallSuspected"
        assert taken[0]["labels"]["run"] == run_a.name

        # Until Alertmanager has sent A's alert group to the receiver again (its
        # group_interval after the first: the stall's resolution, answered without acting).
        wait_for(lambda: _webhooks_sent(ports["am"]) >= 2
                 and time.time() > taken[0]["time"] + _actions_group_interval(), 150,
                 interval=1, what="Alertmanager's second notification of A's group")
        prom = f"http://127.0.0.1:{ports['prom']}"
        alerts = get_json(f"{prom}/api/v1/alerts")["data"]["alerts"]
        firing = sorted(f"{a['labels']['alertname']}/{a['labels'].get('run')}"
                        for a in alerts if a["state"] == "firing")
        assert len(_events(run_a, "job_started")) == 2, "exactly one restart"
        assert len(_events(run_a, "action_taken")) == 1
        assert _Sink.got == [], f"paged or ticketed: {_Sink.got}; firing: {firing}"
        # Pages on their way: B's clean stop made no page or ticket even pending (a stop
        # seen as "down" would be pending within a scrape and an evaluation, and page after
        # TrainingRankDown's 1 min); of A's, none pending since long enough to page before
        # the 95 s after B's stop this test used to wait out.
        query = urllib.parse.quote(f'ALERTS{{run="{run_b.name}",severity=~"critical|warning"}}'
                                   f'[{int(time.time() - b_stopped) + 5}s]')
        ever = get_json(f"{prom}/api/v1/query?query={query}")["data"]["result"]
        assert ever == [], [r["metric"] for r in ever]
        coming = _pages_due(prom, run_a.name, by=b_stopped + 95)
        assert coming == [], coming
        # No false storage ticket on its way: the jobs' 0750 run dirs are skipped, not failed.
        query = urllib.parse.quote('trainwatch_storage_probe_success{role="run"} == 0')
        failed = get_json(f"{prom}/api/v1/query?query={query}")["data"]["result"]
        assert failed == [], failed
        query = urllib.parse.quote('trainwatch_storage_probe_skipped{role="run"} == 1')
        assert get_json(f"{prom}/api/v1/query?query={query}")["data"]["result"]
        # B's alerts never reach A's journal (item 5), nor anyone's.
        journal = (run_a / "journal.jsonl").read_text()
        assert run_b.name not in journal
        assert receiver.poll() is None and agent.poll() is None

        # Slurm's epilog (root) moves A's run out of the watched folder.
        stop_process(receiver)
        subprocess.run(["bash", str(SLURM / "epilog.sh")], env=slurm, check=True)
        assert not run_a.exists() and (ARCHIVE / run_a.name / "status").is_dir()

    took, detect = first_step - frozen, restarted - frozen
    print(f"\nchain timeline (shipped timings, load average {os.getloadavg()[0]:.1f}): "
          f"freeze 0.0 s; receiver acted {taken[0]['time'] - frozen:.1f} s; job started "
          f"again {detect:.1f} s; first resumed step {took:.1f} s (target "
          f"{CHAIN_TARGET_SECONDS:.0f} s); firing at the end: {firing}")
    assert detect <= DETECT_BUDGET_SECONDS, f"freeze -> job started again took {detect:.1f} s"
