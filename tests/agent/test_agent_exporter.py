"""/metrics renders each collector run once, not once per scrape: a run's samples
(deferred ones included) are built and formatted the first time they are read, and a
format scraped often is rendered in the background as collectors store new runs."""

import os
import threading
import time

from prometheus_client.openmetrics.parser import text_string_to_metric_families

from tests.agent_helpers import collector, make_ctx, wait_for, write_status
from trainwatch.agent.config import build_config
from trainwatch.agent.context import AgentContext
from trainwatch.agent.exporter import CachedExposition, SnapshotExporter
from trainwatch.agent.exposition import OPENMETRICS, TEXT
from trainwatch.agent.registry import Result, Sample
from trainwatch.agent.state import CollectorRecord
from trainwatch.rundir.run_dir import RunDir


def rank_up(rank: int, value: float) -> Sample:
    return Sample("trainwatch_rank_up", {"run": "r", "node": "n", "rank": str(rank),
                                         "local_rank": str(rank)}, value)


class Counted:
    """A collector run whose deferred samples count how often they are built."""

    def __init__(self, value: float):
        self.built = 0
        self.result = Result()
        self.result.add("trainwatch_collector_run_dirs", 1, node="n")
        self.result.defer(self.build)
        self.value = value

    def build(self):
        self.built += 1
        return [rank_up(rank, self.value) for rank in range(4)]


def store_run(ctx: AgentContext, name: str, run: Counted) -> None:
    ctx.store.set(CollectorRecord(name, True, 1.0, 1.0))
    ctx.store.finish(name, run.result, started=1.0, duration=0.5)


def test_a_run_is_rendered_once_for_every_scrape_and_format():
    ctx = AgentContext(build_config({}))
    exporter = SnapshotExporter(ctx)
    ranks, other = Counted(1.0), Counted(0.0)
    store_run(ctx, "ranks", ranks)
    store_run(ctx, "other", other)  # same series: the first stored (ranks') wins
    for _ in range(3):
        exporter.render(TEXT)
        text_string_to_metric_families(exporter.render(OPENMETRICS).decode())
    ctx.store.update("ranks", bump=False, runs=5)  # bookkeeping, the same run
    body = exporter.render(TEXT).decode()
    assert (ranks.built, other.built) == (1, 1)
    assert body.count("# TYPE trainwatch_rank_up gauge") == 1
    assert body.count("trainwatch_rank_up{") == 4 and 'rank="3",run="r"} 1.0' in body
    assert 'trainwatch_collector_runs_total{collector="ranks",node=' in body
    assert body.split('trainwatch_collector_runs_total{collector="ranks"')[1].split()[1] == "5.0"
    newer = Counted(0.5)
    store_run(ctx, "ranks", newer)
    assert 'rank="3",run="r"} 0.5' in exporter.render(TEXT).decode() and newer.built == 1
    del ctx.store.records["other"]
    assert "trainwatch_collector_run_dirs" in exporter.render(TEXT).decode()
    assert 'collector="other"' not in exporter.render(TEXT).decode()


def test_a_format_scraped_often_is_rendered_when_a_run_is_stored_not_on_the_scrape():
    ctx = AgentContext(build_config({}))
    exporter = SnapshotExporter(ctx)
    exposition = CachedExposition(ctx, exporter, max_age=0.0)
    store_run(ctx, "ranks", Counted(1.0))
    for _ in range(2):  # scraped often: twice within eager_for
        body, content_type = exposition.body("application/openmetrics-text; version=1.0.0")
    assert content_type == OPENMETRICS and b"# EOF" in body
    newer = Counted(2.0)
    store_run(ctx, "ranks", newer)
    wait_for(lambda: newer.built == 1, 10, 0.02, "the new run rendered in the background")
    renders = []
    render = exporter.render
    exporter.render = lambda content_type: renders.append(
        (content_type, threading.current_thread() is threading.main_thread())) \
        or render(content_type)
    body, _ = exposition.body("application/openmetrics-text")
    assert b'rank="3",run="r"} 2.0' in body and renders == []  # served as rendered
    text, content_type = exposition.body("")  # not scraped lately: rendered on the scrape
    assert content_type == TEXT and b"# EOF" not in text and renders == [(TEXT, True)]
    store_run(ctx, "ranks", Counted(3.0))  # scraped once: rendered on its next scrape only
    assert b'rank="3",run="r"} 3.0' in exposition.body("")[0]
    assert [call for call in renders if call[0] == TEXT] == [(TEXT, True)] * 2


def test_runs_stored_together_are_rendered_together():
    """Collectors of one period finish within milliseconds of each other (findings and
    replicas every second): the background render waits ``settle`` and renders them once,
    not once per stored run (nearly four renders a second for one scrape)."""
    ctx = AgentContext(build_config({}))
    exporter = SnapshotExporter(ctx)
    exposition = CachedExposition(ctx, exporter, max_age=0.0, settle=0.5)
    store_run(ctx, "ranks", Counted(1.0))
    for _ in range(2):  # scraped often: rendered in the background from now on
        exposition.body("")
    renders = []
    render = exporter.render
    exporter.render = lambda content_type: renders.append(content_type) or render(content_type)
    runs = [Counted(2.0), Counted(3.0), Counted(4.0)]
    for name, run in zip(("ranks", "findings", "replicas"), runs):
        store_run(ctx, name, run)
        time.sleep(0.1)  # a render started at once would be done before the next
    wait_for(lambda: all(run.built for run in runs), 10, 0.02, "the runs rendered")
    time.sleep(0.6)  # another render would have started by now
    assert renders == [TEXT] and [run.built for run in runs] == [1, 1, 1]


def _series_lines(body: str, rank: int) -> dict[str, str]:
    """A scrape's lines for one rank: series (name and labels) -> value."""
    found = {}
    for line in body.splitlines():
        if f'rank="{rank}",' in line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            found[series] = value
    return found


def _agent(tmp_path, ranks=(0, 1)):
    """A ranks and a findings collector on a run directory, and a /metrics renderer."""
    run = RunDir(tmp_path / "run").create()
    for rank in ranks:
        write_status(run, rank, os.getpid())
    ctx = make_ctx([run.root])
    collectors = [collector(ctx, "ranks"), collector(ctx, "findings")]
    exporter = SnapshotExporter(ctx)
    for each in collectors:
        ctx.store.set(CollectorRecord(each.name, True, 1.0, 1.0))

    def scrape() -> str:
        for each in collectors:
            ctx.store.finish(each.name, each.collect(), started=time.time(), duration=0.01)
        return exporter.render(TEXT).decode()
    return run, collectors, scrape


def test_a_ranks_changed_value_reaches_the_next_scrape_not_its_kept_line(tmp_path):
    """A rank's series keep their last line while their value stays (agent/series.py): a
    value that changed, a state that moved, a zero that changed sign must show at once."""
    run, _, scrape = _agent(tmp_path)
    scrape()
    before = _series_lines(scrape(), 1)  # the second from kept lines
    loss = 'trainwatch_train_loss{local_rank="1",node="node-a",rank="1",run="exp"}'
    state = 'trainwatch_rank_state{local_rank="1",node="node-a",rank="1",run="exp",state="%s"}'
    assert (before[loss], before[state % "running"], before[state % "failed"]) == \
        ("1.5", "1.0", "0.0")
    for new_loss in ("0.0", "-0.0", "2.25"):
        write_status(run, 1, os.getpid(), state="failed",
                     metrics={"step": 3, "loss": float(new_loss), "step_time_seconds": 0.1})
        after = _series_lines(body := scrape(), 1)
        assert (after[loss], after[state % "running"], after[state % "failed"]) == \
            (new_loss, "0.0", "1.0")
        assert _series_lines(body, 0)[loss.replace('"1"', '"0"')] == "1.5"  # untouched
    stalled = 'trainwatch_rank_stalled{local_rank="1",node="node-a",rank="1",run="exp"}'
    assert after[stalled] == "0.0"


def test_a_rank_that_goes_away_leaves_the_scrape_and_takes_its_kept_series_along(tmp_path):
    """Kept lines are memory per rank: when a rank's files are gone its series leave the
    next scrape and both collectors drop what they kept for it; a rank coming back is
    written from its new values."""
    run, (ranks, findings), scrape = _agent(tmp_path, ranks=(0, 1, 2))
    assert _series_lines(scrape(), 1)
    assert len(ranks._series) == len(findings._series) == 3
    (run.status_dir / "rank-00001.json").unlink()
    body = scrape()
    assert _series_lines(body, 1) == {} and _series_lines(body, 2)
    assert sorted(key[1] for key in ranks._series) == [0, 2]
    assert sorted(key[1] for key in findings._series) == [0, 2]
    write_status(run, 1, os.getpid(), metrics={"step": 9, "loss": 0.5})
    back = _series_lines(scrape(), 1)
    assert back['trainwatch_train_loss{local_rank="1",node="node-a",rank="1",run="exp"}'] \
        == "0.5"
