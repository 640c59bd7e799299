"""Which later attempt threw a step's work away: the same answers as reading every later
attempt, in time and memory linear in the attempts (issue #25: it was quadratic)."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np

from trainwatch.report.goodput import _Chain, _discarders, _later_resumes
from trainwatch.report.timeline import Attempt


def _attempts(resumes: list[int | None]) -> list[Attempt]:
    return [Attempt(i, float(i), None, None, resumed_from=r) for i, r in enumerate(resumes)]


def _first_discarder(attempts: list[Attempt], k: int, step: int) -> int | None:
    for later in attempts[k + 1:]:
        if later.resumed_from is not None and later.resumed_from <= step:
            return later.index
    return None


def _discarding(chain: _Chain | None, steps: list[int]) -> list[int | None]:
    """The painter's answers for executions of ``steps`` in an attempt with ``chain``."""
    cuts = [(0, len(steps), chain)] if chain is not None else []
    found = _discarders(np.array(steps, dtype=np.int64), 0, len(steps), cuts, 0)
    return [None if d < 0 else d for d in found.tolist()]


def test_same_answers_as_every_later_attempt() -> None:
    rng = random.Random(25)
    for _ in range(200):
        resumes = [rng.choice([None, *range(0, 60, 5)]) for _ in range(rng.randint(1, 12))]
        attempts = _attempts(resumes)
        chains = _later_resumes(attempts)
        for k in range(len(attempts)):
            later = [r for r in resumes[k + 1:] if r is not None]
            assert (chains[k][3] if chains[k] is not None else None) == (
                min(later) if later else None)
            steps = list(range(-1, 62))
            assert _discarding(chains[k], steps) == [_first_discarder(attempts, k, step)
                                                     for step in steps]


def test_linear_in_attempts_when_each_resumes_earlier() -> None:
    # Each attempt resumed before all earlier ones (rollbacks): every later attempt counts
    # for every earlier one, the quadratic case. 3,000 attempts held 4.5M pairs (~300 MB).
    attempts = _attempts(list(range(3000, 0, -1)))
    tracemalloc.start()
    try:
        chains = _later_resumes(attempts)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024
    assert _discarding(chains[0], [3000, 1]) == [1, 2999]
