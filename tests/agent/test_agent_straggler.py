"""Straggler scoring and flagging on synthetic timing windows (the real run is in e2e).

Windows are built the way the agent builds them: from each local rank's status
``timing`` (its own means and the job summary the telemetry computes)."""

import itertools
import math
import random
from pathlib import Path

from trainwatch.agent.config import STRAGGLER_DEFAULTS
from trainwatch.agent.straggler import VERDICT_WINDOWS, JobStragglers, score
from trainwatch.contract.timing import job_window, own_local_seconds, recent_standing, summarize
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rank.telemetry import Telemetry
from trainwatch.rank.timing_exchange import sketch_of


def status_timing(step, values, rank, window_steps=5):
    return {"step": step, "window_steps": window_steps, "time": float(step),
            "compute_seconds": values[rank], "data_wait_seconds": 0.0,
            "local_seconds": values[rank], "job": summarize(values)}


def window(step, values, local_ranks=None, window_steps=5):
    ranks = range(len(values)) if local_ranks is None else local_ranks
    return job_window({r: status_timing(step, values, r, window_steps) for r in ranks})


def scores_of(values):
    return score(summarize(values), dict(enumerate(values)))


def _near(value, exact, error=0.00502):
    """Within the timing sketch's error: a bin's mean is within its width (0.5 %) of each of
    its values, the value itself when alone (trainwatch.contract.timing)."""
    return abs(value / exact - 1) <= error


def test_scores_are_robust_and_ratio_uses_the_other_ranks():
    values = [1.0] * 7 + [1.25]
    s = scores_of(values)
    assert _near(s.median, 1.0)
    assert _near(s.ratio[7], 1.25) and _near(s.ratio[0], 1.0)
    assert s.score[7] > 3 > abs(s.score[0])
    two = scores_of([1.0, 1.25])  # two ranks: the ratio still points at the slow one
    assert _near(two.ratio[1], 1.25) and _near(two.ratio[0], 0.8)


def test_own_local_seconds_fall_back_to_compute_plus_data_wait():
    assert own_local_seconds({"compute_seconds": 1.0, "data_wait_seconds": 0.5}) == 1.5
    assert own_local_seconds({"compute_seconds": "junk"}) is None
    assert own_local_seconds({"local_seconds": float("nan")}) is None


def test_window_needs_a_usable_job_summary_and_takes_the_newest():
    old = status_timing(5, [1.0, 2.0], 0)
    new = status_timing(10, [1.0, 3.0], 1)
    w = job_window({0: old, 1: new})
    assert w["step"] == 10 and w["local"] == {1: 3.0}  # rank 0 is a window behind
    later = {**status_timing(10, [1.0, 3.0], 0), "time": 10.5}  # its own clock, same window
    assert job_window({0: later, 1: new})["local"] == {0: 1.0, 1: 3.0}
    for junk in ("x", None, {"ranks": 2}, {**new["job"], "middle": [2.0, 1.0]},
                 {**new["job"], "ranks": True}, {**new["job"], "median": "nan"}):
        assert job_window({1: {**new, "job": junk}}) is None


def test_slow_rank_flagged_held_and_cleared_with_hysteresis():
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    rng = random.Random(1)
    step, flagged_at, held = 0, None, []
    for i in range(30):
        step += 5
        values = [1.0 + rng.uniform(-0.03, 0.03) for _ in range(8)]
        if 4 <= i < 24:
            # 0.8x speed from step 21, with every third window looking normal (noise)
            values[3] *= 1.25 if i % 3 else 1.05
        tracker.update(window(step, values), local_ranks=[2, 3], now=step)
        if 4 <= i < 24 and tracker.ranks[3].active:
            flagged_at = flagged_at or step
            held.append(True)
        elif flagged_at and i < 24:
            held.append(False)
        assert not tracker.ranks[2].active
        if i == 23:
            assert tracker.ranks[3].active and tracker.ranks[3].level > 1.15
            assert 11 <= tracker.ranks[3].since_step <= 21
    assert flagged_at is not None and flagged_at - 20 <= 30  # slow from step 21
    assert all(held), held  # the normal-looking windows never dropped the flag
    assert not tracker.ranks[3].active  # recovered at step 121: cleared by step 150


def test_two_and_three_rank_worlds_flag_the_slow_rank_only():
    for world in (2, 3):
        tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
        rng = random.Random(world)
        for i in range(12):
            values = [0.1 * (1 + rng.gauss(0, 0.01)) for _ in range(world)]
            if i >= 5:
                values[world - 1] *= 1.25
            tracker.update(window(5 * (i + 1), values), local_ranks=range(world), now=i)
        assert tracker.ranks[world - 1].active
        assert not any(tracker.ranks[r].active for r in range(world - 1))


def test_a_noisy_job_raises_the_bar_not_the_flag():
    """Windows jittering by 20 %: a 1.2x window is noise here, not a straggler."""
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    rng = random.Random(5)
    for i in range(400):
        values = [0.1 * math.exp(rng.gauss(0, 0.2)) for _ in range(2)]
        tracker.update(window(5 * (i + 1), values), local_ranks=[0, 1], now=i)
        assert not any(t.active for t in tracker.ranks.values()), i
    assert tracker.ranks[0].noise > 0.15


def test_a_node_is_compared_only_while_all_its_ranks_are_scored():
    """A one-node job of 2 ranks at its clean stop: rank 0 finished, rank 1 runs on. The
    node is the whole job, so it has no others to be slower than; before, the node ratio
    became rank 1's against rank 0 (2.0 here) and TrainingStragglerNode went pending."""
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    tracker.update(window(10, [1.0, 2.0], local_ranks=[1]), local_ranks=[1], now=10,
                   node_ranks=[0, 1])
    assert tracker.node_ratio is None
    # two nodes of 2 ranks, this node's both running: compared as before
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    tracker.update(window(10, [1.0, 1.0, 2.0, 2.0], local_ranks=[2, 3]), local_ranks=[2, 3],
                   now=10, node_ranks=[2, 3])
    assert _near(tracker.node_ratio, 2.0)


def test_sparse_sampling_still_flags():
    """The agent may see only every 4th window: the verdict needs 8 windows (its noise
    measured), not 8 x 4."""
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    for step in range(20, 200, 20):
        tracker.update(window(step, [1.0, 1.01, 0.99, 1.3]), local_ranks=[3], now=step)
    assert tracker.ranks[3].active and tracker.ranks[3].detected_step == 160


def _flag_step_when_looking_every(look_every, tmp_path):
    """Real telemetry of 4 ranks writes its status; an agent reads it every
    ``look_every``-th 5-step window; rank 2 runs at 0.8x from step 50."""
    tels = [Telemetry(tmp_path, rank=r, world_size=4, exchange_every=0) for r in range(4)]
    tels[0].run.create()
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    rng = random.Random(3)
    for i in range(40):
        step = 5 * i + 4
        local = [0.05 * (1 + rng.uniform(-0.02, 0.02)) for _ in range(4)]
        if step >= 50:
            local[2] *= 1.25
        summed = sketch_of(local)  # what the all-reduce hands every rank
        for r, tel in enumerate(tels):
            tel._keep_window(step, 5, float(step), [local[r], 0.0, local[r]], summed)
        if i % look_every == 0:
            for tel in tels:
                tel._write_status()
            statuses = RunDir(tmp_path).statuses().records
            tracker.update(job_window({s["rank"]: s["timing"] for s in statuses}),
                           local_ranks=range(4), now=float(step))
            if tracker.ranks[2].active:
                assert not any(tracker.ranks[r].active for r in (0, 1, 3))
                return tracker.ranks[2].detected_step
    for tel in tels:
        tel.close()
    return None


def test_windows_between_the_agents_looks_count_toward_the_verdict(tmp_path):
    """The agent looks about once a second; 5 steps of 65 ms are a third of that.  Each
    rank's status lists its standing in its last windows, so an agent that looks every
    third window reaches the verdict at the same window as one that sees every window."""
    every = _flag_step_when_looking_every(1, tmp_path / "every")
    third = _flag_step_when_looking_every(3, tmp_path / "third")
    assert every is not None and every - 50 <= 15, every
    assert third == every


def test_missed_windows_count_again_after_a_restart_went_back_in_steps():
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    tracker.update(window(100, [1.0, 1.0, 1.0, 1.0]), [3], 0)
    resumed = window(45, [1.0, 1.0, 1.0, 1.0], [3])  # resumed from the step-30 checkpoint
    resumed["recent"] = {3: [(35, 1.0, 0.0), (40, 1.0, 0.0)]}
    tracker.update(resumed, [3], 1)
    assert [s for s, _, _ in tracker.ranks[3].recent] == [100, 35, 40, 45]


def test_recent_standing_skips_what_is_not_a_window():
    timing = {"recent": [["x", 1.2, 0.5], [7, "nan", 0.0], [9, 1.3, 4.0], "junk",
                         [True, 1.1, 0.0], [5, 1.2, 0.5], [6, -1.0, 0.0], [8, 1.0]]}
    assert recent_standing(timing) == [(5, 1.2, 0.5), (9, 1.3, 4.0)]
    assert recent_standing({"recent": {"a": 1}}) == [] == recent_standing("junk")
    assert len(recent_standing({"recent": [[i, 1.0, 0.0] for i in range(10**5)]})) == 16


def test_clean_noisy_run_never_flags():
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    rng = random.Random(7)
    for i in range(500):
        values = [0.1 * (1 + rng.gauss(0, 0.03)) for _ in range(64)]
        tracker.update(window(5 * (i + 1), values), local_ranks=range(64), now=i)
        assert not any(t.active for t in tracker.ranks.values()), i


def test_recorded_step_times_10k_clean_steps_and_a_0_8x_rank():
    """Replays a real run's per-step local times (benchmarks/straggler_detection.py), in
    5-step windows and in the telemetry's default windows (10 steps)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import straggler_detection as sim
    recording = sim.load()
    for world, window_steps in itertools.product((2, 4), (5, sim.DEFAULT_WINDOW)):
        row = sim.evaluate(recording, world, window_steps, clean_steps=10000, trials=5)
        assert row["false_flags"] == 0, row
        assert row["missed"] == 0 and row["detected_after_max"] <= 30, row
        assert row["held_min"] >= 0.98 and row["never_cleared"] == 0, row
        assert row["cleared_after_max"] <= 30 and row["other_ranks_flagged"] == 0, row


def test_recorded_noisy_loaded_machine_10k_clean_steps_no_false_flag():
    """4 CPU-bound ranks on 2 shared cores (load 15-25): windows vary by ~20 %; the noise
    raises the bar, it never raises a flag."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import straggler_detection as sim
    recording = sim.load(sim.RECORDING.with_name("cpu-oversubscribed-4rank.json"))
    for world, window_steps in itertools.product((2, 3, 4), (5, sim.DEFAULT_WINDOW)):
        clean = sim.bootstrap(recording, 10000, list(range(world)), random.Random(world))
        assert sim.false_flags(sim.replay(clean, window_steps)) == 0, (world, window_steps)


def test_same_window_is_scored_once():
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    w = window(5, [1.0, 1.0, 1.0, 2.0], [3])
    assert tracker.update(w, [3], 0) is True
    assert tracker.update(w, [3], 1) is False
    assert tracker.ranks[3].slow_windows == 1 and len(tracker.ranks[3].recent) == 1


def test_node_straggler_compares_local_ranks_with_the_rest():
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    for step in range(5, 50, 5):  # 8 windows measure the noise, then the verdict
        values = [1.0] * 8 + [1.3] * 8  # this node hosts ranks 8-15, all slow
        tracker.update(window(step, values, range(8, 16)), local_ranks=range(8, 16), now=step)
    assert _near(tracker.node_ratio, 1.3) and tracker.node.active
    alone = JobStragglers(dict(STRAGGLER_DEFAULTS))
    alone.update(window(5, [1.0, 1.3]), local_ranks=[0, 1], now=0)
    assert alone.node_ratio is None  # all ranks local: no node-level comparison


def test_leave_one_out_ratio_matches_brute_force():
    import statistics
    rng = random.Random(3)
    for _ in range(2000):
        values = [rng.choice([1.0, 1.5, 2.0, rng.random()]) for _ in range(rng.randint(1, 12))]
        got = scores_of(values).ratio
        for i, v in enumerate(values):
            rest = values[:i] + values[i + 1:]
            other = statistics.median(rest) if rest else v
            assert _near(got[i], v / other if other > 0 else 1.0)


def test_node_ratio_leaves_out_every_local_rank():
    import statistics
    rng = random.Random(5)
    for _ in range(500):
        world = rng.randint(3, 200)
        values = [rng.choice([1.0, 1.2, rng.random() + 0.5]) for _ in range(world)]
        local = rng.sample(range(world), rng.randint(1, min(8, world - 1)))
        tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
        tracker.update(window(5, values, local), local_ranks=local, now=0)
        mine = statistics.median(values[r] for r in local)
        rest = statistics.median(v for i, v in enumerate(values) if i not in local)
        assert _near(tracker.node_ratio, mine / rest)


def test_no_verdict_and_not_judging_before_the_rule_has_a_ranks_noise():
    """A rank at 0.8x from the first window is not flagged before VERDICT_WINDOWS windows
    (its noise is not known yet), and says so (``judging``); then it is, at once."""
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    for i in range(1, VERDICT_WINDOWS + 1):
        values = [1.0 + 0.01 * (i % 3)] * 8
        values[3] *= 1.25
        tracker.update(window(5 * i, values), local_ranks=[3], now=i)
        track = tracker.ranks[3]
        assert track.judging == (i >= VERDICT_WINDOWS)
        assert track.active == (i >= VERDICT_WINDOWS)
