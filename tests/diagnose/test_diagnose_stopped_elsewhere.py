"""A multi-node job's node whose job ended as another node was stopped on request
(`job_exited` with `stopped_elsewhere`, trainwatch/control/stopped_elsewhere.py) was
stopped, as a node whose own supervisor stopped it: diagnose reads the journal's last
start, stop or exit as that stop, not as a crash; a plain failed exit stays a failure."""

from trainwatch.diagnose.journal import stopped


def test_an_exit_for_another_nodes_stop_is_a_stop_a_plain_exit_is_not():
    started = {"event": "job_started", "time": 1.0, "pid": 7}
    elsewhere = {"event": "job_exited", "time": 5.0, "pid": 7, "returncode": 1,
                 "stopped_elsewhere": "node-0"}
    assert stopped([started, elsewhere]) == {"time": 5.0, "closed": False,
                                             "reason": "node node-0 was stopped on request",
                                             "event": "job_exited"}
    crashed = {k: v for k, v in elsewhere.items() if k != "stopped_elsewhere"}
    assert stopped([started, crashed]) is None
    ctrl_c = {"event": "job_stopped", "time": 6.0, "reason": "interrupted"}
    assert stopped([started, ctrl_c])["reason"] == "interrupted"
