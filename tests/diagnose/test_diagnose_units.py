"""diagnose's analysis, redaction and agent handling on fixture data (no training processes)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent_helpers import wait_for

from trainwatch.diagnose import analysis, collectives
from trainwatch.diagnose.gather import Options, gather
from trainwatch.diagnose.rules import outside_collective
from trainwatch.diagnose.run_state import launcher_exits
from trainwatch.diagnose.model import Evidence
from trainwatch.redact import MASK, redact, redact_env, redact_text
from trainwatch.rundir.run_dir import RunDir


def entry(op, size, t):
    return {"op": f"gloo:{op}", "sizes": [[size]], "dtypes": ["Float"], "created_ns": t,
            "frames": []}


def rank_view(ops, last_completed):
    entries = {seq: entry(op, size, seq * 10**9 + late) for seq, (op, size, late) in ops.items()}
    return {"last_enqueued": max(entries), "last_completed": last_completed, "entries": entries}


def test_missing_rank_and_waiting_ranks():
    ops = {1: ("all_reduce", 10, 0), 2: ("all_reduce", 10, 0)}
    group = {"desc": "default_pg", "per_rank": {
        0: rank_view({**ops, 3: ("all_reduce", 10, 0)}, 2),
        1: rank_view(ops, 2),
        2: rank_view({**ops, 3: ("all_reduce", 10, 0)}, 2)}}
    a = collectives.analyse_group(group)
    assert a["frontier"] == 3 and a["waiting"] == [0, 2]
    assert a["behind"] == {1: {"last_enqueued": 2, "last_completed": 2, "in_collective": False}}
    assert a["mismatch"] is None
    assert a["frontier_op"] == "gloo:all_reduce sizes=[[10]] dtype=Float"


def test_mismatch_names_the_sequence_number_and_the_novel_op():
    ops = {s: ("all_reduce", 10, 0) for s in range(1, 5)}
    group = {"desc": "", "per_rank": {
        0: rank_view({**ops, 5: ("all_reduce", 10, 0)}, 4),
        1: rank_view({**ops, 5: ("barrier", 1, 0)}, 4)}}
    mismatch = collectives.analyse_group(group)["mismatch"]
    assert mismatch["seq"] == 5 and mismatch["novel"] == [1]
    assert mismatch["ops"][1].startswith("gloo:barrier")


def test_lateness_finds_the_rank_that_enters_collectives_last():
    group = {"desc": "", "per_rank": {
        r: rank_view({s: ("all_reduce", 10, late) for s in range(1, 20)}, 19)
        for r, late in ((0, 1000), (1, 90_000_000), (2, 0))}}
    late = collectives.analyse_group(group)["lateness"]
    assert late[1] == pytest.approx(0.09) and late[2] == 0 and late[0] < 0.001


@pytest.mark.parametrize("text,secret", [
    ("WANDB_API_KEY=abc123def456", "abc123def456"),
    ('{"hf_token": "hf_abcdefghijklmnopqrstuv"}', "hf_abcdefghijklmnopqrstuv"),
    ("postgres://bob:s3cretpw@db:5432/x", "s3cretpw"),
    ("Authorization: Bearer abcdefghijklmnop", "abcdefghijklmnop"),
    ("aws key AKIAABCDEFGHIJKLMNOP here", "AKIAABCDEFGHIJKLMNOP"),
    ("password: hunter2", "hunter2"),
])
def test_redact_text_masks_secrets(text, secret):
    out = redact_text(text)
    assert secret not in out and MASK in out


def test_redaction_keeps_ordinary_values():
    text = "step=41 loss=3.2 tokens=4096 token expired at step 3"
    assert redact_text(text) == text
    data = {"tokens": 4096, "tokens_per_second": 1.5, "config": {"db_password": "x", "lr": 0.1}}
    assert redact(data) == {"tokens": 4096, "tokens_per_second": 1.5,
                            "config": {"db_password": MASK, "lr": 0.1}}
    assert redact_env({"NCCL_DEBUG": "INFO", "GITHUB_TOKEN": "ghp_x"}) == {
        "NCCL_DEBUG": "INFO", "GITHUB_TOKEN": MASK}


AGENT_STATUS = {
    "format": "trainwatch.agent.status", "version": 1, "node": "node-b", "time": 0,
    "health": "critical", "health_reasons": ["GPU 0 XID 79"],
    "jobs": [{"job": "exp", "ranks": [{"rank": 1, "process": {"status": "disk_sleep"}}]}],
    "findings": [{"id": "gpu_xid/node-b/0", "kind": "gpu_xid", "severity": "critical",
                  "node": "node-b", "rank": 1, "message": "GPU 0: XID 79 (fallen off the bus)",
                  "evidence": ["xid 79 at 10:07:09"]}],
    "collectors": {"network": {"state": "timeout", "reason": "still running after 5 s"}},
    "node_health": {"storage": [{"path": "/ckpt", "probe": {"ok": False, "seconds": 10.0,
                                                            "error": "timed out"}}]},
}


@pytest.fixture
def agent_url():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's naming
            body = json.dumps(AGENT_STATUS).encode() if self.path == "/status" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # A client that gives up between select() and accept() must not leave serve_forever
    # blocked in accept() (shutdown() would then wait forever).
    server.socket.settimeout(1.0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_node_evidence_from_agents_and_honest_gaps(tmp_path, agent_url):
    run = RunDir(tmp_path).create()
    now = time.time()
    base = {"job": "exp", "world_size": 2, "state": "running", "step": 7, "phase": "forward",
            "phase_since": now - 1, "last_progress_at": now - 1, "heartbeat_at": now,
            "started_at": now}
    run.write_status(0, {**base, "rank": 0, "node": socket.gethostname(), "pid": os.getpid(),
                         "started_at": now})
    run.write_status(1, {**base, "rank": 1, "node": "node-b", "pid": 4242})
    (run.status_dir / "rank-00002.json").write_text('{"format": "trainwatch.status", "vers')
    dead_agent = f"http://127.0.0.1:{closed_port()}"
    # Generous timeout: the live fake agent must answer even on a loaded CI machine
    # (the dead one is refused at once either way).
    ev = gather(run, Options(agent_urls=[agent_url, dead_agent], timeout=20,
                             request_dumps=False))
    found = analysis.analyse(ev)
    gpu = next(f for f in found if f.category == "gpu_fault")
    assert gpu.ranks == [1] and gpu.nodes == ["node-b"] and gpu.runbook == "GPUXidErrors"
    storage = {f.title: f for f in found if f.category == "storage"}
    assert "node node-b: storage probe failed on /ckpt" in storage
    # node-b's agent says rank 1 is in D state: this host cannot see it, the agent can.
    assert ev.ranks[1]["process"]["status"] == "disk_sleep"
    d_state = storage["rank 1 is blocked in uninterruptible I/O (D state)"]
    assert d_state.next_command.startswith("ssh node-b cat /proc/4242/stack")
    unseen = "\n".join(ev.unseen)
    assert "node(s) ['node-b']" in unseen and f"agent {dead_agent}: unreachable" in unseen
    assert "collector network timeout" in unseen
    assert any("rank-00002.json" in s for s in ev.skipped)


def test_missing_py_spy_is_reported_not_guessed(tmp_path, monkeypatch):
    run = RunDir(tmp_path).create()
    now = time.time()
    run.write_status(0, {"job": "exp", "rank": 0, "world_size": 1, "state": "running",
                         "node": socket.gethostname(), "pid": os.getpid(), "started_at": now,
                         "heartbeat_at": now, "last_progress_at": now, "step": 1,
                         "phase": "forward", "phase_since": now})
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy on it
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))  # nor next to Python
    ev = gather(run, Options(timeout=1, request_dumps=False))
    assert ev.ranks[0]["process"]["status"] in ("running", "sleeping")
    assert any("py-spy is not installed" in line for line in ev.unseen)
    assert ev.stacks == {}


def test_py_spy_errors_are_explained():
    from trainwatch.diagnose.stacks import _reason
    assert _reason("Permission Denied: Try running again with elevated permissions") == \
        "no permission to attach (ptrace; run as the job's user or root)"
    assert _reason("Error: Failed to get stack traces\n\nCaused by:\n    0: Failed to suspend "
                   "process\n") == "Failed to get stack traces (Failed to suspend process)"


@pytest.fixture
def prometheus_url(tmp_path):
    """A real Prometheus on 127.0.0.1 with one always-firing alert for job "exp"."""
    (tmp_path / "rules.yml").write_text(
        "groups:\n- name: t\n  interval: 1s\n  rules:\n"
        "  - alert: TrainingStalled\n    expr: vector(1)\n    labels: {run: exp}\n")
    (tmp_path / "prometheus.yml").write_text(
        "global: {evaluation_interval: 1s}\nrule_files: [rules.yml]\n")
    port = closed_port()
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        query = urllib.parse.quote('ALERTS{alertstate="firing"}')

        def firing() -> list:
            with urllib.request.urlopen(f"{url}/api/v1/query?query={query}", timeout=2) as r:
                return json.loads(r.read())["data"]["result"]

        wait_for(firing, 60, interval=0.5, what="Prometheus to fire the test alert")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_firing_alerts_from_a_real_prometheus(tmp_path, prometheus_url):
    run = RunDir(tmp_path / "run").create()
    run.write_run_info({"job": "exp", "world_size": 1})
    now = time.time()
    run.write_status(0, {"job": "exp", "rank": 0, "world_size": 1, "state": "running",
                         "node": socket.gethostname(), "pid": os.getpid(), "started_at": now,
                         "heartbeat_at": now, "last_progress_at": now, "step": 1,
                         "phase": "forward", "phase_since": now})
    ev = gather(run, Options(prometheus_url=prometheus_url, timeout=5, request_dumps=False))
    assert not [line for line in ev.unseen if "Prometheus" in line], ev.unseen
    alerts = next(f for f in analysis.analyse(ev) if f.category == "alerts")
    assert alerts.title == "alerts firing: TrainingStalled" and alerts.severity == "info"


@pytest.mark.parametrize("frames,phase,where", [
    ([("torch/utils/data/dataloader.py", "_next_data"), ("job.py", "__getitem__")], "data",
     "data loading"),
    ([("train.py", "step"), ("threading.py", "acquire")], "forward",
     "a lock or condition (possible deadlock)"),
    ([("train.py", "step"), ("torch/cuda/__init__.py", "synchronize")], "backward",
     "GPU work (device synchronisation)"),
    ([("train.py", "save"), ("torch/serialization.py", "_save")], "checkpoint", "file I/O"),
    ([], "checkpoint", "file I/O (checkpoint)"),
    ([("train.py", "compute")], "forward", "phase 'forward' (see its stack)"),
])
def test_locate_where_a_rank_is(frames, phase, where):
    stack = [{"file": f, "line": 1, "function": fn} for f, fn in frames]
    assert outside_collective.locate(phase, stack) == where


def test_a_rank_waiting_in_another_group_is_followed():
    world = {"desc": "default_pg", "per_rank": {
        0: rank_view({1: ("all_reduce", 10, 0), 2: ("all_reduce", 10, 0)}, 1),
        1: rank_view({1: ("all_reduce", 10, 0)}, 1)}}
    sub = {"desc": "tp", "per_rank": {
        1: rank_view({1: ("all_gather", 4, 0)}, 0)}}  # its peer in "tp" never came
    ev = Evidence(run_dir="r", collected_at=100.0, host="h")
    for rank in (0, 1):
        ev.ranks[rank] = {"rank": rank, "state": "running", "node": "h", "pid": 10 + rank,
                          "progress_age": 60.0, "heartbeat_age": 0.1, "phase": "backward",
                          "process": {"status": "sleeping", "visible": True}}
    ev.collectives["groups"] = {"0": world, "5": sub}
    found = analysis.analyse(ev)
    assert found[0].ranks == [1]
    assert found[0].title == ("rank 1 waits in collective #1 of process group 5 while the "
                              "others wait for it")


def _blocked_child(code: str, *args: str, kind: str, **kwargs):
    """A Python child that blocks in the kernel; waits until its main thread's wait is of
    ``kind`` (on its way there it may be in others: a page fault at start-up is disk I/O)."""
    import subprocess
    import sys
    import time
    from trainwatch.host.procinfo import thread_waits
    child = subprocess.Popen([sys.executable, "-c", code, *args], **kwargs)
    deadline = time.time() + 30
    main = None
    while time.time() < deadline:
        waits = thread_waits(child.pid)
        main = next((t for t in waits if t["tid"] == child.pid), None)
        if main and main["wait"] and main["wait"]["kind"] == kind:
            return child, main
        time.sleep(0.05)
    child.kill()
    raise AssertionError(f"child never blocked on a {kind}; last seen: {main}")


def test_kernel_wait_on_a_pipe_and_a_tcp_socket_names_the_other_end():
    import os
    import socket
    import subprocess
    read_end, write_end = os.pipe()
    child, main = _blocked_child(f"import os; os.read({read_end}, 1)", pass_fds=[read_end],
                                 kind="pipe")
    try:
        wait = main["wait"]
        assert wait["kind"] == "pipe" and wait["direction"] == "read"
        assert os.getpid() in {p["pid"] for p in wait["peers"]}  # we hold the write end
    finally:
        child.kill()
        child.wait()
        os.close(read_end)
        os.close(write_end)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    child, main = _blocked_child(
        "import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
        "s.recv(1)", str(port), kind="socket", stdout=subprocess.DEVNULL)
    try:
        conn, _ = server.accept()  # until accepted, our end has no socket (no inode) to find
        from trainwatch.host.procinfo import thread_waits
        wait = next(t for t in thread_waits(child.pid) if t["tid"] == child.pid)["wait"]
        assert wait["kind"] == "socket" and wait["protocol"] == "tcp", wait
        assert wait["remote"] == f"127.0.0.1:{port}"
        assert wait["peer"]["pid"] == os.getpid(), wait
        conn.close()
    finally:
        child.kill()
        child.wait()
        server.close()


def test_proc_locks_and_lock_source_parsing(tmp_path):
    from trainwatch.diagnose import locks
    from trainwatch.host import procinfo
    (tmp_path / "locks").write_text(
        "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1311 0 EOF\n"
        "1: -> FLOCK  ADVISORY  WRITE 4343 fd:01:1311 0 EOF\n"
        "2: OFDLCK ADVISORY  READ  -1 00:2d:7 0 EOF\n"
        "garbage \x00\xff line\n3: POSIX\n")
    parsed = procinfo.read_locks(str(tmp_path))
    assert [(lk["pid"], lk["blocked"], lk["inode"]) for lk in parsed] == [
        (4242, False, 1311), (4343, True, 1311), (-1, False, 7)]
    wait = procinfo.classify_wait(4343, "flock", [], "locks_lock_inode_wait", "S", parsed,
                                  str(tmp_path))
    assert wait["kind"] == "file_lock" and wait["holder"]["pid"] == 4242
    source = tmp_path / "job.py"
    source.write_text("def f():\n    with self.a:\n        x = 1\n        self.b.acquire()\n")
    assert locks.frame_locks(str(source), 4, innermost=True) == ([("self.a", 2)], "self.b")
    assert locks.frame_locks(str(source), 2, innermost=True) == ([], "self.a")
    (tmp_path / "bad.py").write_bytes(b"\xff\x00 not python (")
    assert locks.frame_locks(str(tmp_path / "bad.py"), 1, innermost=True) == ([], None)
    assert locks.frame_locks(None, None, innermost=True) == ([], None)
    assert procinfo._addr("0100007F:1F90") == "127.0.0.1:8080"


def test_heartbeats_order_deaths_only_beyond_one_interval():
    from trainwatch.diagnose.rules.dead import order_by_heartbeat
    from trainwatch.diagnose.model import Evidence
    ev = Evidence(run_dir="/r", collected_at=1000.0, host="h")
    ev.ranks = {0: {"heartbeat_at": 900.000000, "heartbeat_interval": 0.2},
                1: {"heartbeat_at": 900.000037, "heartbeat_interval": 0.2}}
    tied, why = order_by_heartbeat(ev, [0, 1])
    assert tied == [0, 1] and "37 µs apart" in why and "cannot be told" in why
    ev.ranks[1]["heartbeat_at"] = 903.0
    first, why = order_by_heartbeat(ev, [0, 1])
    assert first == [0] and "stopped first" in why
    ev.ranks = {0: {"heartbeat_at": 900.0}, 1: {"heartbeat_at": 900.5}}  # interval unknown: 1 s
    assert order_by_heartbeat(ev, [0, 1])[0] == [0, 1]


def test_memory_cgroup_facts_v1_and_v2(tmp_path):
    """The rank's memory cgroup from /proc/PID/cgroup, then its limit and OOM kills from
    memory.events (v2) or memory.oom_control (v1); a missing cgroup is None, not a guess."""
    from trainwatch.host.cgroup import memory_cgroup, memory_facts
    proc = tmp_path / "proc" / "42"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("0::/job.slice/train\n")
    assert memory_cgroup(42, str(tmp_path / "proc")) == "v2:/job.slice/train"
    v2 = tmp_path / "cg" / "job.slice" / "train"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text("1073741824\n")
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n")
    assert memory_facts("v2:/job.slice/train", str(tmp_path / "cg")) == {
        "cgroup": "/job.slice/train", "dir": str(v2), "limit_bytes": 1 << 30, "oom_kills": 1}
    (proc / "cgroup").write_text("5:devices:/\n4:memory:/batch/7\n0::/\n")
    assert memory_cgroup(42, str(tmp_path / "proc")) == "v1:/batch/7"
    v1 = tmp_path / "cg" / "memory" / "batch" / "7"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    facts = memory_facts("v1:/batch/7", str(tmp_path / "cg"))
    assert facts["limit_bytes"] is None and facts["oom_kills"] == 2
    assert memory_facts("v2:/gone", str(tmp_path / "cg"))["dir"] is None


def test_oom_without_a_readable_kernel_log_is_said_and_not_certain():
    """Not root with kernel.dmesg_restrict=1: the kernel log cannot be read. That is said,
    and a cgroup that counted an OOM kill makes it "most likely", at medium confidence."""
    import sys
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"):
        pytest.skip("needs root to switch to an unprivileged user")
    if open("/proc/sys/kernel/dmesg_restrict").read().strip() != "1":
        pytest.skip("kernel.dmesg_restrict is 0 here: the kernel log is readable by all")
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         "import json; from trainwatch.host.cgroup import kernel_oom_kills; "
         "print(json.dumps(kernel_oom_kills()))"], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), timeout=60)
    kernel = json.loads(done.stdout)
    assert "needs privileges" in kernel["error"], kernel
    ev = Evidence(run_dir="/r", collected_at=time.time(), host="h")
    ev.ranks[1] = {"rank": 1, "pid": 42, "node": "h", "state": "running", "step": 9,
                   "process": {"status": "gone"},
                   "oom": {"cgroup": "/job", "limit_bytes": 1 << 30, "oom_kills": 1,
                           "kernel": None, "kernel_error": kernel["error"]}}
    ev.launcher = {"failed": [{"exitcode": -9, "local_rank": 1, "pid": 42, "log": "l"}],
                   "root_cause": {"rank": 1, "local_rank": 1, "exitcode": -9, "pid": 42,
                                  "log": "l"}, "failures": []}
    dead = next(f for f in analysis.analyse(ev) if f.category == "rank_dead")
    assert dead.title == ("rank 1 was killed by SIGKILL, most likely by the OOM killer "
                          "(cgroup /job, limit 1.00 GiB)"), dead.title
    assert dead.confidence == "medium"
    assert any("kernel log not readable" in e for e in dead.evidence), dead.evidence


def test_the_first_error_is_the_newest_attempts_not_one_the_run_recovered_from(tmp_path):
    """The supervisor marks each attempt in job.log; diagnose quotes the newest attempt's
    first error (and each rank's), not an earlier attempt's that was already recovered."""
    from trainwatch.contract.env import LAUNCH_ENV
    from trainwatch.control.controller import JobController

    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        f"attempt = int(os.environ['{LAUNCH_ENV}'])\n"
        "if attempt == 1:\n"
        "    print('[rank1]: ValueError: bad shard in attempt one', flush=True)\n"
        "else:\n"
        "    print('[rank0]: RuntimeError: out of host memory in attempt two', flush=True)\n"
        "sys.exit(1)\n")
    c = JobController(tmp_path / "run", [sys.executable, str(script)], stop_grace_seconds=3)
    try:
        for reason in ("start", "restart (job exited with 1)"):
            c.start(reason)
            assert c.proc.wait(30) == 1
    finally:
        if c.alive():
            c.stop("test teardown")
    log = (c.run.logs_dir / "job.log").read_text()
    assert log.count("=== trainwatch: attempt ") == 2 and "attempt 2 started at" in log
    found = launcher_exits(c.run.logs_dir)
    assert found["first_error"]["line"].endswith("out of host memory in attempt two")
    assert found["first_error"]["rank"] == 0
    assert found["errors_by_rank"] == {0: "[rank0]: RuntimeError: out of host memory in "
                                          "attempt two"}


def test_torchruns_own_restart_of_the_worker_group_begins_an_attempt(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "torchrun.log").write_text(
        "[rank1]: ValueError: first\n"
        "[W1204 10:00:00 api.py:944] [default] Worker group FAILED. 1/1 attempts left; will "
        "restart worker group\n"
        "[rank1]: RuntimeError: Connection reset by peer\n")
    found = launcher_exits(logs)
    assert found["first_error"]["line"] == "[rank1]: RuntimeError: Connection reset by peer"


def test_a_rank_failed_by_its_peer_s_death_is_not_named_with_the_one_that_raised():
    """An own loop's ranks both record ``failed`` (telemetry's hook, no torchrun log): rank 1
    raised, rank 0's error is gloo's "Connection closed by peer" from the all-reduce. Rank 1
    is the culprit; rank 0 followed (not a second dead rank with high confidence)."""
    ev = Evidence(run_dir="/r", collected_at=time.time(), host="h")
    errors = {0: "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1. This "
                 "is typically caused by a remote worker crashing.",
              1: "RuntimeError: a bug in the loss at step 30"}
    for rank, error in errors.items():
        ev.ranks[rank] = {"rank": rank, "pid": 40 + rank, "node": "h", "state": "failed",
                          "phase": "failed", "step": 30,
                          "failure": {"kind": "error", "message": error},
                          "process": {"status": "gone"}}
    dead = [f for f in analysis.analyse(ev) if f.category == "rank_dead"]
    assert [f.ranks for f in dead] == [[1]], [(f.ranks, f.title) for f in dead]
    assert any("a bug in the loss" in e for e in dead[0].evidence), dead[0].evidence
    assert any("rank(s) [0]" in e for e in dead[0].evidence), dead[0].evidence


def test_a_killed_rank_is_the_culprit_not_the_peer_that_failed_reading_from_it():
    """Rank 1 was SIGKILLed (its status still says running, its process is gone); rank 0's
    telemetry recorded ``failed`` with gloo's "Connection reset by peer" from the collective
    it was in. Rank 1 is the culprit, rank 0 a follower."""
    ev = Evidence(run_dir="/r", collected_at=time.time(), host="h")
    ev.ranks[0] = {"rank": 0, "pid": 40, "node": "h", "state": "failed", "phase": "failed",
                   "step": 15, "heartbeat_at": time.time() - 1, "heartbeat_interval": 1.0,
                   "failure": {"kind": "error", "message": "RuntimeError: [pair.cc:537] Read "
                               "error [127.0.0.1]:7558: Connection reset by peer"},
                   "process": {"status": "gone"}}
    ev.ranks[1] = {"rank": 1, "pid": 41, "node": "h", "state": "running", "phase": "forward",
                   "step": 15, "heartbeat_at": time.time() - 1.2, "heartbeat_interval": 1.0,
                   "process": {"status": "gone"}}
    dead = [f for f in analysis.analyse(ev) if f.category == "rank_dead"]
    assert [f.ranks for f in dead] == [[1]], [(f.ranks, f.title) for f in dead]


def test_a_rank_named_by_this_nodes_given_name_is_looked_at_here(monkeypatch):
    """A node given a name of its own ($TRAINWATCH_NODE, as on every node of a multi-node
    job) is this host: its ranks' processes are inspected, not "on another node". Before,
    a stopped run there read "healthy: every rank is progressing"."""
    from trainwatch.diagnose import processes
    monkeypatch.setenv("TRAINWATCH_NODE", "gpu-node-7")
    ev = Evidence(run_dir="/r", collected_at=time.time(), host="h")
    ev.ranks = {0: {"node": "gpu-node-7", "pid": os.getpid(), "started_at": time.time()},
                1: {"node": "gpu-node-8", "pid": os.getpid(), "started_at": time.time()}}
    processes.gather(ev)
    assert ev.ranks[0]["process"]["visible"] and ev.ranks[0]["process"]["status"] != "unknown"
    assert ev.ranks[1]["process"] == {"status": "unknown", "visible": False}
    assert any("gpu-node-8" in u for u in ev.unseen)


def test_ranks_an_attempt_resumed_at_a_smaller_world_size_no_longer_has_are_not_listed():
    """2 ranks, then the job resumed on 1: rank 1's status (world size 2, "running": it was
    SIGKILLed) is left behind. Before, diagnose listed it and called it dead (critical)."""
    from trainwatch.diagnose.run_state import former_ranks

    views = {0: {"world_size": 1, "started_at": 200.0, "state": "finished"},
             1: {"world_size": 2, "started_at": 100.0, "state": "running"}}
    assert former_ranks(views) == {1: 2}
    grown = {0: {"world_size": 2, "started_at": 200.0}, 1: {"world_size": 2, "started_at": 201.0}}
    assert former_ranks(grown) == {}  # 1 -> 2: every status is the newest attempt's
    stale_rank_0 = {0: {"world_size": 2, "started_at": 100.0},
                    1: {"world_size": 2, "started_at": 100.0}}
    assert former_ranks(stale_rank_0) == {}
    assert former_ranks({}) == {} and former_ranks({0: {"world_size": None}}) == {}
