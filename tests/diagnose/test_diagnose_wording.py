"""How diagnose words what a stuck process waits for, on real blocked processes: the words
must match what the process does (the on-call engineer acts on them)."""

from diagnose_helpers import blocked_python

from trainwatch.diagnose import causes
from trainwatch.host.procinfo import thread_waits

SELF_DEADLOCK = """\
import threading

_EMA_LOCK = threading.Lock()


def update_ema():
    with _EMA_LOCK:
        refresh()


def refresh():
    with _EMA_LOCK:
        pass


update_ema()
"""


def _cause(child, dump):
    return causes.rank_cause({"pid": child.pid, "process": {
        "thread_waits": thread_waits(child.pid)}}, dump)


def test_a_thread_taking_a_lock_it_holds_is_a_deadlock(tmp_path):
    child, dump = blocked_python(SELF_DEADLOCK, "futex", tmp_path)
    try:
        cause = _cause(child, dump)
    finally:
        child.kill()
        child.wait()
    assert cause["kind"] == "deadlock" and cause["runbook"] == "TrainingStalled#deadlock"
    text = causes.describe(cause)
    assert text == (f"deadlock: thread MainThread (tid {child.pid}) waits for lock _EMA_LOCK "
                    f"({tmp_path / 'job.py'}:12) that it holds itself (taken at "
                    f"{tmp_path / 'job.py'}:7)"), text
    assert "no thread" not in text


EVENT_WAIT = """\
import threading


class ShardDataset:
    def __init__(self):
        self.shard_ready = threading.Event()
        self.lock = threading.Lock()

    def __getitem__(self, i):
        self.shard_ready.wait()


class Queue:
    def __init__(self):
        self.lock = threading.Lock()
        self.not_empty = threading.Condition()

    def get(self):
        with self.lock:
            with self.not_empty:
                self.not_empty.wait()


import sys
ShardDataset()[0] if sys.argv[-1] != "condition" else Queue().get()
"""


def test_a_wait_for_an_event_nothing_sets_is_no_lock_wait(tmp_path):
    """Event.wait parks in Condition.wait, which released the condition's lock and blocks
    on a private ``waiter`` lock: the words name the event and its line, and no lock held."""
    child, dump = blocked_python(EVENT_WAIT, "futex", tmp_path)
    try:
        cause = _cause(child, dump)
    finally:
        child.kill()
        child.wait()
    assert cause["kind"] == "event" and cause["runbook"] == "TrainingStalled#event", cause
    text = causes.describe(cause)
    assert text == (f"waits for event self.shard_ready ({tmp_path / 'job.py'}:10) that "
                    "nothing has set, holding no lock"), text


def test_a_condition_wait_names_the_condition_and_only_the_locks_still_held(tmp_path):
    child, dump = blocked_python(EVENT_WAIT, "futex", tmp_path, "condition")
    try:
        cause = _cause(child, dump)
    finally:
        child.kill()
        child.wait()
    assert cause["kind"] == "condition", cause
    assert causes.describe(cause) == (
        f"waits for condition self.not_empty ({tmp_path / 'job.py'}:21) that nothing has "
        "notified, while holding self.lock")


def _oom_killed_rank(oom):
    import time

    from trainwatch.diagnose.model import Evidence
    ev = Evidence(run_dir="/r", collected_at=time.time(), host="h")
    ev.ranks[1] = {"rank": 1, "pid": 42, "node": "h", "state": "running", "step": 9,
                   "process": {"status": "gone"}, "oom": oom}
    ev.launcher = {"failed": [{"exitcode": -9, "local_rank": 1, "pid": 42, "log": "l"}],
                   "root_cause": {"rank": 1, "local_rank": 1, "exitcode": -9, "pid": 42,
                                  "log": "l"}, "failures": []}
    from trainwatch.diagnose import analysis
    return next(f for f in analysis.analyse(ev) if f.category == "rank_dead")


def test_an_oom_kill_names_the_limit_an_ancestor_cgroup_set(tmp_path):
    """The job's 256 MiB limit sits on its slice; the rank's own cgroup has none ("max").
    The kill is worded with the limit that bound it and where it is set, not "unlimited"."""
    from trainwatch.host.cgroup import memory_facts
    slice_dir = tmp_path / "job.slice"
    rank_dir = slice_dir / "train" / "rank1"
    rank_dir.mkdir(parents=True)
    (tmp_path / "memory.max").write_text("max\n")  # the root: no limit
    (slice_dir / "memory.max").write_text(f"{256 << 20}\n")
    (slice_dir / "train" / "memory.max").write_text("max\n")
    (rank_dir / "memory.max").write_text("max\n")
    (rank_dir / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    facts = memory_facts("v2:/job.slice/train/rank1", str(tmp_path))
    assert facts["limit_bytes"] == 256 << 20 and facts["limit_cgroup"] == "/job.slice", facts
    line = ("Memory cgroup out of memory: Killed process 42 (python) total-vm:1843200kB, "
            "anon-rss:262144kB")
    dead = _oom_killed_rank({**facts, "kernel": {"line": line, "process": "python",
                                                  "memcg": "/job.slice/train/rank1"},
                             "kernel_error": None})
    assert dead.title == ("rank 1 was killed by the OOM killer (cgroup /job.slice/train/rank1, "
                          "limit 256 MiB, set on its ancestor cgroup /job.slice)"), dead.title
    assert ("memory cgroup /job.slice/train/rank1: 1 OOM kill(s) counted, limit 256 MiB, set "
            "on its ancestor cgroup /job.slice") in dead.evidence, dead.evidence


def test_an_oom_kill_in_a_removed_cgroup_says_the_limit_is_unknown(tmp_path):
    from trainwatch.host.cgroup import memory_facts
    facts = memory_facts("v2:/job.slice/gone", str(tmp_path))
    dead = _oom_killed_rank({**facts, "kernel": {"line": "Killed process 42 (python)",
                                                  "memcg": "/job.slice/gone"},
                             "kernel_error": None})
    assert dead.title == ("rank 1 was killed by the OOM killer (cgroup /job.slice/gone, "
                          "limit unknown (its cgroup is gone))"), dead.title


# A memory cgroup's OOM report as this host's kernel (6.18) logs it: the rank ran in a
# transient unit with MemoryMax=256M, removed with its job before diagnose looked.
KERNEL_LOG = """\
[  100.000001] python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0
[  100.000002] memory: usage 4194304kB, limit 4194304kB, failcnt 3
[  100.000003] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,\
oom_memcg=/system.slice/other.service,task_memcg=/system.slice/other.service,task=x,pid=7,uid=0
[  100.000004] Memory cgroup out of memory: Killed process 7 (x) total-vm:1kB, anon-rss:1kB
[  200.000001] python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0
[  200.000002] memory: usage 262144kB, limit 262144kB, failcnt 52
[  200.000003] memory+swap: usage 262144kB, limit 9007199254740988kB, failcnt 0
[  200.000004] Memory cgroup stats for /system.slice/run-r1.service/rank1:
[  200.000005] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,\
oom_memcg=/system.slice/run-r1.service,task_memcg=/system.slice/run-r1.service/rank1,\
task=python,pid=42,uid=0
[  200.000006] Memory cgroup out of memory: Killed process 42 (python) total-vm:1843200kB, \
anon-rss:262144kB
[  300.000001] python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE), order=0
[  300.000002] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,\
global_oom,task_memcg=/user.slice,task=python,pid=43,uid=0
[  300.000003] Out of memory: Killed process 43 (python) total-vm:1kB, anon-rss:1kB
"""


def test_an_oom_kill_in_a_removed_cgroup_names_the_limit_the_kernel_log_says(tmp_path):
    """The cgroup is gone (its limit unreadable), but the kernel's OOM report says which
    limit was hit and whose it was: the kill is worded with it, not "limit unknown"."""
    from trainwatch.host.cgroup import memory_facts, parse_oom_kills
    kills = parse_oom_kills(KERNEL_LOG)
    assert kills[42]["limit_bytes"] == 256 << 20, kills[42]
    assert kills[7]["limit_bytes"] == 4 << 30 and kills[43].get("limit_bytes") is None, kills
    facts = memory_facts("v2:/system.slice/run-r1.service/rank1", str(tmp_path))
    dead = _oom_killed_rank({**facts, "kernel": kills[42], "kernel_error": None})
    assert dead.title == ("rank 1 was killed by the OOM killer (cgroup "
                          "/system.slice/run-r1.service/rank1, limit 256 MiB, set on its "
                          "ancestor cgroup /system.slice/run-r1.service)"), dead.title


def test_a_pipe_reader_s_other_end_is_only_the_writers():
    """A reader blocked on a pipe waits for whoever holds the write end; a sibling that
    holds the same read end (a forked worker that inherited it) is not the other end."""
    import os
    import subprocess
    import sys

    from agent_helpers import wait_for
    from trainwatch.host.procinfo import describe_wait
    read_end, write_end = os.pipe()
    hold = "import sys; sys.stdin.read()"  # holds the fd passed to it until killed
    children = []
    try:
        reader = subprocess.Popen([sys.executable, "-c", f"import os; os.read({read_end}, 1)"],
                                  pass_fds=[read_end])
        children.append(reader)
        sibling = subprocess.Popen([sys.executable, "-c", hold], pass_fds=[read_end],
                                   stdin=subprocess.PIPE)
        writer = subprocess.Popen([sys.executable, "-c", hold], pass_fds=[write_end],
                                  stdin=subprocess.PIPE)
        children += [sibling, writer]
        os.close(read_end)
        os.close(write_end)

        def reading():
            main = next((t for t in thread_waits(reader.pid) if t["tid"] == reader.pid), None)
            wait = (main or {}).get("wait") or {}
            return wait if wait.get("kind") == "pipe" else None
        wait = wait_for(reading, timeout=30, what="the reader blocked on the pipe")
        assert {p["pid"] for p in wait["peers"]} == {writer.pid}, wait["peers"]
        assert describe_wait(wait).startswith(
            f"blocked in read on a pipe: other end held by pid {writer.pid} ("), wait
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_a_socketpair_s_other_end_is_named_never_a_peer_off_this_host():
    """A unix socket is always on this host: a rank blocked in ``recv`` on a socketpair it
    holds both ends of waits on itself, and one whose other end another process holds waits
    on that process — never "the peer is not on this host"."""
    import socket
    import subprocess
    import sys

    from agent_helpers import wait_for
    from trainwatch.host.procinfo import describe_wait

    def blocked_in_recv(pid):
        def waiting():
            main = next((t for t in thread_waits(pid) if t["tid"] == pid), None)
            wait = (main or {}).get("wait") or {}
            return wait if wait.get("kind") == "socket" else None
        return wait_for(waiting, timeout=30, what=f"pid {pid} blocked in recv")

    own = subprocess.Popen([sys.executable, "-c",
                            "import socket; a, b = socket.socketpair(); a.recv(1)"])
    mine, theirs = socket.socketpair()
    children = [own]
    try:
        reader = subprocess.Popen([sys.executable, "-c", "import socket; socket.socket("
                                   f"fileno={mine.fileno()}).recv(1)"], pass_fds=[mine.fileno()])
        holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                  pass_fds=[theirs.fileno()], stdin=subprocess.PIPE)
        children += [reader, holder]
        mine.close()
        theirs.close()
        text = describe_wait(blocked_in_recv(own.pid))
        assert text.startswith("blocked in recv") and text.endswith(
            f" on a unix socketpair; the other end is held by pid {own.pid} (this process)"), text
        text = describe_wait(blocked_in_recv(reader.pid))
        assert f" on a unix socketpair; the other end is held by pid {holder.pid} (" in text, text
        assert "this process" not in text and "not on this host" not in text, text
    finally:
        for child in children:
            child.kill()
            child.wait()
