"""The checkpoint interval that minimises expected waste (Young 1974, Daly 2006).

Saving often costs the save time on every save; saving rarely loses more work per
failure. To first order the sum is smallest at ``sqrt(2 x save cost x MTBF)``. One
implementation, used by ``trainwatch plan`` (with an assumed failure rate) and by
``trainwatch report`` (with the failures a run actually had).
"""

from __future__ import annotations

import math


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Seconds of work between checkpoints; ``save_seconds`` and ``mtbf_seconds`` > 0."""
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


FORMULA = "sqrt(2 x save_seconds x mtbf_seconds)"
