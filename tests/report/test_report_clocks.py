"""One clock per machine (trainwatch/report/clocks.py): a writer whose wall clock disagrees
with its machine's is moved onto it, judged at the same moments, never over the whole run:
a step of the machine's own clock (NTP, a paused virtual machine) moves every writer."""

from trainwatch.report.clocks import clock_shifts

T0 = 1_800_000_000.0


def _event(source: str, mono: float, *, ahead: float = 0.0, step_at: float = 1e9,
           step: float = 0.0) -> dict:
    """An event ``source`` journaled at monotonic ``mono``: its wall clock ``ahead`` of the
    machine's, which itself jumps ``step`` seconds at monotonic ``step_at``."""
    wall = T0 + mono + ahead + (step if mono >= step_at else 0.0)
    return {"event": "x", "time": wall, "mono": mono, "host": "h", "boot": "b1",
            "source": source}


def test_a_step_of_the_machines_clock_moves_no_writer():
    """As in a CI run whose VM was paused 28.8 s: the controller journaled mostly before the
    step, rank 0 mostly after it. Over the whole run their offsets' medians differ by the
    step; at the same moments they agree, and nobody is moved (rank 0 had been moved
    28.8 s back, and the report charged that as a 9.4 s stall)."""
    events = ([_event("engine", m, step_at=50, step=28.8) for m in (0, 1, 30, 49, 60)]
              + [_event("rank0", m, step_at=50, step=28.8) for m in (10, 51, 52, 53, 54, 55)]
              + [_event("rank1", m, step_at=50, step=28.8) for m in (10, 56)])
    assert clock_shifts(events) == {}


def test_a_rank_5_minutes_behind_is_moved_across_a_step_of_the_machines_clock():
    events = ([_event("engine", m, step_at=50, step=28.8) for m in (0, 1, 30, 49, 52, 60)]
              + [_event("rank0", m, ahead=-300, step_at=50, step=28.8)
                 for m in (10, 51, 52, 53, 54, 55)]
              + [_event("rank1", m, step_at=50, step=28.8) for m in (10, 56)])
    (writer, seconds), = clock_shifts(events).items()
    assert writer == ("h", "b1", "rank0") and abs(seconds - 300) < 1e-6


def test_the_clock_most_writers_share_wins_and_a_tie_goes_to_the_controller():
    majority = ([_event("engine", m, ahead=60) for m in (0, 20)]
                + [_event(f"rank{r}", 5 + r) for r in range(3)])
    assert clock_shifts(majority) == {("h", "b1", "engine"): -60.0}
    tie = [_event("engine", 0), _event("rank0", 1, ahead=60)]
    assert clock_shifts(tie) == {("h", "b1", "rank0"): -60.0}


def test_writers_of_other_machines_or_without_a_monotonic_reading_stay_as_written():
    events = [_event("engine", 0), {**_event("rank0", 1, ahead=60), "host": "other"},
              {**_event("rank1", 2, ahead=60), "mono": None}]
    assert clock_shifts(events) == {}
