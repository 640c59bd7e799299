"""What the run cost: accelerator-hours per time category, priced when a price is given.

Every accelerator the job holds is billed for the whole wall time, productive or not;
that is how clouds and clusters charge. Each attempt holds its own world size (a resume
may change it): it is billed from its start to the next attempt's, less the time nothing
ran. Without a price the report still counts accelerator-hours and leaves the money null
rather than assume a rate.

Config file (``--config``), every key optional::

    gpu_hour_price: 2.50          # USD per accelerator-hour
    gpus: 16                      # accelerators the job holds in all, or:
    accelerators_per_rank: 1      # ... per rank (default 1) x the run's world size
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwatch.config.yamlfile import load_yaml_mapping
from trainwatch.errors import ConfigError
import math

from trainwatch.report.goodput import CATEGORIES, Accounting
from trainwatch.report.timeline import Timeline

KEYS = ("gpu_hour_price", "gpus", "accelerators_per_rank")
# Badput caused by failures rather than by the run's own design (saves, evaluation).
FAILURE_CATEGORIES = ("recomputed", "restart_downtime", "stalled")


@dataclass
class CostSettings:
    gpu_hour_price: float | None = None
    gpus: int | None = None
    accelerators_per_rank: int | None = None


def load_settings(path: str | Path | None, *, price: float | None = None,
                  gpus: int | None = None) -> CostSettings:
    """Settings from the config file, overridden by the command line; bad values: exit 2."""
    data = load_yaml_mapping(path) if path else {}
    where = str(path) if path else None
    for key in data:
        if key not in KEYS:
            raise ConfigError(f"unknown setting (known: {', '.join(KEYS)})", file=where, key=key)
    settings = CostSettings()
    value = data.get("gpu_hour_price")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"must be a number >= 0, got {value!r}", file=where,
                              key="gpu_hour_price")
        settings.gpu_hour_price = float(value)
    for key in ("gpus", "accelerators_per_rank"):
        value = data.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"must be an integer >= 1, got {value!r}", file=where, key=key)
            setattr(settings, key, value)
    if settings.gpus is not None and settings.accelerators_per_rank is not None:
        raise ConfigError("set gpus or accelerators_per_rank, not both", file=where, key="gpus")
    if price is not None:
        settings.gpu_hour_price = price
    if gpus is not None:
        settings.gpus, settings.accelerators_per_rank = gpus, None
    return settings


def accelerators(settings: CostSettings, world_size: int | None) -> tuple[int | None, str]:
    """How many accelerators the job held, and where that number comes from."""
    if settings.gpus is not None:
        return settings.gpus, "configured gpus"
    if world_size is None:
        return None, "unknown (no world size in the run directory; set gpus)"
    per_rank = settings.accelerators_per_rank or 1
    return world_size * per_rank, f"world size {world_size} x {per_rank} per rank"


def attempt_seconds(tl: Timeline) -> list[float]:
    """Each attempt's part of the wall time: from its start (the first's: the run's) to the
    next one's (the last's: the run's end), less the time nothing ran."""
    bounds = [tl.start] + [a.started_at for a in tl.attempts[1:]] + [tl.end]
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        lo, hi = max(lo, tl.start), min(hi, tl.end)
        idle = math.fsum(max(0.0, min(hi, b) - max(lo, a)) for a, b in tl.not_running)
        parts.append(max(0.0, hi - lo - idle))
    return parts


def attempt_accelerators(settings: CostSettings, tl: Timeline) -> list[int | None]:
    """What each attempt held: the configured gpus, or its own world size x per rank."""
    return [accelerators(settings, a.world_size)[0] for a in tl.attempts]


def _money(seconds: float, count: float | None, price: float | None) -> float | None:
    if count is None or price is None:
        return None
    return seconds / 3600.0 * count * price


def costs(acc: Accounting, settings: CostSettings, tl: Timeline) -> dict[str, Any]:
    """The report's ``cost`` section (stable keys; money is null without a price). When the
    attempts held different counts, the total is theirs summed and each category is
    priced at the run's mean count (the total's over the wall time)."""
    count, source = accelerators(settings, tl.world_size)
    counts = attempt_accelerators(settings, tl)
    mean: float | None = count
    if len(set(counts)) > 1:
        known = [c for c in counts if c is not None]
        if len(known) < len(counts):
            count, source = None, "unknown for an attempt (no world size; set gpus)"
            mean = None
        else:
            held = math.fsum(s * c for s, c in zip(attempt_seconds(tl), known))
            mean = held / acc.wall_seconds if acc.wall_seconds > 0 else count
            per_rank = settings.accelerators_per_rank or 1
            sizes = " -> ".join(str(a.world_size) for a in tl.attempts)
            source = f"world size {sizes} x {per_rank} per rank, each attempt at its own"
    price = settings.gpu_hour_price
    total = _money(acc.wall_seconds, mean, price)
    failures = sum(acc.seconds[c] for c in FAILURE_CATEGORIES)
    tokens = acc.productive_tokens
    return {
        "currency": "USD",
        "gpu_hour_price": price,
        "accelerators": count,
        "accelerators_source": source,
        "accelerator_hours": acc.wall_seconds / 3600.0 * mean if mean is not None else None,
        "total": total,
        "by_category": {c: _money(acc.seconds[c], mean, price) for c in CATEGORIES},
        "failures": _money(failures, mean, price),
        "per_million_tokens": (total / (tokens / 1e6)
                               if total is not None and tokens else None),
    }


def incident_cost(seconds: float, settings: CostSettings, world_size: int | None
                  ) -> float | None:
    return _money(seconds, accelerators(settings, world_size)[0], settings.gpu_hour_price)
