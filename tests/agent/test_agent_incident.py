"""The stall incident's culprit from the ranks' collective progress (their beats'
``collectives``), whatever phases their loops are in (issue #36, item 1)."""

from trainwatch.agent.incident import group
from trainwatch.agent.stall import StallVerdict


def stuck(rank, phase, step, collectives, world_size=3, since=100.0):
    view = {"rank": rank, "phase": phase, "step": step, "pid": 4000 + rank,
            "world_size": world_size, "collectives": collectives}
    return view, StallVerdict(True, "stuck", 5.0, since + rank, 8.0, "no progress")


def skipped_side_collective(world_size=3):
    """The issue's case: every step all-reduces gradients on group 0 (phase allreduce),
    then, in the user's phase "metrics", all-reduces on side group 1. Rank 1 skipped side
    all-reduce #13 and waits in the next step's gradient all-reduce #14 of group 0; ranks 0
    and 2 wait in side all-reduce #13, which rank 1 never entered."""
    views = {0: stuck(0, "metrics", 12, {"1": [13, 12], "0": [13, 13]}, world_size),
             1: stuck(1, "allreduce", 13, {"0": [14, 13], "1": [12, 12]}, world_size),
             2: stuck(2, "metrics", 12, {"1": [13, 12], "0": [13, 13]}, world_size)}
    return list(views.values())


def test_the_rank_that_skipped_a_side_collective_in_a_user_phase_is_the_culprit():
    """Phases blame ranks 0 and 2 ("metrics" is no collective phase); the collective
    counters say rank 1 never entered the side group's all-reduce #13 they wait in."""
    incident = group(skipped_side_collective())
    assert incident.culprits == [1] and incident.waiting == [0, 2], incident.reason
    assert incident.kind == "stuck"
    assert "did not enter collective #13 of process group 1" in incident.reason
    assert "rank(s) [0, 2] wait in" in incident.reason
    assert "collective #14 of process group 0" in incident.reason


def test_a_rank_in_no_collective_behind_the_one_the_others_wait_in_is_the_culprit():
    """Rank 2 is stuck in its own phase "load" before the gradient all-reduce #7 that ranks
    0 and 1 wait in, also in a user phase ("sync_grads" is no known collective phase)."""
    incident = group([stuck(0, "sync_grads", 6, {"0": [7, 6]}),
                      stuck(1, "sync_grads", 6, {"0": [7, 6]}),
                      stuck(2, "load", 6, {"0": [6, 6]})])
    assert incident.culprits == [2] and incident.waiting == [0, 1], incident.reason
    assert incident.reason.startswith("in no collective; did not enter collective #7 of "
                                      "process group 0"), incident.reason


def test_equal_sides_and_a_partial_view_name_no_one_and_say_why():
    """Crossed waits with equal sides (one against one), and a node that sees 3 of a job's
    4 ranks (the fourth, elsewhere, may be on either side): which side is the odd one out
    cannot be told, so no culprit, and the reason says what was seen."""
    tie = group([stuck(0, "metrics", 12, {"1": [13, 12], "0": [13, 13]}, 2),
                 stuck(1, "allreduce", 13, {"0": [14, 13], "1": [12, 12]}, 2)])
    assert tie.culprits == [] and tie.culprit is None and tie.waiting == [0, 1]
    assert "equal sides" in tie.reason and "#13 of process group 1" in tie.reason
    partial = group(skipped_side_collective(world_size=4))
    assert partial.culprits == [] and "this node sees 3 of 4 ranks" in partial.reason


def test_ranks_waiting_alike_name_no_one_and_without_progress_phases_decide():
    """Every rank here waits in the same collective: the culprit is elsewhere. A rank
    without collective progress (flight recorder off) leaves the phases to decide, as
    before."""
    alike = group([stuck(0, "metrics", 5, {"0": [9, 8]}, 4),
                   stuck(1, "metrics", 5, {"0": [9, 8]}, 4)])
    assert alike.culprits == [] and "on another node" in alike.reason
    phases = group([stuck(0, "backward", 5, None), stuck(1, "data", 5, {"0": [9, 9]}),
                    stuck(2, "backward", 5, None)])
    assert phases.culprits == [1] and "phase data" in phases.reason
