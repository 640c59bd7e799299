"""Series that live as long as the rank they describe, each keeping its exposition line.

At 64 local ranks the agent exports ~3,900 series and, scraped every second, wrote every
one of them again every second: a sample object, its label key and its formatted line
per series were more than half the agent's CPU. Most of a rank's values do not change
from one second to the next (states, loss, throughput and budgets move with a new status
or timing window, not every second), so a rank's series are made once (``SeriesBook``)
and each keeps its line prefix (name and escaped labels, checked against the contract
once) and its last line: a render writes a line again only for a value that changed
(``ExpositionWriter.families``). A collection hands over its values as ``Rows``;
whoever reads them as ``Sample``s (tests, ``Result.every_sample``) still can.

Most of a rank's rows stand for seconds at a time (its status as parsed, its process,
its state and phase): those come as a ``Block``, kept while its values are the same, so
a render does not look at their series at all while the blocks it saw last time are
the very ones it gets (``ExpositionWriter`` keeps each block family's text).

Memory follows the live ranks: a collector drops a rank's book when the rank is gone,
and a book holds at most ``MAX_LABELLED`` series with extra labels (a rank may name
phases of its own).
"""

from __future__ import annotations

import math
from typing import Iterator

from trainwatch.agent.registry import Sample

MAX_LABELLED = 256  # series with extra labels kept per book (the known ones are ~30)


class Series:
    """One series: its name, its labels (never changed once made) and, once written,
    its line prefix and last (value, prefix, line). ``last`` is replaced whole, never
    edited, so a render racing another sees a matching value and line.

    The labels are kept as the book's shared dict and the series' own extra pairs, and
    joined only when asked (the prefix is made once): a dict per series had been a third
    of what a rank's series held (~100 series a rank, most with an extra label)."""

    __slots__ = ("name", "base", "extra", "prefix", "last")

    def __init__(self, name: str, labels: dict[str, str],
                 extra: tuple[tuple[str, str], ...] = ()):
        self.name, self.base, self.extra = name, labels, extra
        self.prefix: str | None = None  # "" when the contract refused it
        self.last: tuple[float, str, str] | None = None

    @property
    def labels(self) -> dict[str, str]:
        return {**self.base, **dict(self.extra)} if self.extra else self.base


class Block:
    """Rows that stand together (a rank's status as parsed, its process, its state):
    never changed once made, and replaced only by a block of other values (``kept``).
    ``rendered`` is what a writer made of it once: per metric, its line prefixes and the
    length of its lines (the lines themselves are kept joined, ``BlockTexts``)."""

    __slots__ = ("pairs", "rendered")

    def __init__(self, pairs: list[tuple[Series, float]]):
        self.pairs = pairs
        self.rendered: dict[str, tuple[tuple[str, ...], int]] | None = None

    def same_values(self, pairs: list[tuple[Series, float]]) -> bool:
        """The same series with the same values (-0.0 is not 0.0: it is written apart)."""
        return len(pairs) == len(self.pairs) and all(
            a is c and (b == d and (b or math.copysign(1.0, b) == math.copysign(1.0, d)))
            for (a, b), (c, d) in zip(self.pairs, pairs))


def kept(block: Block | None, pairs: list[tuple[Series, float]]) -> Block:
    """``block`` when ``pairs`` are its very values, else a new block of them: a status
    parsed again with the same values renders nothing again."""
    return block if block is not None and block.same_values(pairs) else Block(pairs)


class Rows:
    """One collection's values of some series (``None`` is unknown and not exported):
    its blocks', then its own pairs', in export order (a metric's lines keep it)."""

    __slots__ = ("pairs", "blocks")

    def __init__(self) -> None:
        self.pairs: list[tuple[Series, float]] = []
        self.blocks: list[Block] = []

    def add(self, series: Series, value: float | int | bool | None) -> None:
        if value is not None:
            self.pairs.append((series, float(value)))

    def __iter__(self) -> Iterator[Sample]:
        for block in self.blocks:
            for series, value in block.pairs:
                yield Sample(series.name, series.labels, value)
        for series, value in self.pairs:
            yield Sample(series.name, series.labels, value)


class SeriesBook:
    """A rank's series: one per metric with the rank's own labels (``one``), and one per
    metric and extra label set (``labelled``), made on first use."""

    __slots__ = ("base", "_plain", "_labelled", "block")

    def __init__(self, base: dict[str, str]):
        self.base = base
        self.block: Block | None = None  # its standing rows as last handed over, if any
        self._plain: dict[str, Series] = {}
        self._labelled: dict[tuple[str, tuple[tuple[str, str], ...]], Series] = {}

    def one(self, name: str) -> Series:
        series = self._plain.get(name)
        if series is None:
            series = self._plain[name] = Series(name, self.base)
        return series

    def labelled(self, name: str, extra: tuple[tuple[str, str], ...]) -> Series:
        """The series with the rank's labels and ``extra`` (label values already text)."""
        key = (name, extra)
        series = self._labelled.get(key)
        if series is None:
            if len(self._labelled) >= MAX_LABELLED:
                self._labelled.clear()  # a rank inventing label values: start again
            series = self._labelled[key] = Series(name, self.base, extra)
        return series
