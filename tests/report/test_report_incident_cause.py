"""An incident's cause says what is known (issue #36): ranks torchrun found dead in one poll
are not put in torchrun's order, and a drill that acted on a node or a supervisor is not
"on rank None". In-process, on attempts as the timeline builds them."""

from trainwatch.report.incidents import cause, evidence
from trainwatch.report.timeline import Attempt

T0 = 1_760_000_000.0
STAMP = T0 + 50.0  # torchrun's failure table: the second it saw the failures


def _attempt(exits, events=()):
    pids = {x[0]: 100 + x[0] for x in exits}
    attempt = Attempt(0, T0, 0, None, ranks={r: pid for r, pid in pids.items()},
                      events=[{"v": 1, "source": "drill", **e} for e in events])
    attempt.exits = [{"rank": r, "pid": pids[r], "exitcode": code, "local_rank": r,
                      "seen_at": seen} for r, code, seen in exits]
    return attempt


def _failed(rank, when, error):
    return {"event": "failed", "time": when, "rank": rank, "source": f"rank{rank}",
            "host": "node1", "error": error}


def test_deaths_in_one_poll_without_records_are_an_honest_tie():
    # torchrun lists rank 1 (SIGKILL) before rank 0: that order is no evidence.
    text = cause(evidence(_attempt([(1, -9, STAMP), (0, 1, STAMP)])))
    assert text.startswith("ranks 0 and 1 died within one torchrun poll (rank 0 exited with "
                           "code 1, rank 1 killed by SIGKILL); which failed first is not known "
                           "from torchrun nor from the ranks' own records"), text


def test_the_ranks_own_records_order_deaths_in_one_poll():
    # torchrun names rank 0 (the lower rank on a tie); rank 1 recorded its error 200 ms first.
    attempt = _attempt([(0, 1, STAMP), (1, 1, STAMP)], [
        _failed(1, STAMP + 0.1, "ValueError: bad batch"),
        _failed(0, STAMP + 0.3, "RuntimeError: CUDA error")])
    text = cause(evidence(attempt))
    assert text.startswith("rank 1 exited with code 1 first (rank 1 recorded its error at "), text
    assert "200.0 ms before rank 0 recorded its own); rank 0 exited with code 1, also on its " \
           "own" in text, text


def test_records_too_close_to_order_stay_a_tie():
    attempt = _attempt([(0, 1, STAMP), (1, 1, STAMP)], [
        _failed(1, STAMP + 0.1, "ValueError: a"), _failed(0, STAMP + 0.11, "ValueError: b")])
    text = cause(evidence(attempt))
    assert text == ("ranks 0 and 1 died within one torchrun poll (rank 0 exited with code 1, "
                    "rank 1 exited with code 1); which failed first is not known from "
                    "torchrun"), text


def test_a_peers_failure_is_not_in_the_race_and_distinct_stamps_keep_torchruns_order():
    attempt = _attempt([(1, -9, STAMP), (0, 1, STAMP)], [
        _failed(0, STAMP + 0.2, "RuntimeError: Connection closed by peer [127.0.0.1]:1")])
    assert cause(evidence(attempt)).startswith(
        "rank 1 killed by SIGKILL; rank 0 exited with code 1 after a peer's failure")
    later = _attempt([(1, -9, STAMP), (0, 1, STAMP + 3)])
    assert cause(evidence(later)).startswith("rank 1 killed by SIGKILL; rank 0 exited with "
                                             "code 1")


def test_a_drill_on_a_node_or_a_supervisor_names_what_it_acted_on():
    node = _attempt([], [{"event": "fault_injected", "time": T0 + 9, "fault": "node_lost",
                          "step": 7, "node": "node2", "ranks": [2, 3]}])
    assert "fault drill: node_lost on node node2 at step 7" in cause(evidence(node))
    sup = _attempt([], [{"event": "fault_injected", "time": T0 + 9, "step": 5, "pid": 4242,
                         "fault": "kill_supervisor", "processes": 4}])
    assert "fault drill: kill_supervisor on trainwatch run (pid 4242) at step 5" in \
        cause(evidence(sup))
    rank = _attempt([], [{"event": "fault_injected", "time": T0 + 9, "step": 15, "rank": 1,
                          "source": "rank1", "fault": "kill"},
                         {"event": "fault_injected", "time": T0 + 9, "step": 15, "rank": 2,
                          "source": "rank2", "fault": "kill"}])
    assert "fault drill: kill on ranks 1, 2 at step 15" in cause(evidence(rank))
    for text in (cause(evidence(node)), cause(evidence(sup))):
        assert "None" not in text, text


def test_a_killed_trainwatch_train_holder_is_named_as_the_launcher_it_was():
    """`trainwatch train` holding the run writes no supervisor heartbeat; the next holder
    still journals its death, and the cause names it as what it was."""
    died = _attempt([], [{"event": "supervisor_died", "time": T0 + 40, "source": "supervisor",
                          "last_beat_at": None, "node": None,
                          "previous": {"pid": 50, "role": "trainwatch train", "host": "h"}}])
    ev = evidence(died)
    assert ev["supervisor_died"] == [{"pid": 50, "node": None, "role": "trainwatch train",
                                      "last_beat_at": None}]
    assert cause(ev).startswith("its launcher `trainwatch train` (pid 50) died without a word "
                                "(SIGKILL, a crash or an OOM kill; found by the next "
                                "supervisor)"), cause(ev)
