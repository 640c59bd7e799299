"""The beat file: fixed size, rewritten in place, CRC-checked; the agent takes it over a
stale status file and reads "cannot publish" from it."""

from __future__ import annotations

import os
import time

from agent_helpers import collector, make_ctx, value, write_status
from trainwatch.rundir.beat import (BEAT_BYTES, MERGED_COUNTERS, MERGED_FIELDS, MERGED_METRICS,
                             BeatWriter, beat_path, decode, encode, merge_beat, own_window,
                             read_beat)
from trainwatch.rundir.run_dir import RunDir


def test_beat_is_fixed_size_rewritten_in_place_and_torn_records_are_dropped(tmp_path):
    path = tmp_path / "rank-00000.beat"
    writer = BeatWriter(path)
    inode = os.stat(path).st_ino
    for step in range(3):
        writer.write({"rank": 0, "step": step, "last_publish_error": "x" * 5000})
    writer.close()
    assert os.stat(path).st_size == BEAT_BYTES and os.stat(path).st_ino == inode
    assert read_beat(path)["step"] == 2
    data = encode({"rank": 0, "step": 7})
    assert decode(data)["step"] == 7
    assert decode(data[:20] + b"9" + data[21:]) is None  # a byte changed mid-write
    assert decode(b"garbage") is None and decode(b"") is None


def test_agent_takes_a_fresh_beat_over_a_stale_status_and_reports_cannot_publish(tmp_path):
    run = RunDir(tmp_path / "run").create()
    old = time.time() - 120
    write_status(run, 0, os.getpid(), heartbeat_at=old, last_progress_at=old, step=3)
    writer = BeatWriter(beat_path(run.status_dir, 0))
    now = time.time()
    writer.write({"v": 1, "rank": 0, "pid": os.getpid(), "state": "running",
                  "heartbeat_at": now, "step": 900, "last_progress_at": now - 0.5,
                  "steps_total": 901, "phase": "forward", "phase_since": now - 0.1,
                  "publish_errors_total": 42, "publish_failing_since": now - 60,
                  "last_publish_error": "OSError(28, 'No space left on device')"})
    result = collector(make_ctx([run.root]), "ranks").collect()
    (rank,) = result.data["jobs"][0]["ranks"]
    assert rank["step"] == 900 and rank["heartbeat_age"] < 5 and rank["progress_age"] < 5
    assert rank["publish"]["failing"] and "No space" in rank["publish"]["last_error"]
    assert value(result, "trainwatch_rank_publish_failing", rank=0) == 1
    assert value(result, "trainwatch_rank_steps_total", rank=0) == 901
    # a beat of another process (an earlier start) is ignored
    writer.write({"v": 1, "rank": 0, "pid": 1, "heartbeat_at": time.time(), "step": 5})
    result = collector(make_ctx([run.root]), "ranks").collect()
    assert result.data["jobs"][0]["ranks"][0]["step"] == 3
    writer.close()


def test_a_rank_whose_clock_is_5_min_behind_is_neither_stale_nor_gone(tmp_path):
    """The agent measures a rank of its own machine on the shared monotonic clock, and tells
    its process by the kernel's start time: a rank's wall clock 300 s behind changes
    nothing (it made the rank look 300 s stale at first sight, and its process "gone")."""
    import psutil

    from trainwatch.node import boot_id

    run = RunDir(tmp_path / "run").create()
    behind = time.time() - 300
    write_status(run, 0, os.getpid(), started_at=behind - 5, heartbeat_at=behind,
                 last_progress_at=behind - 0.2, phase_since=behind - 0.1,
                 heartbeat_mono=time.monotonic(), boot=boot_id(),
                 process_created_at=psutil.Process().create_time())
    result = collector(make_ctx([run.root]), "ranks").collect()
    (rank,) = result.data["jobs"][0]["ranks"]
    assert rank["heartbeat_age"] < 5 and rank["progress_age"] < 5, rank
    assert rank["process"]["status"] != "gone"
    assert value(result, "trainwatch_rank_up", rank=0) == 1
    # another boot's monotonic reading says nothing about ours: the wall clock stands
    write_status(run, 0, os.getpid(), heartbeat_at=behind, heartbeat_mono=time.monotonic(),
                 boot="another-boot")
    result = collector(make_ctx([run.root]), "ranks").collect()
    assert result.data["jobs"][0]["ranks"][0]["heartbeat_age"] > 290


def _largest_beat(window, **extra):
    """A beat record with the largest values each field takes."""
    return {"v": 1, "rank": 32767, "pid": 4194304, "state": "running",
            "heartbeat_at": 1733333333.1234567, "heartbeat_mono": 123456.12345678901,
            "boot": "0c5c3f70-6a5e-4a5c-9d1e-0f3f1d2a3b4c", "step": 123456789,
            "steps_completed": 123456789, "last_progress_at": 1733333333.1234567,
            "steps_total": 123456789, "phase": "optimizer", "phase_since": 1733333333.1234567,
            "phase_budget": 1234.5, "step_time_seconds": 0.12345678901234567,
            "timing_step": 123456780, "window": window, "replica_step": 123456700,
            "publish_errors_total": 0, "publish_failing_since": None,
            "last_publish_error": None, **extra}

def test_the_window_fits_a_full_beat_and_only_the_window_gives_way(tmp_path):
    """A rank's beat carries its own part of the newest timing window; with the largest
    values a beat holds it fits, and a record that would not (a long publish error) loses
    its window, never the beat: readers then take the window from the status."""
    window = own_window({"step": 123456780, "window_steps": 100000, "time": 1733333333.1234567,
                         "compute_seconds": 0.12345678901234567,
                         "data_wait_seconds": 0.0012345678901234567,
                         "local_seconds": 0.12345678901234567,
                         "recent": [[123456780, 1.0234, -12.123]] * 8, "job": {"ranks": 9}})
    assert "job" not in window and "compute_seconds" not in window
    record = _largest_beat(window)
    assert decode(encode(record))["window"] == window
    failing = dict(record, publish_errors_total=123456, publish_failing_since=1733333333.25,
                   last_publish_error="x" * 400)
    beat = decode(encode(failing))
    assert "window" not in beat and beat["timing_step"] == 123456780
    assert beat["last_publish_error"] == "x" * 160


def test_a_beat_replaces_only_the_fields_readers_are_told_it_may():
    """The ranks collector keeps the rows it made of a parsed status while the status
    stands and remakes only what a beat may replace: ``merge_beat`` must touch nothing else."""
    status = {"rank": 0, "pid": 7, "heartbeat_at": 1.0, "step": 1, "restart_count": 0,
              "phase_budgets": {"load": 60.0}, "backend": "gloo",
              "metrics": {"loss": 2.0, "step": 1, "step_time_seconds": 0.5, "lr": 0.1},
              "counters": {"steps_total": 1, "telemetry_errors_total": 3}}
    beat = {"rank": 0, "pid": 7, "heartbeat_at": 2.0, "heartbeat_mono": 9.0, "step": 5,
            "steps_completed": 5, "last_progress_at": 2.0, "phase": "load", "phase_since": 2.0,
            "state": "running", "phase_budget": 90.0, "steps_total": 5, "step_time_seconds": 0.25}
    merged, _ = merge_beat(status, beat)
    assert {k for k in merged if merged[k] != status.get(k)} <= MERGED_FIELDS
    assert {k for k in merged["metrics"] if merged["metrics"][k] != status["metrics"][k]} \
        <= MERGED_METRICS
    assert {k for k in merged["counters"] if merged["counters"][k] != status["counters"][k]} \
        <= MERGED_COUNTERS


def test_a_beat_with_a_long_non_ascii_error_and_phase_is_still_written(tmp_path):
    """The beat is the rank's liveness when its disk is full: a publish error with a non-ASCII
    path (each character escaped to 6 bytes of JSON) or a long phase name of the user's own
    must cost the beat some words, never the beat, or a full disk reads as a frozen rank."""
    record = {"v": 1, "rank": 3, "pid": 4194304, "state": "running",
              "heartbeat_at": 1733333333.1234567, "step": 123456789,
              "last_progress_at": 1733333333.1234567, "phase": "données-" * 200,
              "phase_since": 1733333333.1234567, "timing_step": 123456780,
              "window": own_window({"step": 123456780, "window_steps": 10, "time": 1.0,
                                    "local_seconds": 0.1, "recent": [[1, 1.0, 0.0]] * 8}),
              "publish_errors_total": 7, "publish_failing_since": 1733333333.25,
              "last_publish_error": "[Errno 28] No space left on device: '/données/über/"
                                    + "é" * 200 + "'"}
    writer = BeatWriter(beat_path(tmp_path, 3))
    writer.write(record)
    writer.close()
    beat = read_beat(beat_path(tmp_path, 3))
    assert beat is not None and os.path.getsize(beat_path(tmp_path, 3)) == BEAT_BYTES
    assert {k: beat[k] for k in ("heartbeat_at", "step", "state", "publish_failing_since")} == \
        {k: record[k] for k in ("heartbeat_at", "step", "state", "publish_failing_since")}
    assert beat["last_publish_error"].startswith("[Errno 28] No space left on device")
    assert record["phase"].startswith(beat["phase"]) and beat["phase"]


def test_collective_progress_gives_way_from_its_tail_then_after_the_window():
    """A beat with the largest values and every group a rank may carry (counts up to 10^9
    collectives) keeps its window and the first groups (the writer puts the one the rank
    waits in first); a record short of room loses the rest of the groups after the window,
    never the beat."""
    from trainwatch.contract.collectives import MAX_GROUPS, read_field
    groups = {str(n): [123456789, 123456788 + (n > 0)] for n in range(MAX_GROUPS)}
    window = own_window({"step": 123456780, "window_steps": 100000, "time": 1733333333.1234567,
                         "local_seconds": 0.12345678901234567,
                         "data_wait_seconds": 0.0012345678901234567,
                         "recent": [[123456780, 1.0234, -12.123]] * 8})
    record = _largest_beat(window, collectives=groups)
    beat = decode(encode(record))
    assert beat["window"] == window and 4 <= len(beat["collectives"]) < MAX_GROUPS
    assert list(beat["collectives"]) == list(groups)[:len(beat["collectives"])]
    assert read_field(beat["collectives"])["0"] == (123456789, 123456788)
    failing = dict(record, publish_errors_total=123456, publish_failing_since=1733333333.25,
                   last_publish_error="é" * 400, phase="données-" * 200)
    beat = decode(encode(failing))
    assert beat["heartbeat_at"] == record["heartbeat_at"] and "window" not in beat
    assert beat["collectives"] is None and beat["publish_failing_since"] == 1733333333.25
