"""The timing window's means, summed when the window is full from its steps' records (the
loop appends one a step); the list stays bounded whatever numbers the steps carry."""

from trainwatch.rank.recorder import LoopRecorder


def _loop(exchanged):
    state = {"step": None, "counters": {"steps_total": 0, "pending_dropped_total": 0}}
    return LoopRecorder(state, rank=0, is_cuda=False, exchange_every=5,
                        collective_phases=("backward", "telemetry_exchange"), max_pending=8,
                        guard=lambda fn: fn(), count_error=lambda problem: None,
                        exchange=lambda *a: exchanged.append(a))


def _step(loop, step, phases, step_ns):
    loop.begin_step(step)
    loop.step_phase_ns.update(phases)
    loop.step_start_ns -= step_ns  # as if the step had taken that long (and a little more)
    loop.end_step(step, {})


def test_a_full_window_sends_the_means_of_compute_data_and_local_time():
    exchanged = []
    loop = _loop(exchanged)
    for step in range(10):
        _step(loop, step, {"data": 1_000_000, "backward": 3_000_000}, 10_000_000)
    assert [(step, n) for step, n, _ in exchanged] == [(4, 5), (9, 5)]
    compute, data, local = exchanged[0][2]
    assert data == 1e-3 and 9e-3 <= compute < 9.1e-3 and 7e-3 <= local < 7.1e-3
    assert loop.window == []


def test_steps_that_never_fill_the_window_keep_it_bounded():
    exchanged = []
    loop = _loop(exchanged)
    for _ in range(100):  # a loop that numbers every step 0: (0 + 1) % 5 is never 0
        _step(loop, 0, {"data": 1_000}, 2_000)
        assert len(loop.window) < 4 * 5
    assert exchanged == [] and loop.window_steps + len(loop.window) == 100
    _step(loop, 4, {}, 2_000)
    ((step, n, (compute, data, local)),) = exchanged
    assert (step, n) == (4, 101) and data == 100 * 1_000 / 101 / 1e9
