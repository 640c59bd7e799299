"""Collector registry: each collector module registers itself with a name, a default
on/off, an interval, a timeout and its own options (like node_exporter's collectors).

A collector only knows how to produce its samples and a small JSON summary; the
scheduler (``agent/runner.py``) owns timing, timeouts and self-metrics.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

if TYPE_CHECKING:
    from trainwatch.agent.context import AgentContext


@dataclass(slots=True)
class Sample:
    name: str
    labels: dict[str, str]  # shared between samples: never changed once made
    value: float


def label_values(labels: dict[str, Any]) -> dict[str, str]:
    """Label values as Prometheus text: ``None`` is the empty string."""
    return {k: "" if v is None else str(v) for k, v in labels.items()}


@dataclass(frozen=True)
class Deferred:
    """A run's samples: those made during the run, then those its producers build when
    read (``Result.defer``)."""

    made: tuple[Sample, ...]
    later: tuple[Callable[[], Iterable[Sample]], ...]

    def __iter__(self) -> Iterator[Sample]:
        for part in self.parts():
            yield from part

    def parts(self) -> Iterator[Iterable[Sample]]:
        """The made samples, then each producer's output as it returns it (a writer may
        know a faster way through some, ``agent/series.py``'s ``Rows``)."""
        yield self.made
        for produce in self.later:
            yield produce()


@dataclass
class Result:
    """What one collector run produced.

    ``state`` is ``ok`` or ``absent`` (nothing to observe here; ``reason`` says why and
    ``samples`` stay empty: honest absence, no invented numbers).  ``data`` is the
    collector's JSON summary for ``/status`` and for collectors that build on it.
    """

    samples: list[Sample] = field(default_factory=list)
    data: Any = None
    state: str = "ok"
    reason: str | None = None
    later: list[Callable[[], Iterable[Sample]]] = field(default_factory=list)

    def add(self, metric: str, value: float | int | bool | None, /, **labels: Any) -> None:
        """Add a sample; ``None`` values are unknown and are not exported."""
        if value is None:
            return
        self.samples.append(Sample(metric, label_values(labels), float(value)))

    def defer(self, produce: Callable[[], Iterable[Sample]]) -> None:
        """Samples to build only if someone reads them: a collector that runs every second
        while Prometheus scrapes every 15 s would otherwise build 14 of 15 sets for
        nothing. ``produce`` must only read values already taken (it may run later, on
        the scrape's thread, more than once)."""
        self.later.append(produce)

    def deferred(self) -> Deferred:
        """The samples, the deferred ones still unbuilt (what the state store keeps)."""
        return Deferred(tuple(self.samples), tuple(self.later))

    def every_sample(self) -> list[Sample]:
        """The samples added now and the deferred ones, built now."""
        return list(self.deferred())

    @classmethod
    def absent(cls, reason: str, data: Any = None) -> "Result":
        return cls(state="absent", reason=reason, data=data)


class Collector:
    """Base class: subclasses set nothing but implement ``collect``."""

    name = ""

    def __init__(self, ctx: "AgentContext", options: dict[str, Any]):
        self.ctx = ctx
        self.options = options

    def collect(self) -> Result:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class CollectorSpec:
    name: str
    factory: Callable[["AgentContext", dict[str, Any]], Collector]
    default_enabled: bool
    interval: float
    timeout: float
    options: dict[str, Any]
    first_delay: float = 0.0
    after: str | None = None


_REGISTRY: dict[str, CollectorSpec] = {}


def register(name: str, *, interval: float, timeout: float | None = None,
             enabled: bool = True, options: dict[str, Any] | None = None,
             first_delay: float = 0.0, after: str | None = None):
    """Class decorator used by every module in ``agent/collectors/``.

    ``first_delay`` lets collectors that build on another's values start after it has
    run once. ``after``: a collector that judges another's values (findings on ranks)
    runs right after each of its runs while both are on and share an interval, so it
    judges the newest values and both are rendered once per collection; otherwise it
    keeps its own schedule, starting ``first_delay`` after the agent.
    """
    def wrap(cls: type[Collector]) -> type[Collector]:
        cls.name = name
        _REGISTRY[name] = CollectorSpec(name, cls, enabled, float(interval),
                                        float(timeout if timeout is not None else interval),
                                        dict(options or {}), float(first_delay), after)
        return cls
    return wrap


def all_collectors() -> dict[str, CollectorSpec]:
    """Every registered collector, importing the built-in modules on first use."""
    import trainwatch.agent.collectors as package
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    return dict(_REGISTRY)
