"""Telemetry from a plain torch loop (not trainwatch's trainer) produces the run-directory contract."""

import json
import math
import statistics

import time

import torch

from agent_helpers import wait_for
from conftest import run_torchrun
from trainwatch.contract.timing import median_without
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rank.telemetry import Telemetry
from trainwatch.rank.timing_exchange import sketch_of


def test_plain_ddp_loop_publishes_the_contract(tmp_path, repo):
    run_dir = tmp_path / "run"
    proc = run_torchrun(tmp_path, str(repo / "examples/plain_loop.py"), str(run_dir), "30")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunDir(run_dir)
    statuses = run.statuses()
    assert statuses.skipped == []
    assert sorted(s["rank"] for s in statuses.records) == [0, 1]
    for status in statuses.records:
        assert status["state"] == "finished" and status["step"] == 29
        assert status["backend"] == "gloo" and status["world_size"] == 2
        assert status["counters"]["steps_total"] == 30
        assert status["counters"]["telemetry_errors_total"] == 0
        timing = status["timing"]  # its own means and the job's summary
        assert timing["compute_seconds"] > 0 and timing["local_seconds"] > 0
        assert timing["job"]["ranks"] == 2 and len(timing["job"]["middle"]) == 2
        # the summed sketch holds this rank's value: a reader can take it out again
        assert median_without(timing["job"], [timing["local_seconds"]]) is not None
    for rank in (0, 1):
        steps = [r for r in run.metrics(rank).records if r["kind"] == "step"]
        assert [r["step"] for r in steps] == list(range(30))
        assert all(math.isfinite(r["loss"]) and r["samples_per_second"] > 0 for r in steps)
        assert set(steps[0]["phase_seconds"]) == {"data", "forward", "backward", "optimizer"}
    assert {e["rank"] for e in run.events("rank_started")} == {0, 1}


def test_nonfinite_values_are_counted_and_errors_never_raise(tmp_path):
    started = time.time()
    tel = Telemetry(tmp_path, heartbeat_interval=60, exchange_every=0).start()
    with tel.step(0) as s:
        s.record(loss=torch.tensor(float("nan")), grad_norm=float("inf"), tokens=10)
    with tel.step(1) as s:
        s.record(loss=torch.tensor(1.5), tokens=10)
    # A broken run directory must not raise into the loop: it is counted instead.
    (tmp_path / "metrics").rename(tmp_path / "metrics-gone")
    (tmp_path / "metrics").write_text("not a directory")
    with tel.step(2) as s:
        s.record(loss=torch.tensor(1.0))
    tel.close()
    status = RunDir(tmp_path).statuses().records[0]
    assert status["counters"]["nonfinite_loss_total"] == 1
    assert status["counters"]["nonfinite_grad_norm_total"] == 1
    # when: alert rules read the time, which a counter first seen after the NaN lacks
    assert started <= status["last_nonfinite_loss_at"] <= time.time()
    assert status["counters"]["telemetry_errors_total"] >= 1
    assert status["metrics"]["step"] == 2 and status["metrics"]["loss"] == 1.0


def test_pending_buffer_is_bounded(tmp_path):
    tel = Telemetry(tmp_path, heartbeat_interval=3600, exchange_every=0, max_pending=5).start()
    for step in range(20):
        with tel.step(step) as s:
            s.record(loss=torch.tensor(1.0))
    assert len(tel._pending) == 5
    tel.close()
    status = RunDir(tmp_path).statuses().records[0]
    assert status["counters"]["pending_dropped_total"] == 15


def test_control_request_runs_handler_from_heartbeat_thread(tmp_path):
    seen = []
    tel = Telemetry(tmp_path, heartbeat_interval=0.05, exchange_every=0).start()
    tel.on_control("ping", lambda path: seen.append(path.name))
    (tmp_path / "control" / "ping").write_text("")
    try:
        wait_for(lambda: seen, 5, interval=0.05, what="the ping control handler")
    finally:
        tel.close()
    assert seen == ["ping"]


def test_phase_between_blocks_is_step_inside_and_idle_after(tmp_path):
    """Readers must not mistake a running loop for one still initialising."""
    tel = Telemetry(tmp_path, heartbeat_interval=3600, exchange_every=0).start()
    assert tel.state["phase"] == "init"
    with tel.step(0):
        with tel.phase("forward"):
            assert tel.state["phase"] == "forward"
        assert tel.state["phase"] == "step"
    assert tel.state["phase"] == "idle"
    tel.close()


def test_node_name_and_restart_count_can_be_given(tmp_path, monkeypatch):
    """Machines that share a hostname (network namespaces, pods) tell nodes apart by
    TRAINWATCH_NODE, in the status and in the journal; the trainer passes the job's
    restart count (torchrun's is per node)."""
    monkeypatch.setenv("TRAINWATCH_NODE", "gpu-node-17")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    tel = Telemetry(tmp_path, heartbeat_interval=3600, exchange_every=0, restart_count=2).start()
    tel.close()
    status = json.loads((tmp_path / "status" / "rank-00000.json").read_text())
    assert status["node"] == "gpu-node-17" and status["restart_count"] == 2
    started = RunDir(tmp_path).events("rank_started")
    assert [(e["host"], e["restart_count"]) for e in started] == [("gpu-node-17", 2)]


def test_nested_phases_restore_the_outer_one_even_with_the_same_name(tmp_path):
    """Phase blocks are reused per name, so nesting a name inside itself must still unwind."""
    tel = Telemetry(tmp_path, heartbeat_interval=3600, exchange_every=0).start()
    with tel.step(0):
        with tel.phase("forward"):
            with tel.phase("forward"):
                with tel.phase("data"):
                    assert tel.state["phase"] == "data"
                assert tel.state["phase"] == "forward"
            assert tel.state["phase"] == "forward"
        assert tel.state["phase"] == "step"
    assert tel.state["phase"] == "idle"
    tel.close()
    step = RunDir(tmp_path).metrics(0).records[0]
    assert set(step["phase_seconds"]) == {"forward", "data"}
    assert step["phase_seconds"]["forward"] >= step["phase_seconds"]["data"]


def test_phases_between_steps_stay_out_of_step_records(tmp_path):
    """Eval or checkpoint time between steps belongs to no step (pending records are the loop's
    hand-off to the heartbeat thread and must not change afterwards)."""
    tel = Telemetry(tmp_path, heartbeat_interval=3600, exchange_every=0).start()
    with tel.step(0):
        with tel.phase("forward"):
            pass
    with tel.phase("eval"):
        pass
    with tel.step(1):
        with tel.phase("backward"):
            pass
    tel.close()
    records = RunDir(tmp_path).metrics(0).records
    steps = [r for r in records if r["kind"] == "step"]
    assert [set(s["phase_seconds"]) for s in steps] == [{"forward"}, {"backward"}]
    # The evaluation is its own record after step 0 (report books it as evaluation).
    assert [(r["kind"], r["step"]) for r in records] == [("step", 0), ("eval", 0), ("step", 1)]


def test_status_file_size_does_not_grow_with_world_size(tmp_path):
    """A timing window of 32k ranks leaves a status as small as one of 1k: each rank keeps
    its own means, a fixed-size job summary and its standing in its last few windows,
    never a copy of every rank's values."""
    sizes = {}
    for world in (1024, 4096, 32768):
        tel = Telemetry(tmp_path / str(world), rank=world - 1, world_size=world,
                        exchange_every=0)
        tel.run.create()
        # this rank's (compute, data wait, local) and what the all-reduce hands every rank
        rows = [[0.5 + (r % 97) / 1000, 0.001, 0.25 + (r % 89) / 1000] for r in range(world)]
        summed = sketch_of([row[2] for row in rows])
        for step in range(9, 100, 10):  # more windows between two beats than it keeps
            tel._keep_window(step, 10, time.time(), rows[-1], summed)
        tel._write_status()
        status = tel.run.statuses().records[0]
        job = status["timing"]["job"]
        assert [w[0] for w in status["timing"]["recent"]] == list(range(29, 100, 10))
        assert job["ranks"] == world and status["timing"]["local_seconds"] == rows[-1][2]
        exact = statistics.median(r[2] for r in rows)
        assert abs(job["median"] / exact - 1) <= 0.00502  # within a bin of the sketch
        sizes[world] = tel.run.status_file(world - 1).stat().st_size
    # Digits differ: ids, clock readings, the rounded ratios and scores in `recent`.
    assert max(sizes.values()) - min(sizes.values()) <= 64, sizes
    assert max(sizes.values()) < 4096, sizes


def test_a_timing_window_is_summarized_in_the_same_memory_at_any_world_size(tmp_path):
    """The all-reduce hands a rank a fixed-size sketch, whatever the world size; the
    heartbeat thread summarizes it from its non-empty bins (here the same 89 values in
    both): the same peak memory at 1k and 32k ranks (it was a gathered (ranks, 3) tensor
    and ~16 bytes per rank to select: ~0.5 MiB at 32k)."""
    import tracemalloc

    peaks = {}
    for world in (1024, 32768):
        tel = Telemetry(tmp_path / str(world), rank=5, world_size=world, exchange_every=0)
        tel.run.create()
        local = [0.25 + (r % 89) / 1000 for r in range(world)]
        tel._keep_window(9, 10, time.time(), [0.5, 0.001, local[5]], sketch_of(local))
        tracemalloc.start()
        try:
            tel._summarize_timing()
            peaks[world] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        timing = tel.state["timing"]
        assert timing["job"]["ranks"] == world and timing["local_seconds"] == local[5]
    assert max(peaks.values()) < 32 * 1024, peaks  # a few non-empty bins, not 32k ranks
