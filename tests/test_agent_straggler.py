"""Straggler scoring and flagging on synthetic timing windows (the real run is in e2e)."""

import random

from trainwatch.agent.config import STRAGGLER_DEFAULTS
from trainwatch.agent.straggler import JobStragglers, local_times, score


def window(step, values, window_steps=5):
    return {"step": step, "window_steps": window_steps, "time": float(step),
            "compute_seconds": values, "data_wait_seconds": [0.0] * len(values),
            "local_seconds": values}


def test_scores_are_robust_and_ratio_uses_the_other_ranks():
    values = [1.0] * 7 + [1.25]
    s = score(values)
    assert s.median == 1.0
    assert abs(s.ratio[7] - 1.25) < 1e-9 and s.ratio[0] == 1.0
    assert s.score[7] > 3 > abs(s.score[0])
    two = score([1.0, 1.25])  # two ranks: the ratio still points at the slow one
    assert abs(two.ratio[1] - 1.25) < 1e-9 and abs(two.ratio[0] - 0.8) < 1e-9


def test_local_times_fall_back_to_compute_plus_data_wait():
    assert local_times({"compute_seconds": [1.0, 2.0], "data_wait_seconds": [0.5, 0.5]}) == [
        1.5, 2.5]
    assert local_times({"compute_seconds": "junk"}) is None


def test_slow_rank_flagged_after_m_windows_and_clears():
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    rng = random.Random(1)
    step = 0
    flagged_at = None
    for i in range(12):
        step += 5
        values = [1.0 + rng.uniform(-0.03, 0.03) for _ in range(8)]
        if i >= 2:
            values[3] *= 1.25  # 0.8x speed from the third window on
        tracker.update(window(step, values), local_ranks=[2, 3], now=step)
        if tracker.ranks[3].active and flagged_at is None:
            flagged_at = step
        assert not tracker.ranks[2].active
    assert flagged_at is not None and flagged_at - 10 <= 30  # slow from step 11 (window 15)
    assert tracker.ranks[3].since_step == 11
    for _ in range(3):  # recovered: clears after clear_windows normal windows
        step += 5
        tracker.update(window(step, [1.0] * 8), local_ranks=[2, 3], now=step)
    assert not tracker.ranks[3].active


def test_sparse_sampling_still_flags_within_the_goal():
    """The agent may see only every 4th window; streaks are counted in steps."""
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    for step in (20, 40, 60):
        tracker.update(window(step, [1.0, 1.0, 1.0, 1.3]), local_ranks=[3], now=step)
    assert tracker.ranks[3].active and tracker.ranks[3].detected_step == 40


def test_clean_noisy_run_never_flags():
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    rng = random.Random(7)
    for i in range(500):
        values = [0.1 * (1 + rng.gauss(0, 0.03)) for _ in range(64)]
        tracker.update(window(5 * (i + 1), values), local_ranks=range(64), now=i)
        assert not any(t.active for t in tracker.ranks.values()), i


def test_same_window_is_scored_once():
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    w = window(5, [1.0, 1.0, 1.0, 2.0])
    assert tracker.update(w, [3], 0) is True
    assert tracker.update(w, [3], 1) is False
    assert tracker.ranks[3].slow_windows == 1


def test_node_straggler_compares_local_ranks_with_the_rest():
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    for step in (5, 10, 15, 20):
        values = [1.0] * 8 + [1.3] * 8  # this node hosts ranks 8-15, all slow
        tracker.update(window(step, values), local_ranks=range(8, 16), now=step)
    assert abs(tracker.node_ratio - 1.3) < 1e-9 and tracker.node.active
    alone = JobStragglers(dict(STRAGGLER_DEFAULTS))
    alone.update(window(5, [1.0, 1.3]), local_ranks=[0, 1], now=0)
    assert alone.node_ratio is None  # all ranks local: no node-level comparison


def test_leave_one_out_ratio_matches_brute_force():
    import statistics
    rng = random.Random(3)
    for _ in range(2000):
        values = [rng.choice([1.0, 1.5, 2.0, rng.random()]) for _ in range(rng.randint(1, 12))]
        got = score(values).ratio
        for i, v in enumerate(values):
            rest = values[:i] + values[i + 1:]
            other = statistics.median(rest) if rest else v
            assert abs(got[i] - (v / other if other > 0 else 1.0)) < 1e-12
