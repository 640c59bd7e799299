"""Command-line value types shared by the commands: a bad value is a usage error (exit 2
naming the option) before anything starts, never a traceback or a silent nonsense run."""

from __future__ import annotations

import math
from typing import Any

import click

# Ranks on one machine: far beyond any node's accelerators or cores, far below what
# would make torchrun try to start a process per unit of an absurd number.
MAX_NPROC_PER_NODE = 1024
NPROC_PER_NODE = click.IntRange(1, MAX_NPROC_PER_NODE)
# torchrun's own restarts of every rank after one fails (`trainwatch train`, `trainwatch run`,
# the receiver's job): one, for a transient fault (a killed or OOM-killed rank); a fault that
# comes back is for the supervisor's restart-loop guard or a person, not hidden behind more
# restarts in place.
MAX_RESTARTS = 1


class FiniteRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (which compare false with any bound,
    so a plain FloatRange lets nan through)."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def seconds(min: float = 0, max: float | None = None) -> FiniteRange:
    """A duration in seconds, finite, within [min, max]."""
    return FiniteRange(min, max)
