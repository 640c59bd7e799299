"""The dying gasp (memory_snapshots/dying_gasp.py, gasp_resume.py): the rule that picks the
newest step every rank can restore, and an own loop whose rank writes its step at a failure
only while its state is still that step's. The real torchrun SIGKILL drill is
tests/rank/test_checkpoint_resume.py (K pinned at 4, resumed from rank 0's gasp); the
supervisor's request before a stall restart, end to end: tests/control/test_alert_run_e2e.py;
the gasp at a SIGTERM that finds the loop blocked in C, under torchrun, here."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from agent_helpers import REPO, wait_for
from trainwatch import Checkpoints, Telemetry
from trainwatch.control.gasp_request import WAIT_SECONDS, ask_survivors
from trainwatch.rank.memory_snapshots.agree import Found
from trainwatch.rank.memory_snapshots import store
from trainwatch.rank.memory_snapshots.gasp_on_term import GaspOnTerm
from trainwatch.rank.memory_snapshots.gasp_resume import GASP, OWN, plan
from trainwatch.rank.memory_snapshots.peer_gasp_fetch import choose, offers_here
from trainwatch.rank.memory_snapshots.peer_store import PeerStore
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


def test_a_second_gasp_of_the_step_waits_for_the_first_ones_write(tmp_path, monkeypatch):
    """The SIGTERM reader (or a request) started the gasp; the teardown that follows must
    not return, and let the process exit, before that write is sealed. Before, it
    returned at once with the facts of no write."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    ckpt, _, _, _ = _loop(run, shm, 7)
    gasp = ckpt.checkpointer.gasp
    write, release = gasp._write, threading.Event()

    def slow_write(reason):
        release.wait(10)
        return write(reason)
    monkeypatch.setattr(gasp, "_write", slow_write)
    first = threading.Thread(target=gasp.gasp, args=("SIGTERM while blocked",))
    first.start()
    wait_for(lambda: gasp._gasped == 7, 10, interval=0.01, what="the first gasp started")
    threading.Timer(0.2, release.set).start()
    facts = gasp.gasp("the teardown")
    first.join(10)
    assert facts["written"] and facts["step"] == 7, facts
    ckpt.checkpointer.close()
    (event,) = RunDir(run).events("memory_snapshot_gasp")
    assert event["trigger"] == "SIGTERM while blocked"


def test_the_sigterm_gasp_leaves_a_scripts_own_wakeup_fd_alone():
    """A script (asyncio, a signal loop) set its wakeup fd: it is not replaced, and the
    SIGTERM-time gasp says it is off; with none set, ours is set and given back at close."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    theirs = GaspOnTerm(lambda reason: None)
    try:
        signal.set_wakeup_fd(write)
        assert not theirs.start() and "its own signal wakeup fd" in str(theirs.off_reason)
        assert signal.set_wakeup_fd(-1) == write  # still theirs
        ours = GaspOnTerm(lambda reason: None)
        assert ours.start() and signal.set_wakeup_fd(ours._write) == ours._write
        pid = os.fork()  # a data loader's worker: its signals are not the rank's
        if pid == 0:
            os._exit(0 if signal.set_wakeup_fd(-1) == -1 else 1)
        assert os.waitpid(pid, 0)[1] == 0  # the child gave the wakeup fd up
        ours.close()
        assert signal.set_wakeup_fd(-1) == -1
    finally:
        signal.set_wakeup_fd(-1)
        os.close(read)
        os.close(write)



def test_a_main_thread_waiting_in_close_is_not_taken_for_stuck():
    """The stop's SIGTERM starts the watch; the teardown then closes us and waits in our
    join, which looks like a main thread stuck in C. Before, the watch ran its full second
    (holding every failed rank's exit up by it, seen at 0.96 s) and then gasped a second
    time; now close() ends it at once."""
    import threading
    import time

    watch = GaspOnTerm(lambda reason: None)
    verdict: list[bool] = []

    def watch_once() -> None:
        time.sleep(0.2)  # the main thread is in its join by now
        verdict.append(watch._main_thread_stuck())

    watcher = threading.Thread(target=watch_once)
    threading.Timer(0.4, watch._closing.set).start()  # close() begins while we wait in C
    began = time.monotonic()
    watcher.start()
    watcher.join()  # the main thread in C, on one bytecode, as in close()'s join
    assert verdict == [False] and time.monotonic() - began < 1.0

@pytest.mark.slow
def test_a_survivor_blocked_in_its_all_reduce_gasps_at_torchruns_sigterm(tmp_path):
    """Rank 1 (node-1's only rank) is SIGKILLed in step 9 while rank 0 (node-0) waits in
    that step's all_reduce, which a child of rank 1 keeps from failing (its sockets stay
    open). torchrun SIGTERMs rank 0, whose Python handler cannot run while it is in C:
    before, no gasp until the all_reduce failed 10 s later (or torchrun's SIGKILL 30 s
    after its SIGTERM), and with snapshots every 4 steps (1, 5, ...) the restart lost 3
    steps. Now the wakeup fd's reader gasps step 8 within a second or two
    (tests/jobs/blocked_survivor_job.py), and node-1, with no survivor, can take it with
    its part of step 8 from its peer. (The restart itself is not run here, to spare CI a
    second torchrun: docs/memory-snapshots.md gives the measured run.)"""
    shm, out, run_dir = tmp_path / "shm", tmp_path / "out", tmp_path / "run"
    shm.mkdir(), out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINWATCH_RUN_DIR": str(run_dir),
           "OMP_NUM_THREADS": "1"}
    log = tmp_path / "job.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--monitor-interval", "0.1", "tests/jobs/blocked_survivor_job.py", str(shm),
           str(out), "10", "8"]
    with open(log, "wb") as sink:
        job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        assert job.wait(120) != 0, log.read_text()[-3000:]  # rank 1 killed, rank 0 failed
    finally:
        job.kill()
        holder = out / "holder.pid"
        if holder.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(holder.read_text()), signal.SIGKILL)
    (gasp,) = RunDir(run_dir).events("memory_snapshot_gasp")
    assert gasp["rank"] == 0 and gasp["step"] == 8 and gasp["written"], gasp
    assert gasp["trigger"].startswith("SIGTERM while the main thread was blocked in C"), gasp

    # Rank 1 was node-1's only rank: no survivor there to gasp, its newest whole state
    # the snapshot of step 5 (the restart's before). Its part of step 8 reached rank 0 on
    # node-0 (sent every step), so the rule of peer_gasp_fetch.py takes step 8: rank 0's
    # gasp, sent to rank 1, with rank 1's own part (the transfers: test_peer_gasp.py).
    root = Path(gasp["path"]).parents[2]
    config = store.sealed_file(Path(gasp["path"])).config_hash
    assert max(s.step for s in store.sealed(store.rank_folder(root, 1))) == 5
    assert 8 in {c.snapshot.step for c in PeerStore(root / "held-parts").copies(1)}
    offers = [offers_here(SimpleNamespace(root=root, rank=rank, world_size=2, config_hash=config),
                          SimpleNamespace(holding=[1 - rank], receiver=SimpleNamespace(
                              parts=PeerStore(root / "held-parts"))))
              for rank in (0, 1)]
    chosen = choose(offers, [0, 1], 5, frozenset(), None)
    assert chosen is not None and chosen.step == 8, offers
    assert [(o.holder, o.kind) for o in chosen.shared] == [(0, "gasp"), (0, "gasp")]
    assert chosen.part[0] is None and chosen.part[1].rank == 1
