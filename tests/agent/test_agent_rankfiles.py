"""The agent reads a rank's beat every second and its status only when the beat cannot
stand in for it: real files, a clock the test moves."""

from __future__ import annotations

import time

from trainwatch.agent.rankfiles import RankFiles
from trainwatch.rundir.beat import BeatWriter, beat_path, own_window
from trainwatch.contract.timing import job_window, summarize
from trainwatch.rundir.run_dir import RunDir


def status(run: RunDir, rank: int, pid: int, **extra) -> None:
    run.write_status(rank, {"job": "exp", "rank": rank, "pid": pid, "state": "running",
                            "heartbeat_at": time.time(), "step": 1, **extra})


def beat(writer: BeatWriter, rank: int, pid: int, at: float, state: str = "running",
         step: int = 2, **extra) -> None:
    writer.write({"v": 1, "rank": rank, "pid": pid, "state": state, "heartbeat_at": at,
                  "step": step, "last_progress_at": at, **extra})


def loss(files: RankFiles, run: RunDir, mono: float) -> object:
    result, beats = files.read(run, mono)
    assert [r["rank"] for r in result.records] == [0] and beats[0] is not None
    return result.records[0].get("loss")


def test_status_is_read_again_only_when_the_beat_cannot_stand_in_for_it(tmp_path):
    run = RunDir(tmp_path / "run").create()
    writer = BeatWriter(beat_path(run.status_dir, 0))
    files = RankFiles(refresh=5.0)
    try:
        status(run, 0, 100, loss=1.0)
        beat(writer, 0, 100, 1000.0)
        assert loss(files, run, 0.0) == 1.0
        status(run, 0, 100, loss=2.0)
        beat(writer, 0, 100, 1001.0)
        assert loss(files, run, 1.0) == 1.0    # the beat moved: the status read at 0 stands
        assert loss(files, run, 2.0) == 2.0    # the beat did not move: read again
        status(run, 0, 100, loss=3.0)
        beat(writer, 0, 100, 1002.0)
        assert loss(files, run, 3.0) == 2.0
        beat(writer, 0, 100, 1003.0)
        assert loss(files, run, 7.0) == 3.0    # refresh seconds since the last read
        status(run, 0, 200, loss=4.0)          # restarted: a new process, read at once
        beat(writer, 0, 200, 1004.0)
        assert loss(files, run, 8.0) == 4.0
        status(run, 0, 200, loss=5.0, state="finished")
        beat(writer, 0, 200, 1005.0, state="finished")
        assert loss(files, run, 9.0) == 5.0    # another state: read at once
    finally:
        writer.close()


def test_status_is_read_as_soon_as_the_beat_names_a_new_timing_window(tmp_path):
    """Straggler verdicts count in windows: none may be skipped between refreshes, the
    first ones of a run neither (a status read before its first window has no window
    size to tell when the next is due)."""
    run = RunDir(tmp_path / "run").create()
    writer = BeatWriter(beat_path(run.status_dir, 0))
    files = RankFiles(refresh=3600.0)
    try:
        status(run, 0, 100, loss=1.0, timing=None)
        beat(writer, 0, 100, 1000.0, step=3, timing_step=None)
        assert loss(files, run, 0.0) == 1.0
        status(run, 0, 100, loss=2.0, timing={"step": 9, "window_steps": 10})
        beat(writer, 0, 100, 1001.0, step=10, timing_step=9)
        assert loss(files, run, 1.0) == 2.0    # the beat names a window the kept one lacks
        status(run, 0, 100, loss=3.0, timing={"step": 9, "window_steps": 10})
        beat(writer, 0, 100, 1002.0, step=25, timing_step=9)
        assert loss(files, run, 2.0) == 2.0    # past step 19, but window 19 is not out yet
        status(run, 0, 100, loss=4.0, timing={"step": 19, "window_steps": 10})
        beat(writer, 0, 100, 1003.0, step=26, timing_step=19)
        assert loss(files, run, 3.0) == 4.0
    finally:
        writer.close()


def test_status_is_read_every_time_once_a_new_timing_window_is_due(tmp_path):
    """A beat that does not name its window (an older writer): the status is read every
    time once the rank steps past the end of the next window, until it carries it."""
    run = RunDir(tmp_path / "run").create()
    writer = BeatWriter(beat_path(run.status_dir, 0))
    files = RankFiles(refresh=3600.0)
    window = {"step": 10, "window_steps": 10}
    try:
        status(run, 0, 100, loss=1.0, timing=window)
        beat(writer, 0, 100, 1000.0, step=12)
        assert loss(files, run, 0.0) == 1.0
        status(run, 0, 100, loss=2.0, timing=window)
        beat(writer, 0, 100, 1001.0, step=19)
        assert loss(files, run, 1.0) == 1.0    # the next window ends at step 20
        status(run, 0, 100, loss=3.0, timing=window)
        beat(writer, 0, 100, 1002.0, step=20)
        assert loss(files, run, 2.0) == 3.0    # due: read, though it is not there yet
        status(run, 0, 100, loss=4.0, timing=window)
        beat(writer, 0, 100, 1003.0, step=21)
        assert loss(files, run, 3.0) == 4.0    # still due: read again
        status(run, 0, 100, loss=5.0, timing={"step": 20, "window_steps": 10})
        beat(writer, 0, 100, 1004.0, step=22)
        assert loss(files, run, 4.0) == 5.0
        status(run, 0, 100, loss=6.0, timing={"step": 20, "window_steps": 10})
        beat(writer, 0, 100, 1005.0, step=23)
        assert loss(files, run, 5.0) == 5.0    # the new window is in: not due any more
    finally:
        writer.close()


def test_a_rank_without_a_usable_beat_has_its_status_read_every_time(tmp_path):
    run = RunDir(tmp_path / "run").create()
    files = RankFiles(refresh=3600.0)
    status(run, 0, 100, loss=1.0)
    result, beats = files.read(run, 0.0)
    assert result.records[0]["loss"] == 1.0 and beats == {0: None}
    status(run, 0, 100, loss=2.0)
    assert files.read(run, 1.0)[0].records[0]["loss"] == 2.0
    beat_path(run.status_dir, 0).write_bytes(b"torn")
    status(run, 0, 100, loss=3.0)
    assert files.read(run, 2.0)[0].records[0]["loss"] == 3.0
    run.status_file(0).unlink()  # gone: forgotten, not served from memory
    assert files.read(run, 3.0)[0].records == []


def test_a_restarted_rank_is_never_judged_on_its_old_process(tmp_path):
    """The ranks collector with a long refresh: after a restart the new pid's status is
    read in the same collection, so the rank is up, not a dead process."""
    import subprocess

    from agent_helpers import collector, make_ctx, value

    run = RunDir(tmp_path / "run").create()
    writer = BeatWriter(beat_path(run.status_dir, 0))
    old, new = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    ranks = collector(make_ctx([run.root], collectors={"ranks": {"status_every": 3600}}),
                      "ranks")
    try:
        status(run, 0, old.pid, started_at=time.time(), last_progress_at=time.time())
        beat(writer, 0, old.pid, time.time())
        assert value(ranks.collect(), "trainwatch_rank_up") == 1
        old.kill()
        old.wait()
        status(run, 0, new.pid, started_at=time.time(), last_progress_at=time.time())
        beat(writer, 0, new.pid, time.time())
        result = ranks.collect()
        assert value(result, "trainwatch_rank_up") == 1
        assert result.data["jobs"][0]["ranks"][0]["pid"] == new.pid
    finally:
        writer.close()
        for p in (old, new):
            p.kill()
            p.wait()


def test_status_is_read_as_soon_as_the_beat_names_a_new_parameter_digest(tmp_path):
    """Replica verdicts compare every digest: a beat naming a newer one (``replica_step``)
    makes the agent read the status at once, not ``refresh`` seconds later."""
    run = RunDir(tmp_path / "run").create()
    writer = BeatWriter(beat_path(run.status_dir, 0))
    files = RankFiles(refresh=3600.0)
    digest = {"group": 0, "bits": "0" * 16, "norm": None, "tolerance": None}
    try:
        status(run, 0, 100, loss=1.0, replicas=[{"step": 9, **digest}])
        beat(writer, 0, 100, 1000.0, replica_step=9)
        assert loss(files, run, 0.0) == 1.0
        status(run, 0, 100, loss=2.0, replicas=[{"step": 9, **digest}])
        beat(writer, 0, 100, 1001.0, replica_step=9)
        assert loss(files, run, 1.0) == 1.0    # same digest: the kept status stands
        status(run, 0, 100, loss=3.0, replicas=[{"step": 9, **digest}, {"step": 19, **digest}])
        beat(writer, 0, 100, 1002.0, replica_step=19)
        assert loss(files, run, 2.0) == 3.0    # a new digest: read now
    finally:
        writer.close()


def timing(step: int, local: float, job: dict) -> dict:
    return {"step": step, "window_steps": 10, "time": 1000.0 + step, "compute_seconds": local,
            "data_wait_seconds": 0.001, "local_seconds": local, "job": job,
            "recent": [[step, round(local / 0.1, 4), 0.5]]}


def windows(run: RunDir, writers: list[BeatWriter], step: int, at: float, loss: float,
            node: str = "n1") -> dict[int, dict]:
    """Every rank publishes window ``step`` (status, then its beat), as the telemetry does."""
    job = summarize([0.1 + r / 100 for r in range(len(writers))], half_width=len(writers))
    written = {}
    for rank, writer in enumerate(writers):
        written[rank] = timing(step, 0.1 + rank / 100, job)
        status(run, rank, 100 + rank, loss=loss, node=node, restart_count=0,
               timing=written[rank])
        beat(writer, rank, 100 + rank, at, step=step + 1, timing_step=step,
             window=own_window(written[rank]))
    return written


def test_a_new_window_takes_one_status_for_every_local_rank(tmp_path):
    """The beat carries the rank's own part of a new window, and the job summary is the
    same on every rank: one status of that window is parsed, not one per rank, and the
    straggler input is the same as from every rank's status."""
    run = RunDir(tmp_path / "run").create()
    writers = [BeatWriter(beat_path(run.status_dir, r)) for r in range(3)]
    files = RankFiles(refresh=3600.0)
    try:
        windows(run, writers, 9, 1000.0, loss=1.0)
        files.read(run, 0.0)
        written = windows(run, writers, 19, 1001.0, loss=2.0)
        records = files.read(run, 1.0)[0].records
        assert [r["loss"] for r in records] == [2.0, 1.0, 1.0]  # one status parsed
        assert job_window({r["rank"]: r["timing"] for r in records}) == job_window(written)
    finally:
        for writer in writers:
            writer.close()


def test_a_window_whose_summary_was_not_read_takes_each_rank_s_status(tmp_path):
    """No status of the beat's window could be read (written later, or a full disk): each
    rank's own status is read, as before the beat carried its window."""
    run = RunDir(tmp_path / "run").create()
    writers = [BeatWriter(beat_path(run.status_dir, r)) for r in range(2)]
    files = RankFiles(refresh=3600.0)
    try:
        windows(run, writers, 9, 1000.0, loss=1.0)
        files.read(run, 0.0)
        old = windows(run, writers, 9, 1001.0, loss=2.0)
        for rank, writer in enumerate(writers):  # the beats name window 19, no status has it
            beat(writer, rank, 100 + rank, 1002.0, step=20, timing_step=19,
                 window=dict(own_window(old[rank]), time=2000.0))
        records = files.read(run, 1.0)[0].records
        assert [r["loss"] for r in records] == [2.0, 2.0]
        assert {r["timing"]["step"] for r in records} == {9}
    finally:
        for writer in writers:
            writer.close()


def test_a_hostile_beat_window_is_never_grafted_and_never_breaks_a_read(tmp_path):
    """Any bytes may be in a beat: a window or window step of the wrong type makes the
    agent read that rank's own status, as a beat without a window does."""
    run = RunDir(tmp_path / "run").create()
    writers = [BeatWriter(beat_path(run.status_dir, r)) for r in range(2)]
    files = RankFiles(refresh=3600.0)
    hostile = [(None, [1, 2]), (None, "w"), ([19], {}), ("19", {}), (True, {})]
    # None: the new window's step (a window of the wrong type, or a step that is not one)
    try:
        windows(run, writers, 9, 1000.0, loss=1.0)
        files.read(run, 0.0)
        for n, (step, window) in enumerate(hostile, start=1):
            written = windows(run, writers, 9 + 10 * n, 1000.0 + n, loss=float(n))
            beat(writers[1], 1, 101, 1000.5 + n, step=10 * n + 10,
                 timing_step=9 + 10 * n if step is None else step, window=window)
            records = files.read(run, float(n))[0].records
            assert [r["loss"] for r in records] == [float(n), float(n)], (step, window)
            assert records[1]["timing"] == written[1]
        # A window of the right type with values of the wrong ones is taken as the rank's
        # (it could write its status as well): its window is then unusable, like such a status.
        windows(run, writers, 99, 2000.0, loss=9.0)
        beat(writers[1], 1, 101, 2000.5, step=100, timing_step=99,
             window={"recent": 5, "local_seconds": "x", "time": [1]})
        records = files.read(run, 99.0)[0].records
        assert list(job_window({r["rank"]: r["timing"] for r in records})["local"]) == [0]
    finally:
        for writer in writers:
            writer.close()


def test_a_status_file_that_did_not_change_is_not_parsed_again(tmp_path, monkeypatch):
    """A stalled job's beats stop moving, which asks for each status every second: the
    same file (inode, size, times) keeps its parsed record; a rewritten one is parsed."""
    run = RunDir(tmp_path / "run").create()
    writer = BeatWriter(beat_path(run.status_dir, 0))
    files = RankFiles(refresh=5.0)
    parsed: list[str] = []
    read_status = run.read_status
    monkeypatch.setattr(run, "read_status",
                        lambda path, folder=None: parsed.append(path) or read_status(path, folder))
    try:
        status(run, 0, 100, loss=1.0)
        beat(writer, 0, 100, 1000.0)
        assert loss(files, run, 0.0) == 1.0 and len(parsed) == 1
        for mono in (1.0, 2.0, 3.0, 9.0):  # the beat never moves; refresh seconds pass too
            assert loss(files, run, mono) == 1.0
        assert len(parsed) == 1
        status(run, 0, 100, loss=2.0)          # rewritten (renamed over): parsed again
        assert loss(files, run, 10.0) == 2.0 and len(parsed) == 2
    finally:
        writer.close()


def test_parsed_statuses_of_one_window_share_its_summary_and_keep_their_own_values(tmp_path):
    """Every local rank's status carries the same job summary (all-reduced): those parsed
    hold one copy of it (at 256 ranks each is 256 numbers), and a status whose summary of
    that window is not equal keeps its own."""
    run = RunDir(tmp_path / "run").create()
    writers = [BeatWriter(beat_path(run.status_dir, r)) for r in range(3)]
    try:
        written = windows(run, writers, 9, 1000.0, loss=1.0)
        records = RankFiles(refresh=3600.0).read(run, 0.0)[0].records  # each one parsed
        assert all(r["timing"]["job"] is records[0]["timing"]["job"] for r in records)
        assert records[0]["timing"]["job"] == written[0]["job"]
        other = dict(written[0]["job"], median=9.0)
        status(run, 2, 102, loss=1.0, node="n1", restart_count=0, timing=timing(9, 0.12, other))
        records = RankFiles(refresh=3600.0).read(run, 1.0)[0].records
        assert [r["timing"]["job"]["median"] for r in records] == \
            [written[0]["job"]["median"]] * 2 + [9.0]
    finally:
        for writer in writers:
            writer.close()
