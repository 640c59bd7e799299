"""The leader's view of lost nodes (control/node_watch.py): a node is lost only when its
supervisor's heartbeat and every heartbeat of its ranks stopped changing, on the leader's
own clock; journaled once, and its return once."""

import os

from agent_helpers import write_status
from trainwatch.control.job_nodes import JobNodes
from trainwatch.control.node_watch import LOST_AFTER_SECONDS, NodeWatch
from trainwatch.rundir.beat import BeatWriter, beat_path
from trainwatch.rundir.run_dir import RunDir


class Cluster:
    """Node n0 (the leader, whose watch is under test) and n1 with ranks 2 and 3, beating
    through their files; time is the test's."""

    def __init__(self, tmp_path):
        self.run = RunDir(tmp_path / "run")
        self.now = 1000.0
        self.events = []
        self.watch = NodeWatch(self.run, JobNodes("n0", 0, 2),
                               lambda event, **f: self.events.append((event, f)),
                               clock=lambda: self.now)
        self.run.node_supervisor_beat_file("n0").parent.mkdir(parents=True)
        self.sup = {n: BeatWriter(self.run.node_supervisor_beat_file(n)) for n in ("n0", "n1")}
        self.run.status_dir.mkdir(parents=True, exist_ok=True)
        self.ranks = {r: BeatWriter(beat_path(self.run.status_dir, r)) for r in (2, 3)}
        for rank in (2, 3):
            write_status(self.run, rank, os.getpid(), node="n1")
        self.beats = 0

    def beat(self, supervisor=True, ranks=True, token="a"):
        self.beats += 1
        if supervisor:
            self.sup["n1"].write({"pid": 1, "host": "h", "token": token, "role": "run",
                                  "at": float(self.beats), "interval": 1.0})
        if ranks:
            for rank, writer in self.ranks.items():
                writer.write({"v": 1, "rank": rank, "pid": 10 + rank,
                              "heartbeat_mono": float(self.beats)})

    def look(self, seconds=1.0):
        self.now += seconds
        self.watch.check()

    def named(self, event):
        return [f for e, f in self.events if e == event]


def test_a_node_whose_supervisor_and_ranks_fall_silent_is_lost_once_then_returns(tmp_path):
    c = Cluster(tmp_path)
    for _ in range(30):  # beating: never lost, however long
        c.beat()
        c.look()
    assert c.events == []
    for _ in range(int(LOST_AFTER_SECONDS) + 5):  # the whole node silent
        c.look()
    (lost,) = c.named("node_lost")
    assert lost["lost_node"] == "n1" and lost["ranks"] == [2, 3]
    assert lost["node"] == "n0" and lost["leader"] is True
    assert lost["silent_seconds"] >= LOST_AFTER_SECONDS
    for _ in range(40):
        c.look()
    assert len(c.named("node_lost")) == 1  # once, not every look
    c.beat(ranks=False, token="b")  # a new supervisor on n1: back
    c.look()
    (back,) = c.named("node_returned")
    assert back["lost_node"] == "n1" and back["lost_seconds"] > 0


def test_only_one_kind_of_silence_is_not_a_lost_node(tmp_path):
    """A frozen or dead supervisor with running ranks (the agent's TrainwatchSupervisorDown),
    or stalled ranks under a live supervisor (a stall): neither is a lost node."""
    c = Cluster(tmp_path)
    for _ in range(int(LOST_AFTER_SECONDS) * 3):
        c.beat(supervisor=False)
        c.look()
    for _ in range(int(LOST_AFTER_SECONDS) * 3):
        c.beat(ranks=False)
        c.look()
    assert c.events == []



def test_the_ranks_of_a_node_whose_supervisor_beats_are_never_read(tmp_path, monkeypatch):
    """The leader's cost is a heartbeat per node a second; statuses (one file per rank)
    are read only for a node whose supervisor went quiet."""
    c = Cluster(tmp_path)
    reads = []
    real = c.run.statuses
    monkeypatch.setattr(c.run, "statuses", lambda: reads.append(1) or real())
    for _ in range(30):
        c.beat()
        c.look()
    assert reads == [] and c.events == []
    for _ in range(5):
        c.beat(supervisor=False)
        c.look()
    assert reads and c.events == []
