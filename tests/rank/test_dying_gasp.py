"""The dying gasp (memory_snapshots/dying_gasp.py, gasp_resume.py): the rule that picks the
newest step every rank can restore, and an own loop whose rank writes its step at a failure
only while its state is still that step's. The real torchrun SIGKILL drill is
tests/rank/test_checkpoint_resume.py (K pinned at 4, resumed from rank 0's gasp); the
supervisor's request before a stall restart, end to end: tests/control/test_alert_run_e2e.py."""

import json
import time

import torch

from agent_helpers import wait_for
from trainwatch import Checkpoints, Telemetry
from trainwatch.control.gasp_request import WAIT_SECONDS, ask_survivors
from trainwatch.rank.memory_snapshots.agree import Found
from trainwatch.rank.memory_snapshots.gasp_resume import GASP, OWN, plan
from trainwatch.rundir.run_dir import RunDir


def test_the_newest_step_any_replica_holds_whole_and_every_rank_its_own_part():
    """Rank 1 died in step 16: its snapshot of 13 (every 4 steps) and its parts of 14 and
    15; rank 0 gasped step 15. Step 15: rank 0's model, rank 1's own RNGs and position."""
    found = [Found(0, steps={13: 1.0}, gasps={15: 3.0}, parts={14: 2.0, 15: 3.0},
                   durable_step=10),
             Found(1, steps={13: 1.0}, parts={14: 2.0, 15: 3.0})]
    chosen = plan(found, frozenset(), 13)
    assert chosen is not None and chosen.step == 15 and chosen.gasped
    assert chosen.shared_from == [(0, GASP), (0, GASP)] and chosen.from_part == [False, True]
    assert chosen.newest_step - chosen.step == 0  # steps_lost
    # Rank 1 died before its part of 15 was sealed: no step newer than 13 is whole for it.
    found[1].parts.pop(15)
    assert plan(found, frozenset(), 13) is None
    # A replica's own snapshot stands in too (rank 1 died before sealing its own of 17).
    found = [Found(0, steps={17: 4.0}, parts={17: 4.0}), Found(1, steps={13: 1.0},
                                                                parts={16: 3.0, 17: 4.0})]
    chosen = plan(found, frozenset(), None)
    assert chosen is not None and chosen.shared_from == [(0, OWN), (0, OWN)]
    # Not newer than the durable checkpoint, before a rollback, or excluded: none.
    found[0].durable_step = 17
    assert plan(found, frozenset(), None) is None
    found[0].durable_step, found[0].rollback_at = None, 5.0
    assert plan(found, frozenset(), None) is None
    found[0].rollback_at = None
    assert plan(found, frozenset({17}), None) is None


def _loop(run, shm, steps, *, step_after=False, telemetry=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpoints.from_env(run, every_steps=10, fsync=False, memory_snapshots_every=4,
                                memory_snapshots_dir=str(shm), telemetry=telemetry)
    start = ckpt.resume(model=model, optimizer=opt)
    for step in range(start, steps):
        model(torch.randn(2, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.maybe_save(step + 1, model=model, optimizer=opt)
    x = torch.randn(2, 8)
    model(x).square().mean().backward()  # the step in flight fails ...
    if step_after:
        opt.step()  # ... after its optimizer step: the state is no step's any more
    return ckpt, start, model, x


def test_a_failing_rank_gasps_its_step_only_while_its_state_is_still_that_step(tmp_path):
    run, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    failed, _, model, in_flight = _loop(run, shm, 7)  # snapshots of steps 1, 5 (every 4)
    weights = model.weight.detach().clone()
    try:
        raise RuntimeError("Connection closed by peer")
    except RuntimeError:
        failed.checkpointer.close()  # the trainer's and ``with Checkpoints``' failure path
    (gasp,) = RunDir(run).events("memory_snapshot_gasp")
    assert gasp["step"] == 7 and gasp["written"] and "Connection closed" in gasp["trigger"]
    _, start, model, again = _loop(run, shm, 7)
    assert start == 7 and torch.equal(model.weight, weights)
    assert torch.equal(again, in_flight)  # the RNGs as step 7 ended: the same batch again
    (resumed,) = RunDir(run).events("checkpoint_resumed")
    assert resumed["state_from"] == "dying gasp" and resumed["steps_lost"] == 0

    run2 = tmp_path / "run2"
    failed, _, _, _ = _loop(run2, shm, 7, step_after=True)
    failed.checkpointer.close()
    (gasp,) = RunDir(run2).events("memory_snapshot_gasp")
    assert not gasp["written"] and gasp["why_not"] == "an optimizer step began after step 7"
    _, start, _, _ = _loop(run2, shm, 7)
    assert start == 5  # the newest snapshot, as without the gasp


def test_the_supervisor_asks_for_the_gasp_and_waits_only_for_ranks_that_can_answer(tmp_path):
    """A stall restart's ask (control/gasp_request.py): rank 0, its loop blocked, answers
    from its telemetry thread with step 7 written; rank 1, frozen (its heartbeat stopped),
    is not waited for. The teardown that follows writes step 7 no second time."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    tel = Telemetry(run, heartbeat_interval=0.05, exchange_every=0).start()
    try:
        ckpt, _, model, _ = _loop(run, shm, 7, telemetry=tel)
        weights = model.weight.detach().clone()
        status = RunDir(run).status_dir / "rank-00000.json"
        mine = wait_for(lambda: (d := json.loads(status.read_text()))["checkpoint"][
            "memory_snapshots"]["every_steps"] == 4 and d, 30, interval=0.05,
            what="rank 0's status with its snapshots every 4 steps")
        frozen = {**mine, "rank": 1, "heartbeat_at": time.time() - 60}
        (status.parent / "rank-00001.json").write_text(json.dumps(frozen))
        summary = ask_survivors(RunDir(run), "stall_restart (TrainingStallSuspected)")
        ckpt.checkpointer.close()  # the kill's teardown, had there been one
    finally:
        tel.close()
    assert summary is not None and summary["seconds"] < WAIT_SECONDS, summary
    assert summary["answers"] == [{"rank": 0, "step": 7, "written": True, "why_not": None}]
    assert summary["not_answering"] == [1] and summary["missing"] == []
    journal = RunDir(run)
    (asked,) = journal.events("gasp_requested")
    assert asked["waiting_for"] == [0] and asked["not_answering"] == [1]
    (answered,) = journal.events("gasp_answered")
    assert answered["steps_written"] == [7]
    (gasp,) = journal.events("memory_snapshot_gasp")  # once: not again at the teardown
    assert gasp["trigger"].startswith("requested by the supervisor (gasp request 1")
    _, start, model, _ = _loop(run, shm, 7)
    assert start == 7 and torch.equal(model.weight, weights)
    # Nothing to ask where no rank keeps snapshots every K > 1 steps.
    assert ask_survivors(RunDir(tmp_path / "empty").create(), "stall_restart") is None
