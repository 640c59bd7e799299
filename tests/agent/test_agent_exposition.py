"""The agent's own exposition writer must write what prometheus-client would, byte for
byte, in both formats — for every metric in the contract, with hostile label values and
every kind of float — while dropping what the contract does not allow."""

import math
import shutil
import subprocess

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from trainwatch.agent.exposition import (OPENMETRICS, TEXT, ExpositionWriter, content_type_for,
                                         format_value)
from trainwatch.agent.registry import Deferred, Sample
from trainwatch.agent.series import Block, Rows, Series, kept
from trainwatch.contract.metrics import METRICS

VALUES = [0.0, 1.0, -2.5, 0.1, 1e-7, 1234567.0, 1733232000.123, 1e16, 12345678901.0,
          math.inf, -math.inf, math.nan, 42]
LABEL_VALUES = ['plain', 'with "quotes"', "back\\slash", "new\nline", "ünïcode ✓", ""]


def contract_samples():
    """Every contract metric, a few series each, in an order unlike the sorted output."""
    samples = []
    for index, spec in enumerate(reversed(list(METRICS.values()))):
        for series in range(3):
            labels = {name: LABEL_VALUES[(index + series + i) % len(LABEL_VALUES)] + str(series)
                      for i, name in enumerate(reversed(spec.labels))}
            value = VALUES[(index + series) % len(VALUES)]
            if spec.type == "counter":
                value = 0.0 if math.isnan(value) else abs(value)  # OpenMetrics refuses these
            samples.append(Sample(spec.name, labels, value))
    return samples


def reference(samples, openmetrics):
    """What prometheus-client writes for the same samples."""
    class Families:
        def collect(self):
            for spec in sorted(METRICS.values(), key=lambda s: s.name):
                kind = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
                family = kind(spec.name, spec.help, labels=list(spec.labels))
                mine = [s for s in samples if s.name == spec.name]
                for s in mine:
                    family.add_metric([s.labels[k] for k in spec.labels], s.value)
                if mine:
                    yield family
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    return (generate_openmetrics if openmetrics else generate_latest)(registry)


def writer():
    rejected = []
    return ExpositionWriter(METRICS, lambda name, why: rejected.append((name, why))), rejected


@pytest.mark.parametrize("content_type", [TEXT, OPENMETRICS])
def test_every_contract_metric_is_written_as_prometheus_client_writes_it(content_type):
    samples = contract_samples()
    w, rejected = writer()
    first = w.render(samples, content_type)
    assert first == reference(samples, content_type == OPENMETRICS)
    assert w.render(samples, content_type) == first  # from the cached prefixes
    assert rejected == []


def test_openmetrics_output_parses_strictly_and_text_passes_promtool(tmp_path):
    samples = contract_samples()
    w, _ = writer()
    families = {f.name: f for f in text_string_to_metric_families(
        w.render(samples, OPENMETRICS).decode())}
    assert len(families) == len(METRICS)
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed")
    lint = subprocess.run(["promtool", "check", "metrics"], input=w.render(samples, TEXT),
                          capture_output=True)
    # promtool lints names and help; a contract problem would show here as well
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_unknown_names_and_wrong_labels_are_dropped_and_reported():
    spec = METRICS["trainwatch_rank_up"]
    good = {k: "1" for k in spec.labels}
    w, rejected = writer()
    body = w.render([Sample("trainwatch_not_in_contract", {}, 1.0),
                     Sample(spec.name, {**good, "extra": "x"}, 1.0),
                     Sample(spec.name, good, 1.0)]).decode()
    assert "trainwatch_not_in_contract" not in body and "extra" not in body
    assert body.count(f"\n{spec.name}{{") == 1
    assert [name for name, _ in rejected] == ["trainwatch_not_in_contract", spec.name]


def test_the_first_of_two_identical_series_wins():
    spec = METRICS["trainwatch_rank_up"]
    labels = {k: "0" for k in spec.labels}
    w, _ = writer()
    body = w.render([Sample(spec.name, labels, 1.0),
                     Sample(spec.name, dict(reversed(list(labels.items()))), 0.0)]).decode()
    assert body.count(f"{spec.name}{{") == 1 and body.rstrip().endswith(" 1.0")


def test_cached_prefixes_follow_the_live_series():
    spec = METRICS["trainwatch_rank_up"]
    w, _ = writer()
    series = [Sample(spec.name, {k: str(rank) for k in spec.labels}, 1.0) for rank in range(50)]
    w.render(series)
    w.render(series[:2])
    assert len(w._prefixes[None]) == 2


def test_joined_sources_write_one_header_per_family_and_the_first_series_wins():
    samples = contract_samples()
    w, _ = writer()
    half = len(samples) // 2
    for content_type in (TEXT, OPENMETRICS):
        joined = w.join([w.families(samples[:half], "a"), w.families(samples[half:], "b"),
                         w.families(samples[:3], "again")], content_type)
        assert joined == reference(samples, content_type == OPENMETRICS)


def _rounds(samples):
    """Values for the same series over renders: as first written, unchanged, each moved on
    to another value (NaN included), every zero turned to -0.0 (written apart), back."""
    first = [s.value for s in samples]
    moved = [VALUES[(VALUES.index(v) + 1) % len(VALUES)] if v in VALUES else 7.0
             for v in first]
    signed = [-0.0 if v == 0 else v for v in moved]
    rounds = [first, first, moved, signed, moved, first]
    for values in rounds:  # OpenMetrics refuses negative and NaN counters
        yield [0.0 if s.type == "counter" and (v != v or str(v).startswith("-")) else v
               for s, v in zip((METRICS[x.name] for x in samples), values)]


@pytest.mark.parametrize("content_type", [TEXT, OPENMETRICS])
def test_kept_lines_write_what_prometheus_client_writes_for_the_values_of_now(content_type):
    """A series made once keeps its last line (agent/series.py); whatever its value does
    from one render to the next, the body is what prometheus-client writes for it now."""
    samples = contract_samples()
    series = [Series(s.name, s.labels) for s in samples]
    w, rejected = writer()
    for values in _rounds(samples):
        rows = Rows()
        for each, value in zip(series, values):
            rows.add(each, value)
        body = w.join([w.families(Deferred((), (lambda rows=rows: rows,)), "ranks")],
                      content_type)
        now = [Sample(s.name, s.labels, v) for s, v in zip(samples, values)]
        assert body == reference(now, content_type == OPENMETRICS)
        assert list(rows) == now  # what readers of samples see
    assert rejected == []


def test_content_negotiation_and_values():
    assert content_type_for("") == TEXT
    assert content_type_for("text/plain;version=0.0.4") == TEXT
    assert content_type_for("application/openmetrics-text;version=1.0.0,text/plain;q=0.5") \
        == OPENMETRICS
    assert [format_value(v) for v in (math.inf, -math.inf, math.nan, 1234567.0, 0.5)] == \
        ["+Inf", "-Inf", "NaN", "1.234567e+06", "0.5"]


def test_a_ranks_series_share_its_labels_and_write_them_whole():
    """A book's series keep the rank's labels once, shared, and their own extra pair
    apart (a dict per series had been a third of what ~100 series a rank held at 256
    ranks); the labels they write and hand to readers are the whole set all the same."""
    from trainwatch.agent.series import SeriesBook
    book = SeriesBook({"run": "r", "node": "n", "rank": "3", "local_rank": "3"})
    plain = book.one("trainwatch_rank_heartbeat_age_seconds")
    phase = book.labelled("trainwatch_rank_phase", (("phase", "forward"),))
    assert plain.base is book.base and phase.base is book.base
    assert phase.labels == {"run": "r", "node": "n", "rank": "3", "local_rank": "3",
                            "phase": "forward"}
    rows = Rows()
    rows.add(phase, 1)
    w, rejected = writer()
    body = w.join([w.families(Deferred((), (lambda: rows,)), "ranks")]).decode()
    assert 'trainwatch_rank_phase{local_rank="3",node="n",phase="forward",rank="3",run="r"} 1.0' \
        in body and rejected == []


def test_block_texts_follow_the_blocks_of_now():
    """A metric only blocks hold keeps its text while the render gets the very blocks of
    the last one (agent/series.py ``Block``); a block of other values or of other
    metrics, a rank gone, or a metric in both a block and a Rows' own pairs is written as
    the values of now."""
    samples = contract_samples()
    series = [Series(s.name, s.labels) for s in samples]
    names = sorted({s.name for s in samples})
    in_blocks = set(names[::2])  # the other metrics are each Rows' own pairs
    w, rejected = writer()
    blocks: dict[int, Block] = {}
    for round_, values in enumerate(_rounds(samples)):
        ranks = 3 if round_ < 5 else 2  # a rank gone in the last round
        parts, made = [], []
        for rank in range(ranks):
            rows = Rows()
            mine = [(s, v) for i, (s, v) in enumerate(zip(series, values)) if i % 3 == rank]
            pairs = [(s, v) for s, v in mine if s.name in in_blocks]
            if round_ == 4 and rank == 0:  # a block of other metrics in the same place
                pairs = [(s, v) for s, v in pairs if s.name != pairs[-1][0].name]
            block = kept(blocks.get(rank), pairs)
            same = round_ == 1 and not any(v != v for _, v in pairs)  # NaN is never the same
            assert (block is blocks.get(rank)) == same
            rows.blocks.append(block)
            blocks[rank] = block
            for s, v in mine:
                if s.name not in in_blocks:
                    rows.add(s, v)
            if round_ == 3 and rank == 1:  # one metric in both: written in the rows' order
                rows.add(*next((s, v) for s, v in mine if s.name in in_blocks))
            parts.append(rows)
            made.extend(rows)
        for content_type in (TEXT, OPENMETRICS):
            got = w.join([w.families(Deferred((), tuple((lambda r=r: r) for r in parts)),
                                     "ranks")], content_type)
            now = [s for i, s in enumerate(made) if not any(
                (s.name, s.labels) == (o.name, o.labels) for o in made[:i])]
            assert got == reference(now, content_type == OPENMETRICS), (round_, content_type)
    assert rejected == []


def test_a_block_is_kept_only_for_the_very_same_values():
    one = Series("trainwatch_rank_step", {"run": "r", "node": "n", "rank": "0",
                                          "local_rank": "0"})
    block = Block([(one, 0.0)])
    assert kept(block, [(one, 0.0)]) is block
    for other in (-0.0, 1.0, math.nan):
        assert kept(block, [(one, other)]) is not block
    assert kept(block, [(one, 0.0), (one, 0.0)]) is not block
    assert kept(None, [(one, 0.0)]).pairs == [(one, 0.0)]
