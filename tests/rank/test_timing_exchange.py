"""The timing exchange sums a fixed-size sketch (issue #25): what a rank sends and
summarizes per window does not depend on the world size, and the summary read off it
keeps every ratio within a bin's width (0.5 %) of the exact one, and exact where the
values it needs are alone in their bins (small worlds)."""

import json
import random
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_torchrun
from trainwatch.rundir.beat import beat_path, read_beat, window_timing
from trainwatch.contract.timing import (SKETCH_BINS, job_window, median_without, sketch_bin,
                                        standing, summarize, summarize_bins, valid_summary)
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rank.timing_exchange import job_summary, local_sketch, sketch_of

ERROR = 0.00502  # a bin's mean is within e^0.005 - 1 = 0.501 % of each of its values


def test_a_real_gloo_job_publishes_the_summed_sketch(tmp_path):
    """Three gloo ranks under torchrun, the last one twice as slow: every rank publishes
    the same summary of the all-reduced sketch, with the exact extremes and slowest rank,
    and its standing against the others within the sketch's error."""
    run = tmp_path / "run"
    proc = run_torchrun(tmp_path, "tests/jobs/timing_job.py", str(run), nproc=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = {s["rank"]: s for s in RunDir(run).statuses().records}
    assert sorted(statuses) == [0, 1, 2]
    timings = {r: s["timing"] for r, s in statuses.items()}
    assert {t["step"] for t in timings.values()} == {29}
    local = {r: t["local_seconds"] for r, t in timings.items()}
    jobs = [t["job"] for t in timings.values()]
    assert all(job == jobs[0] for job in jobs), jobs
    job = jobs[0]
    assert job["sketch"] == [2.0 ** -20, 0.005, SKETCH_BINS]
    assert job["ranks"] == 3 and job["slowest_rank"] == 2
    assert abs(job["max"] / local[2] - 1) < 1e-7 and abs(job["min"] / local[0] - 1) < 1e-7
    assert abs(job["median"] / statistics.median(local.values()) - 1) <= ERROR
    for r, timing in timings.items():
        others = statistics.median(v for o, v in local.items() if o != r)
        ratio = timing["recent"][-1][1]  # as the rank published it (4 digits)
        assert abs(ratio / (local[r] / others) - 1) <= ERROR + 1e-4, (r, ratio, local)
    assert timings[2]["recent"][-1][1] > 1.3  # the slow rank stands out
    # Each beat carries its rank's own part of the window: with one rank's job summary,
    # an agent reads the same straggler input as from every rank's status.
    beats = {r: read_beat(beat_path(RunDir(run).status_dir, r)) for r in statuses}
    assert job_window({r: window_timing(b, job) for r, b in beats.items()}) == job_window(timings)


def test_what_a_rank_sends_and_summarizes_does_not_grow_with_the_world():
    """The all-reduce's tensors are the same size at 8 and 32k ranks (they were 24 bytes
    per rank), and the summary of 32k ranks comes from the non-empty bins alone."""
    sizes = set()
    for world in (8, 32768):
        values = [0.09 + 0.005 * ((r * 7919) % 1000) / 1000 for r in range(world)]
        sketch = sketch_of(values)
        sizes.add((sketch.bins.numel(), sketch.extremes.numel()))
        job = job_summary(sketch, 9)
        assert job["ranks"] == world and values[job["slowest_rank"]] == max(values)
        assert abs(job["median"] / statistics.median(values) - 1) <= ERROR
    mine = local_sketch(5, 0.1)
    assert sizes == {(mine.bins.numel(), mine.extremes.numel())} == {(2 * SKETCH_BINS, 2)}


def test_the_sketch_keeps_ratios_within_a_bin():
    """Random worlds and spreads: a rank's ratio to the median of the others, and a node's
    median to the rest of the job, are within a bin's width (0.5 %) of the exact ones; the
    MAD within two bins' of the median of the exact one."""
    rng = random.Random(25)
    worst = 0.0
    for _ in range(400):
        world = rng.randint(2, 300)
        values = [rng.choice([0.1, 0.125, rng.uniform(0.05, 0.3)]) for _ in range(world)]
        job = summarize(values, half_width=8)
        for r in rng.sample(range(world), min(world, 5)):
            exact = values[r] / statistics.median(v for i, v in enumerate(values) if i != r)
            worst = max(worst, abs(standing(job, values[r])[0] / exact - 1))
        if world > 3:
            node = rng.sample(range(world), rng.randint(1, min(8, world - 2)))
            rest = statistics.median(v for i, v in enumerate(values) if i not in node)
            got = median_without(job, [values[r] for r in node])
            assert got is not None and abs(got / rest - 1) <= ERROR
        median = statistics.median(values)
        mad = statistics.median(abs(v - median) for v in values)
        assert abs(job["mad"] - mad) <= 2 * ERROR * median
    assert worst <= ERROR, worst


def test_values_alone_in_their_bins_are_exact():
    """Two or three ranks (where the ratio alone decides) usually sit in bins of their own:
    each bin's mean is then the value itself, as an exact summary had it."""
    for values in ([0.1, 0.125], [0.1, 0.104, 0.13], [0.2, 0.1, 0.1]):
        job = summarize(values)
        for r, v in enumerate(values):
            exact = v / statistics.median(values[:r] + values[r + 1:])
            assert abs(standing(job, v)[0] - exact) < 1e-8, (values, r)
    sketch = sketch_of([0.1, 0.125])  # the all-reduce's float32 sums: 7 digits
    assert abs(standing(job_summary(sketch, 9), 0.125)[0] - 1.25) < 1e-6


def test_a_slow_rank_stands_out_of_a_large_job():
    """0.8x speed (1.25x the time) in 4,096 ranks with 2 % jitter: its ratio is 1.25 within
    a bin, its score far above the rule's 3."""
    rng = random.Random(4)
    values = [0.1 * rng.uniform(0.98, 1.02) for _ in range(4096)]
    values[17] = 0.125
    job = summarize(values)
    ratio, z = standing(job, values[17])
    exact = 0.125 / statistics.median(values[:17] + values[18:])
    assert abs(ratio / exact - 1) <= ERROR and z > 3


def test_summaries_of_exact_values_from_older_ranks_still_read():
    """A rank from before the sketch published exact middle values and no ``sketch``: the
    reader takes values out of it exactly."""
    old = {"ranks": 4, "median": 1.05, "mad": 0.05, "min": 1.0, "max": 1.25,
           "slowest_rank": 3, "middle_from": 0, "middle": [1.0, 1.0, 1.1, 1.25]}
    assert median_without(old, [1.25]) == 1.0 and median_without(old, [1.0]) == 1.1
    assert median_without(old, [1.05]) is None  # not a value of that window
    assert standing(old, 1.25)[0] == 1.25


def test_an_empty_bin_and_the_edges_of_the_range():
    """Values beyond the sketch's range count in its first or last bin; a value that is
    not in the window gives no median."""
    job = summarize([1e-9, 0.1, 0.1, 1e6])
    assert job["min"] == 1e-9 and job["max"] == 1e6 and job["slowest_rank"] == 3
    assert median_without(job, [1e-9]) is not None and median_without(job, [1e6]) is not None
    assert median_without(summarize([0.1, 0.1, 0.2]), [0.15]) is None
    assert median_without(job, [float("inf")]) is not None  # in the last bin, as counted
    one = summarize_bins([(sketch_bin(0.0001), 3, 3 * 0.0001)], 0.0001, 0.0001, 0)
    assert one["ranks"] == 3 and one["mad"] == 0.0 and json.dumps(one)


@settings(max_examples=300, deadline=None)
@given(low=st.floats(allow_nan=True), width=st.floats(allow_nan=True),
       bins=st.one_of(st.integers(-5, 10**7), st.booleans()),
       middle=st.lists(st.floats(allow_nan=False), min_size=1, max_size=5),
       removed=st.lists(st.floats(), max_size=3))
def test_a_reader_takes_any_sketch_from_a_status_without_raising(low, width, bins, middle,
                                                                  removed):
    """Any bytes may be in a status file: a summary with a junk ``sketch`` is refused, and
    one that passes is read (a rank's value taken out, its standing) without an error."""
    summary = {"ranks": 8, "median": 0.1, "mad": 0.0, "middle_from": 0,
               "middle": sorted(middle), "sketch": [low, width, bins]}
    if valid_summary(summary):
        median_without(summary, removed)
        for value in removed:
            standing(summary, value)
