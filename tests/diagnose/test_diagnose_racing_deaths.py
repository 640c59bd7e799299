"""Two ranks that die on their own within one torchrun poll (issue #36, item 4), on run
directories as a 4-rank gloo job under torchrun leaves them (no processes started).

torchrun stamps the failures it finds in one poll with the same second and names the lower
rank its root cause: with rank 2 dying 5 ms before rank 1, it names rank 1. diagnose must
not repeat that pick with confidence: it names both, each with its own cause, and names a
first only where the ranks' own records order them.
"""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import time

import pytest

from trainwatch.diagnose import analysis
from trainwatch.diagnose.gather import Options, gather
from trainwatch.rundir.run_dir import RunDir

HERE = socket.gethostname()
PEER_ERROR = ("[rank{r}]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] "
              "Connection closed by peer [127.0.0.1]:12686")


def _gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _entry(n: int, stamp: str, rank: int, code: int, pid: int) -> str:
    signal = "  (SIGTERM)" if code == -15 else ""
    return (f"[{n}]:\n  time      : {stamp}\n  host      : localhost\n"
            f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: {pid}){signal}\n"
            "  error_file: <N/A>\n  traceback : To enable traceback see: "
            "https://pytorch.org/docs/stable/elastic/errors.html\n")


def racing_run(tmp_path, *, exits: dict[int, int], root: int, stopped: list[int],
               lines: str = "", failed: dict[int, tuple[float, str]] | None = None) -> RunDir:
    """Ranks 0-3 on this host, all gone; ``exits``: each rank's exit code in torchrun's
    table (all stamped in one second), ``root`` its root cause, ``stopped`` the ranks it
    sent SIGTERM; ``failed``: rank -> (when, error) it recorded itself (journal and status)."""
    now = time.time()
    failed = failed or {}
    run = RunDir(tmp_path / "run").create()
    run.write_run_info({"job": "exp", "world_size": 4})
    pids = {r: _gone_pid() for r in range(4)}
    died = now - 60
    for rank in range(4):
        when, error = failed.get(rank, (None, None))
        run.write_status(rank, {
            "job": "exp", "rank": rank, "local_rank": rank, "world_size": 4, "node": HERE,
            "pid": pids[rank], "backend": "gloo", "device": "cpu", "started_at": now - 90,
            "heartbeat_at": when or died - 0.05, "heartbeat_interval": 0.2, "step": 6,
            "phase": "failed" if when else "allreduce", "phase_since": died - 0.3,
            "last_progress_at": died - 0.3, "state": "failed" if when else "running",
            "restart_count": 0, "metrics": {"step": 6, "step_time_seconds": 0.05},
            "counters": {"steps_total": 6},
            **({"failure": {"kind": "error", "message": error}} if when else {})})
        if when:
            with open(run.journal_file, "a") as f:
                f.write(json.dumps({"v": 1, "time": when, "event": "failed",
                                    "source": f"rank{rank}", "host": HERE, "rank": rank,
                                    "error": error}) + "\n")
    stamp = datetime.datetime.fromtimestamp(died).strftime("%Y-%m-%d_%H:%M:%S")
    others = [r for r in sorted(exits) if r != root]
    log = lines + "".join(
        f"W1206 15:18:32.846000 708 torch/distributed/elastic/multiprocessing/api.py:1028] "
        f"Sending process {pids[r]} closing signal SIGTERM\n" for r in stopped)
    log += ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
            "============================================================\n"
            "job.py FAILED\n------------------------------------------------------------\n"
            "Failures:\n" + "".join(_entry(i + 1, stamp, r, exits[r], pids[r])
                                    for i, r in enumerate(others))
            + "------------------------------------------------------------\n"
            "Root Cause (first observed failure):\n" + _entry(0, stamp, root, exits[root],
                                                              pids[root])
            + "============================================================\n")
    (run.logs_dir / "torchrun.log").write_text(log)
    return run


def _findings(run: RunDir):
    ev = gather(run, Options(request_dumps=False, timeout=1.0))
    return analysis.analyse(ev)


def _confident_wrong(found, culprit: int) -> list[str]:
    return [f.title for f in found if f.confidence == "high" and f.severity == "critical"
            and f.ranks and culprit not in f.ranks]


def test_two_exits_in_one_poll_are_a_tie_not_torchruns_pick(tmp_path):
    """Rank 2 exits with code 3 and rank 1 with code 4 5 ms later, both before torchrun's
    next poll (as measured under torchrun: it names rank 1). Ranks 0 and 3 were stopped
    (rank 3 traps SIGTERM and exits 75). Nothing orders the two: both are named, each
    with its exit code, torchrun's pick is said for what it is, nothing is high."""
    peers = PEER_ERROR.format(r=0) + "\n"
    run = racing_run(tmp_path, exits={1: 4, 2: 3, 0: -15, 3: 75}, root=1, stopped=[0, 3],
                     lines=peers)
    found = _findings(run)
    dead = [f for f in found if f.category == "rank_dead"]
    assert len(dead) == 1 and dead[0].ranks == [1, 2], [(f.ranks, f.title) for f in dead]
    tie = dead[0]
    assert tie.title == ("ranks 1 and 2 died on their own within one torchrun poll of each "
                         "other: which failed first cannot be told"), tie.title
    assert tie.confidence == "medium"
    text = "\n".join(tie.evidence)
    assert "rank 1 (exit code 4)" in text and "rank 2 (exit code 3)" in text, text
    assert "torchrun names rank 1 its root cause" in text and "need not be" in text, text
    assert "0.1 s by default" in text, text
    assert "rank 0: killed by SIGTERM" in text and "rank 3: exit code 75" in text, text
    assert not _confident_wrong(found, 2), _confident_wrong(found, 2)


@pytest.mark.parametrize("source", ["torchrun_log", "launcher_event"])
def test_torchruns_poll_interval_is_quoted_when_the_run_says(tmp_path, source):
    """torchrun's launch configs (logged at INFO), or `trainwatch train`'s launcher event."""
    in_log = source == "torchrun_log"
    run = racing_run(tmp_path, exits={1: 4, 2: 3, 0: -15, 3: -15}, root=1, stopped=[0, 3],
                     lines="  monitor_interval         : 0.5\n" if in_log else "")
    if not in_log:
        run.append_event("launcher_started", "launcher", pid=1, node_rank=0,
                         monitor_interval=0.5)
    tie = next(f for f in _findings(run) if f.category == "rank_dead")
    assert any("every 0.5 s" in e for e in tie.evidence), tie.evidence


def test_the_ranks_own_records_name_the_first_against_torchruns_pick(tmp_path):
    """Rank 2 raised first and recorded its error 0.3 s before rank 1 recorded its own;
    torchrun saw both exits in one poll and named rank 1. Rank 2 is named first, rank 1's
    own error is listed too, and the disagreement with torchrun lowers the confidence."""
    t = time.time() - 60.4
    run = racing_run(tmp_path, exits={1: 1, 2: 1, 0: -15, 3: -15}, root=1, stopped=[0, 3],
                     failed={2: (t, "RuntimeError: loader shard 7 is corrupt"),
                             1: (t + 0.3, "RuntimeError: CUDA error: an illegal memory access")})
    found = _findings(run)
    dead = [f for f in found if f.category == "rank_dead"]
    assert len(dead) == 1 and dead[0].ranks == [2], [(f.ranks, f.title) for f in dead]
    first = dead[0]
    assert first.title == "rank 2 failed first; rank 1 also died on its own", first.title
    assert first.confidence == "medium"
    text = "\n".join(first.evidence)
    assert "300.0 ms before rank 1 recorded its own" in text, text
    assert "loader shard 7 is corrupt" in text and "illegal memory access" in text, text
    assert "torchrun names rank 1" in text and "disagree" in text, text
    assert not _confident_wrong(found, 2), _confident_wrong(found, 2)


def test_a_recorded_error_before_a_killed_peers_last_heartbeat_comes_first(tmp_path):
    """Rank 2 recorded its error while rank 1 still beat (0.15 s later); then rank 1 was
    SIGKILLed within the same poll and torchrun named it. Rank 2 came first."""
    t = time.time() - 60.4
    run = racing_run(tmp_path, exits={1: -9, 2: 1, 0: -15, 3: -15}, root=1, stopped=[0, 3],
                     failed={2: (t, "ValueError: bad batch")})
    status = json.loads(run.status_file(1).read_text())
    status["heartbeat_at"] = t + 0.15
    run.write_status(1, {k: v for k, v in status.items() if k not in ("format", "version")})
    found = _findings(run)
    first = next(f for f in found if f.category == "rank_dead")
    assert first.ranks == [2], first.title
    assert any("rank 1 was still alive" in e for e in first.evidence), first.evidence
    assert not _confident_wrong(found, 2), _confident_wrong(found, 2)


def test_records_closer_than_a_dying_ranks_delay_are_a_tie(tmp_path):
    """Both raised within 7.5 ms (as measured: rank 2 first): too close to order."""
    t = time.time() - 60.4
    run = racing_run(tmp_path, exits={1: 1, 2: 1, 0: -15, 3: -15}, root=1, stopped=[0, 3],
                     failed={2: (t, "RuntimeError: a"), 1: (t + 0.0075, "RuntimeError: b")})
    found = _findings(run)
    tie = next(f for f in found if f.category == "rank_dead")
    assert tie.ranks == [1, 2] and tie.confidence == "medium", tie.title
    assert any("within 7.5 ms of each other" in e for e in tie.evidence), tie.evidence
    assert not _confident_wrong(found, 2), _confident_wrong(found, 2)


def test_one_death_and_the_ranks_torchrun_stopped_stay_a_confident_answer(tmp_path):
    """Rank 1 alone died; torchrun stopped the others (one trapped SIGTERM and exited 75,
    one failed in the collective first): rank 1, high, as before."""
    run = racing_run(tmp_path, exits={1: -9, 2: 1, 0: -15, 3: 75}, root=1, stopped=[0, 3],
                     lines=PEER_ERROR.format(r=2) + "\n")
    found = _findings(run)
    dead = [f for f in found if f.category == "rank_dead"]
    assert [f.ranks for f in dead] == [[1]] and dead[0].confidence == "high", \
        [(f.ranks, f.title) for f in dead]


def test_an_earlier_attempts_racing_deaths_are_history_of_both(tmp_path):
    """The run was started again after ranks 2 and 1 exited in one poll (as `trainwatch
    run` left it): the history names both, not torchrun's pick with confidence."""
    run = racing_run(tmp_path, exits={1: 4, 2: 3, 0: -15, 3: -15}, root=1, stopped=[0, 3])
    now = time.time()
    for attempt, t in ((0, now - 90), (1, now - 40)):
        for rank in range(4):
            status = json.loads(run.status_file(rank).read_text())
            pid = status["pid"] if attempt == 0 else _gone_pid()
            run.append_event("rank_started", f"rank{rank}", rank=rank, pid=pid, restart_count=0)
            if attempt == 1:
                status.update(pid=pid, state="finished", started_at=t, heartbeat_at=now - 5)
                run.write_status(rank, {k: v for k, v in status.items()
                                        if k not in ("format", "version")})
    found = _findings(run)
    history = [f for f in found if f.category == "rank_dead"]
    assert [f.ranks for f in history] == [[1, 2]], [(f.ranks, f.title) for f in history]
    assert history[0].title.startswith("ranks 1 and 2 died within one torchrun poll in "
                                       "attempt 1 (rank 1: exit code 4; rank 2: exit code 3)")
    assert history[0].confidence == "medium" and history[0].severity == "info"
