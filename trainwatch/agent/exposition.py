"""The Prometheus text format (0.0.4) and OpenMetrics 1.0.0 for the agent's samples.

Why not prometheus-client's ``generate_latest``: an agent exports ~45 series per local
rank, and building metric-family objects, then validating and escaping every name and
label of every sample on every scrape, was two thirds of the agent's CPU at 1 s scrapes.
Here a series' line prefix (its name and escaped, sorted labels) is built the first time
the series is seen and reused while it exists, and a source's lines (one collector
run's) are formatted once, the first time they are read: a scrape joins the lines of
the runs it has already seen with a header per family (``families``, ``join``). A
rank's series (``agent/series.py``: ``Rows`` of series made once per rank) keep their
last line too, so a run's rank series cost a line only where a value changed. Both
formats are checked against prometheus-client's parsers and ``promtool check metrics``
in tests/agent/test_agent_exposition.py.

Only names declared in the metrics contract are written, with exactly their declared
labels; anything else is dropped and reported once through ``reject``.
"""

from __future__ import annotations

import bisect
import io
import math
from collections import defaultdict
from typing import Callable, Hashable, Iterable, Iterator, Mapping

from trainwatch.agent.registry import Deferred, Sample
from trainwatch.agent.series import Block, Rows, Series
from trainwatch.contract.metrics import MetricSpec

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def content_type_for(accept: str) -> str:
    """OpenMetrics when the scraper lists it (as Prometheus does), the text format otherwise."""
    for accepted in (accept or "").split(","):
        if accepted.split(";")[0].strip().lower() == "application/openmetrics-text":
            return OPENMETRICS
    return TEXT


def format_value(value: float) -> str:
    """A sample value as Go (and so Prometheus) writes it: ``+Inf``, ``NaN``, ``1.5e+06``."""
    value = float(value)  # counts arrive as ints
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value != value:
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:  # 1234567.0 -> 1.234567e+06, as prometheus-client writes it
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape_label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str, openmetrics: bool) -> str:
    text = text.replace("\\", r"\\").replace("\n", r"\n")
    return text.replace('"', r"\"") if openmetrics else text


class Family:
    """One metric's series from one source (a collector run), rendered once: its lines,
    and the line prefixes they hold (to drop a series another source already wrote),
    read from the lines when asked (only a metric two sources hold asks; a set of them
    kept per metric had held a reference to every series' prefix once more)."""

    __slots__ = ("lines",)

    def __init__(self, lines: str):
        self.lines = lines

    @property
    def prefixes(self) -> set[str]:
        return {line[:line.rindex(" ") + 1] for line in self.lines[:-1].split("\n")} \
            if self.lines else set()


Families = dict[str, Family]
_Lines = dict[str, tuple[tuple[str, ...], str]]  # a block's: name -> (prefixes, text)


class BlockTexts:
    """One source's metrics that only blocks hold (``agent/series.py``), as text: kept
    while the source hands over the very blocks of the last render, and made again only
    for the metrics of the blocks that are others. At 64 ranks ~85 % of the agent's lines
    are in blocks that stand from one second to the next (states, phases, the status as
    parsed, the process), and a render had looked at each of their series every time.

    A block keeps only its prefixes and the length of its text per metric
    (``Block.rendered``): the text of a block that stands is read back from the metric's
    joined text, where it lies at a place its predecessors' lengths give, so each line
    is held once (a block's own text beside the joined one had been ~9 KiB a rank). A
    metric whose join dropped a line (a series two blocks hold) is made again from its
    blocks' series the next time (``irregular``)."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.texts: Families = {}
        self.at: dict[str, list[int]] = {}  # name -> where its blocks are in ``blocks``
        self.irregular: set[str] = set()    # names whose text is not their blocks' texts

    def families(self, blocks: list[Block], lines_of: Callable[[Block], _Lines]) -> Families:
        if blocks == self.blocks:  # each the same object (a Block compares by identity)
            return self.texts
        made: dict[int, _Lines] = {}  # id(block) -> its lines, made in this call
        for block in blocks:
            if block.rendered is None:
                lines = made[id(block)] = lines_of(block)
                block.rendered = {name: (prefixes, len(text))
                                  for name, (prefixes, text) in lines.items()}
        old_blocks, old_texts = self.blocks, self.texts
        before: dict[str, list[int]] = {}  # where the dirty metrics' blocks were
        dirty = self._dirty(blocks, before)
        if dirty is None:  # ranks came or went: every metric's order may have changed
            before, self.at = self.at, {}
            for index, block in enumerate(blocks):
                for name in block.rendered or ():
                    self.at.setdefault(name, []).append(index)
            dirty = set(self.at) | set(before)
            self.texts = {}

        def text_of(block: Block, name: str) -> str:
            lines = made.get(id(block))
            if lines is None:  # a block met again elsewhere: its lines made again
                lines = made[id(block)] = lines_of(block)
            return lines[name][1]

        for name in dirty:
            where = self.at.get(name)
            if not where:  # no block holds it any more
                self.texts.pop(name, None)
                self.at.pop(name, None)
                self.irregular.discard(name)
                continue
            old = old_texts.get(name) if name not in self.irregular else None
            places: dict[int, tuple[int, int]] = {}  # id(block) -> its text in ``old``
            if old is not None:
                at = 0
                for index in before.get(name, where):
                    block = old_blocks[index]
                    size = (block.rendered or {})[name][1]
                    places.setdefault(id(block), (at, at + size))
                    at += size
                if at != len(old.lines):
                    places = {}
            family, whole = _joined([blocks[i] for i in where], name, old.lines if old else "",
                                    places, text_of)
            self.texts[name] = family
            if whole:
                self.irregular.discard(name)
            else:
                self.irregular.add(name)
        self.blocks = blocks
        return self.texts

    def _dirty(self, blocks: list[Block], before: dict[str, list[int]]) -> set[str] | None:
        """The metrics of the blocks that are others than last time (where each metric's
        blocks are follows a block that holds other metrics: a process's CPU contention
        comes and goes; ``before`` gets where they were); None when ranks came or went."""
        if len(blocks) != len(self.blocks):
            return None
        dirty: set[str] = set()
        for index, (old, new) in enumerate(zip(self.blocks, blocks)):
            if old is not new:
                before_names = (old.rendered or {}).keys()
                after = (new.rendered or {}).keys()
                if before_names != after:
                    for name in (before_names - after) | (after - before_names):
                        if name not in before:
                            before[name] = list(self.at.get(name, ()))
                    for name in before_names - after:
                        self.at[name].remove(index)
                    for name in after - before_names:
                        bisect.insort(self.at.setdefault(name, []), index)
                    dirty.update(before_names)
                dirty.update(after)
        return dirty


def _joined(blocks: list[Block], name: str, old: str, places: dict[int, tuple[int, int]],
            text_of: Callable[[Block, str], str]) -> tuple[Family, bool]:
    """One metric's lines from its blocks in order, a prefix written once (the first);
    a block's text read from ``old`` where ``places`` has it (a run of blocks that lie
    one after another there, as one piece), else made (``text_of``). Whether every
    block's text went in whole."""
    seen: set[str] = set()
    out: list[str] = []
    whole = True
    start = end = -1  # the run of ``old`` not yet written
    for block in blocks:
        prefixes = (block.rendered or {})[name][0]
        if seen.isdisjoint(prefixes):
            seen.update(prefixes)
            place = places.get(id(block))
            if place is not None and place[0] == end:
                end = place[1]
                continue
            if end > start:
                out.append(old[start:end])
            if place is not None:
                start, end = place
            else:
                start = end = -1
                out.append(text_of(block, name))
            continue
        if end > start:
            out.append(old[start:end])
        start = end = -1
        whole = False
        text = text_of(block, name)
        for line in text[:-1].split("\n"):  # a value holds no space, a prefix ends in one
            prefix = line[:line.rindex(" ") + 1]
            if prefix not in seen:
                seen.add(prefix)
                out.append(line + "\n")
    if end > start:
        out.append(old[start:end])
    return Family("".join(out)), whole
_Key = tuple[str, tuple[tuple[str, str], ...]]


class ExpositionWriter:
    """Renders samples in either format. ``families`` renders one source's samples to
    lines, which do not depend on the format; ``join`` puts the families of several
    sources together under one header each, so a source whose samples did not change
    is not rendered again. Per source, it keeps the line prefixes of the series it saw
    in that source's last rendering (memory follows the live series)."""

    def __init__(self, metrics: Mapping[str, MetricSpec],
                 reject: Callable[[str, str], None]):
        self.metrics, self.reject = metrics, reject
        self._prefixes: dict[Hashable, dict[_Key, str]] = {}
        self._headers: dict[tuple[str, bool], bytes] = {}
        self._blocks: dict[Hashable, BlockTexts] = {}

    def render(self, samples: Iterable[Sample], content_type: str = TEXT) -> bytes:
        return self.join([self.families(samples)], content_type)

    def families(self, samples: Iterable[Sample], source: Hashable = None) -> Families:
        """The samples' lines per metric name, names outside the contract dropped.

        ``Rows`` among a run's deferred parts (``agent/series.py``) skip the sample path:
        each series writes its kept line while its value is the one it was written with,
        and a metric only their blocks hold keeps its text while the blocks are the same.
        """
        known = self._prefixes.get(source, {})
        live: dict[_Key, str] = {}  # "": refused
        lines: dict[str, dict[str, str]] = {}  # name -> prefix -> line, in the order written
        blocks: list[Block] = []  # every Rows part's blocks, in order
        for part in samples.parts() if isinstance(samples, Deferred) else (samples,):
            if isinstance(part, Rows):
                blocks.extend(part.blocks)
                self._rows(part.pairs, lines)
                continue
            for sample in part:
                name = sample.name
                key = (name, tuple(sample.labels.items()))
                prefix = live.get(key)
                if prefix is None:
                    prefix = known.get(key)
                    if prefix is None:
                        prefix = self._checked_prefix(name, sample.labels)
                    live[key] = prefix
                if not prefix:
                    continue
                line = prefix + format_value(sample.value) + "\n"
                _keep(name, prefix, line, lines)
        self._prefixes[source] = live
        found = {name: Family("".join(each.values())) for name, each in lines.items()}
        if not blocks and source not in self._blocks:
            return found
        texts = self._blocks.setdefault(source, BlockTexts())
        of_blocks = texts.families(blocks, self._block_lines)
        if not of_blocks.keys().isdisjoint(found):  # a metric in both: in the rows' order
            return self._flattened(samples)
        found.update(of_blocks)
        return found

    def _flattened(self, samples: Iterable[Sample]) -> Families:
        """Every part's lines in the order written, a block's rows as a Rows' own."""
        lines: dict[str, dict[str, str]] = {}
        for part in samples.parts() if isinstance(samples, Deferred) else (samples,):
            if isinstance(part, Rows):
                for block in part.blocks:
                    self._rows(block.pairs, lines)
                self._rows(part.pairs, lines)
                continue
            for sample in part:
                prefix = self._checked_prefix(sample.name, sample.labels)
                if prefix:
                    _keep(sample.name, prefix, prefix + format_value(sample.value) + "\n",
                          lines)
        return {name: Family("".join(each.values())) for name, each in lines.items()}

    def _block_lines(self, block: Block) -> dict[str, tuple[tuple[str, ...], str]]:
        """A block's lines per metric (its prefixes and text), made once per block; its
        series keep no line of their own (the block's text is the one copy)."""
        lines: dict[str, dict[str, str]] = {}
        for series, value in block.pairs:
            if series.prefix is None:
                series.prefix = self._checked_prefix(series.name, series.labels)
            prefix = series.prefix
            if prefix:
                _keep(series.name, prefix, prefix + format_value(value) + "\n", lines)
        return {name: (tuple(each), "".join(each.values())) for name, each in lines.items()}

    def _rows(self, pairs: list[tuple[Series, float]],
              lines: dict[str, dict[str, str]]) -> None:
        """``_keep`` for each series, inlined: this loop runs for every rank's series."""
        copysign = math.copysign
        for series, value in pairs:
            last = series.last  # (value, prefix, line); -0.0 == 0.0 but is written apart
            if last is not None and last[0] == value and (
                    value or copysign(1.0, value) == copysign(1.0, last[0])):
                prefix, line = last[1], last[2]
            else:
                if series.prefix is None:
                    series.prefix = self._checked_prefix(series.name, series.labels)
                prefix = series.prefix
                if not prefix:
                    continue
                line = prefix + format_value(value) + "\n"
                series.last = (value, prefix, line)
            found = lines.get(series.name)
            if found is None:
                lines[series.name] = {prefix: line}
            elif prefix not in found:
                found[prefix] = line

    def forget(self, source: Hashable) -> None:
        """Drop a source's cached prefixes and texts (its collector is gone)."""
        self._prefixes.pop(source, None)
        self._blocks.pop(source, None)

    def join(self, sources: Iterable[Families], content_type: str = TEXT) -> bytes:
        """One exposition body from the sources' families, in the sources' order within
        a family; a series two sources both hold is written once (the first's)."""
        openmetrics = content_type == OPENMETRICS
        merged: dict[str, list[Family]] = defaultdict(list)
        for families in sources:
            for name, family in families.items():
                merged[name].append(family)
        # Encoded a family at a time into one growing buffer: the body as one str and
        # then its bytes had been two bodies' worth at once beside the one served (1.3 MiB
        # each at 256 ranks), the agent's highest peak.
        out = io.BytesIO()
        write = out.write
        for name in sorted(merged):
            write(self._header(self.metrics[name], openmetrics))
            parts = merged[name]
            write(parts[0].lines.encode())
            if len(parts) > 1:
                write("".join(_without_seen(parts)).encode())
        if openmetrics:
            write(b"# EOF\n")
        return out.getvalue()

    def _checked_prefix(self, name: str, labels: dict[str, str]) -> str:
        """The series' line prefix; "" for a name or label set the contract refuses."""
        spec = self.metrics.get(name)
        if spec is None:
            self.reject(name, "not in the metrics contract")
            return ""
        if labels.keys() != set(spec.labels):
            self.reject(name, f"labels {sorted(labels)} != {list(spec.labels)}")
            return ""
        if not labels:
            return spec.name + " "
        pairs = ",".join(f'{key}="{_escape_label_value(labels[key])}"' for key in sorted(labels))
        return f"{spec.name}{{{pairs}}} "

    def _header(self, spec: MetricSpec, openmetrics: bool) -> bytes:
        header = self._headers.get((spec.name, openmetrics))
        if header is None:
            kind = "counter" if spec.type == "counter" else "gauge"  # "info" is a gauge of 1
            family = spec.name
            if openmetrics and kind == "counter":
                family = spec.name.removesuffix("_total")  # OpenMetrics names the family bare
            header = (f"# HELP {family} {_escape_help(spec.help, openmetrics)}\n"
                      f"# TYPE {family} {kind}\n").encode()
            self._headers[(spec.name, openmetrics)] = header
        return header


def _keep(name: str, prefix: str, line: str, lines: dict[str, dict[str, str]]) -> None:
    """Add a line to its family unless a series of that prefix is in already (two run
    dirs claiming one rank: the first wins)."""
    found = lines.get(name)
    if found is None:
        lines[name] = {prefix: line}
    elif prefix not in found:
        found[prefix] = line


def _without_seen(parts: list[Family]) -> Iterator[str]:
    """The lines of ``parts[1:]`` whose series no earlier part wrote (rarely any)."""
    seen = set(parts[0].prefixes)
    for part in parts[1:]:
        if seen.isdisjoint(part.prefixes):
            seen.update(part.prefixes)
            yield part.lines
            continue
        for line in part.lines[:-1].split("\n"):  # a value holds no space, a prefix ends in one
            prefix = line[:line.rindex(" ") + 1]
            if prefix not in seen:
                seen.add(prefix)
                yield line + "\n"
