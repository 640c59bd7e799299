"""diagnose from any node of a multi-node job (issue #34, item 5), on run directories built
as the nodes' ranks and launchers write them to shared storage (no processes started).

The case of the issue, 2 nodes x 2 ranks: rank 2 on node2 frozen (SIGSTOP); the stall
restart stopped node1's launcher and started it again, which waits in the rendezvous;
node2's torchrun lost the store and exited 1, rank 3 failing in the collective on the way.
Diagnose on node1 (this host) must name rank 2, not the victims, say node2's launcher exit,
the rendezvous waiting and the node that stopped reporting, and count one attempt.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from trainwatch.diagnose import analysis
from trainwatch.diagnose.gather import Options, gather
from trainwatch.rundir.run_dir import RunDir

HERE = socket.gethostname()
PEER_ERROR = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
              "closed by peer [10.0.0.2]:29500")


def _gone_pid() -> int:
    """A pid no process has now (a child started and reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _status(run: RunDir, rank: int, node: str, pid: int, *, beat: float, progress: float,
            step: int, state: str = "running", started: float, **extra) -> None:
    run.write_status(rank, {"job": "exp", "rank": rank, "local_rank": rank % 2,
                            "world_size": 4, "node": node, "pid": pid, "backend": "gloo",
                            "device": "cpu", "started_at": started, "heartbeat_at": beat,
                            "heartbeat_interval": 1.0, "step": step, "phase": "backward",
                            "phase_since": progress, "last_progress_at": progress,
                            "state": state, "restart_count": 0,
                            "metrics": {"step": step, "step_time_seconds": 0.3},
                            "counters": {"steps_total": step}, **extra})


def _event(run: RunDir, t: float, event: str, host: str, **fields) -> None:
    with open(run.journal_file, "a") as f:
        f.write(json.dumps({"v": 1, "time": t, "event": event, "source": "launcher",
                            "host": host, **fields}) + "\n")


def frozen_on_node2(tmp_path, now: float) -> RunDir:
    run = RunDir(tmp_path / "exp").create()
    run.write_run_info({"job": "exp", "world_size": 4, "nnodes": 2, "nproc_per_node": 2})
    freeze, start = now - 100, now - 130
    for host, node_rank in ((HERE, 0), ("node2", 1)):
        _event(run, now - 135, "launcher_started", host, pid=900 + node_rank,
               node_rank=node_rank, nnodes=2, nproc_per_node=2)
    for rank in range(4):
        _event(run, start + rank * 0.01, "rank_started", HERE if rank < 2 else "node2",
               rank=rank, pid=1000 + rank, restart_count=0, source=f"rank{rank}")
    _event(run, now - 94, "alert_firing", HERE, alert="TrainingStallSuspected",
           labels={"run": "exp", "node": "node2", "culprit_rank": "2"})
    _event(run, now - 92, "action_taken", HERE, action="stall_restart")
    _event(run, now - 90, "launcher_exited", HERE, exit_code=143, signal="SIGTERM")
    _event(run, now - 89, "job_started", HERE, attempt=2)
    _event(run, now - 88, "launcher_started", HERE, pid=910, node_rank=0, nnodes=2)
    _event(run, now - 55, "launcher_exited", "node2", exit_code=1, torchrun_returncode=1)
    for rank in (0, 1):  # stopped by the restart while they waited: killed, never saved
        _status(run, rank, HERE, _gone_pid(), beat=now - 90, progress=freeze - 0.2, step=21,
                started=start)
    _status(run, 2, "node2", 4242, beat=freeze, progress=freeze - 0.4, step=20, started=start)
    _status(run, 3, "node2", 4243, beat=now - 55, progress=freeze - 0.2, step=21,
            state="failed", started=start, failure={"kind": "error", "message": PEER_ERROR})
    return run


def _diagnose(run: RunDir):
    ev = gather(run, Options(request_dumps=False, timeout=1.0))
    return ev, analysis.analyse(ev)


def test_diagnose_on_node1_names_the_frozen_rank_and_the_node_events(tmp_path):
    run = frozen_on_node2(tmp_path, time.time())
    ev, found = _diagnose(run)
    first = found[0]
    assert first.category == "rank_stuck" and first.ranks == [2], [
        (f.category, f.ranks, f.title) for f in found]
    assert first.nodes == ["node2"] and "held the job up" in first.title
    assert first.confidence == "high" and first.severity == "critical"
    assert any("culprit_rank=2" in line for line in first.evidence), first.evidence
    assert any("victims, not causes" in line and "[0, 1, 3]" in line for line in first.evidence)
    # The victims are not named as dead ranks, nor rank 2 again as a mere frozen one.
    assert not [f for f in found if f.category == "rank_dead"], [f.title for f in found]
    assert [f.ranks for f in found if f.category == "rank_stuck"] == [[2]]

    nodes = {f.nodes[0]: f for f in found if f.category == "node"}
    assert set(nodes) == {HERE, "node2"}, [f.title for f in found]
    node2 = nodes["node2"]
    assert node2.title.startswith("Node node2 stopped reporting: no fresh status from any of "
                                  "its ranks [2, 3]"), node2.title
    assert any("node2's launcher exited (exit code 1)" in line and "none started since" in line
               for line in node2.evidence), node2.evidence
    here = nodes[HERE]
    assert "the rendezvous waits for 1 more node(s) of 2" in here.title, here.title
    assert "pid 910" in here.title and here.ranks == [] and node2.ranks == []
    assert any(f"node {HERE} stopped reporting" in line for line in here.evidence)
    attempts_line = next(line for f in nodes.values() for line in f.evidence
                         if line.startswith("journal: "))
    assert "attempts 1 (no restarts)" in attempts_line, attempts_line
    assert "attempt 2 began on" in attempts_line and "no rank has started in it" in attempts_line
    assert ev.journal["launchers"]["nnodes"] == 2


def test_one_restart_on_two_nodes_is_one_attempt_in_diagnose(tmp_path):
    """Both nodes restarted: node1's torchrun restarted its workers (count 1), node2's
    launcher was replaced (count 0); their ranks started interleaved."""
    now = time.time()
    run = frozen_on_node2(tmp_path, now)
    for i, (rank, host, count) in enumerate(((0, HERE, 1), (2, "node2", 0), (1, HERE, 1),
                                             (3, "node2", 0))):
        _event(run, now - 40 + i * 0.01, "rank_started", host, rank=rank, pid=2000 + rank,
               restart_count=count, source=f"rank{rank}")
    ev = gather(run, Options(request_dumps=False, timeout=1.0))
    assert ev.journal["restarts"]["attempts"] == 2, ev.journal["restarts"]


def test_a_rank_that_stepped_after_the_silence_is_not_its_victim(tmp_path):
    """The job went on after rank 2's last heartbeat: no culprit by order of silence."""
    now = time.time()
    run = frozen_on_node2(tmp_path, now)
    _status(run, 0, HERE, _gone_pid(), beat=now - 90, progress=now - 91, step=40,
            started=now - 130)
    _, found = _diagnose(run)
    assert not any(f.category == "rank_stuck" and "held the job up" in f.title for f in found)


def test_a_one_node_run_has_no_node_findings(tmp_path):
    now = time.time()
    run = RunDir(tmp_path / "one").create()
    run.write_run_info({"job": "exp", "world_size": 2, "nnodes": 1})
    for rank in (0, 1):
        _status(run, rank, HERE, _gone_pid(), beat=now - 50, progress=now - 51, step=5,
                started=now - 60)
    _, found = _diagnose(run)
    assert not [f for f in found if f.category == "node"]
    assert not any("held the job up" in f.title for f in found)


def test_a_rank_dead_in_torchruns_words_is_dead_s_not_first_silent_s(tmp_path):
    """Rank 2's process is visibly gone here: the dead rule names it (signal, OOM), and
    a job that died on every node with no launcher event says no node event."""
    now = time.time()
    run = RunDir(tmp_path / "exp").create()
    run.write_run_info({"job": "exp", "world_size": 4, "nnodes": 2})
    for rank in range(4):
        node = HERE if rank in (2, 3) else "node1"
        beat = now - 100 if rank == 2 else now - 80
        _status(run, rank, node, _gone_pid(), beat=beat, progress=now - 101, step=20,
                started=now - 130)
    _, found = _diagnose(run)
    assert not any("held the job up" in f.title for f in found)
    assert [f.ranks for f in found if f.category == "rank_dead"][:1] == [[2]], [
        (f.category, f.ranks, f.title) for f in found]
    assert not [f for f in found if f.category == "node"], [f.title for f in found]
