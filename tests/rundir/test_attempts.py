"""trainwatch/rundir/attempts.py: who restarted each generation of ranks, from journal events."""

from trainwatch.rundir import attempts


def _start(t, rank, restart_count=0, pid=None):
    return {"time": t, "event": "rank_started", "rank": rank, "pid": pid or 100 + int(t),
            "restart_count": restart_count}


def test_torchrun_controller_and_a_rerun_are_told_apart():
    events = [
        {"time": 0, "event": "job_started", "attempt": 1},
        _start(1, 0), _start(1.1, 1),
        _start(5, 0, restart_count=1), _start(5.1, 1, restart_count=1),   # torchrun
        {"time": 8, "event": "job_started", "attempt": 2},
        _start(9, 0), _start(9.1, 1),                                     # the controller
        {"time": 20, "event": "job_started", "attempt": 1},              # a new trainwatch run
        _start(21, 1), _start(21.1, 0),                                   # started again
    ]
    found = attempts.generations(list(reversed(events)))  # any order: sorted by time
    assert [g.restarted_by for g in found] == [None, "torchrun", "controller", "rerun"]
    assert [sorted(g.ranks) for g in found] == [[0, 1]] * 4
    counts = attempts.summary([g.restarted_by for g in found])
    assert counts == {"attempts": 4, "restarts": 3,
                      "restarted_by": {"torchrun": 1, "controller": 1, "rerun": 1}}
    assert attempts.describe(counts) == ("attempts 4 (3 restarts: 1 by torchrun, "
                                         "1 by the controller, 1 run again)")


def test_a_run_without_restarts_and_one_without_rank_starts():
    one = attempts.generations([_start(1, 0), _start(1, 1), {"time": "x", "event": "rank_started"}])
    assert attempts.describe(attempts.summary([g.restarted_by for g in one])) == (
        "attempts 1 (no restarts)")
    assert attempts.describe(attempts.summary([])) == (
        "attempts unknown (no rank_started in the journal)")


def _on(host, t, rank, restart_count=0):
    return {**_start(t, rank, restart_count), "host": host}


def test_one_restart_of_a_job_on_two_nodes_is_one_attempt():
    """Each node runs a torchrun of its own: node1's restarted its workers (count 1) while
    node2's launcher was replaced (count 0 again); their ranks start interleaved. One job,
    two attempts, not one per node nor one per change of count between nodes."""
    events = [
        _on("node1", 1, 0), _on("node2", 1.05, 2), _on("node1", 1.1, 1), _on("node2", 1.2, 3),
        {"time": 8, "event": "job_started", "attempt": 2, "host": "node2"},
        _on("node1", 9, 0, 1), _on("node2", 9.05, 2, 0), _on("node1", 9.1, 1, 1),
        _on("node2", 9.2, 3, 0),
    ]
    found = attempts.generations(events)
    assert [sorted(g.ranks) for g in found] == [[0, 1, 2, 3]] * 2
    assert attempts.describe(attempts.summary([g.restarted_by for g in found])) == (
        "attempts 2 (1 restart: 1 by the controller)")
    # A node's own torchrun restarting its workers again is a new attempt.
    found = attempts.generations(events + [_on("node2", 15, 2, 1)])
    assert len(found) == 3
