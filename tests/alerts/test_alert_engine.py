"""The embedded engine: dedup, silences, scraping real exporters, and its notifiers
(journal, webhook into trainwatch's own receiver, a real Alertmanager's v2 API)."""

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from trainwatch.control.actions import ActionRunner, Policy
from trainwatch.alerts.engine import Engine
from trainwatch.alerts.evaluate import Evaluator, History
from trainwatch.alerts.notify import AlertmanagerNotifier, JournalNotifier, WebhookNotifier
from trainwatch.alerts.promql import parse
from trainwatch.control.receiver import Receiver
from trainwatch.alerts.rules import load_rules
from trainwatch.alerts.scrape import Scraper
from trainwatch.alerts.silences import Silences
from trainwatch.rundir.run_dir import RunDir

from agent_helpers import wait_for
from conftest import fill_to_the_brim, tmpfs_mount
from control_helpers import TOKEN
from alerts_helpers import ALERTMANAGER, _free_port, _ready

STALL = {"__name__": "trainwatch_stall_incident_seconds", "run": "exp1", "node": "n1",
         "culprit_rank": "0", "kind": "frozen"}
WAITING = {"__name__": "trainwatch_stall_incident_ranks", "run": "exp1", "node": "n1",
           "role": "waiting"}


def stall(history, t, seconds, culprit="0", waiting=1):
    """What an agent exports for a run's stall incident: its age, and the waiting ranks."""
    history.add({**STALL, "culprit_rank": culprit}, t, seconds)
    history.add(WAITING, t, waiting)


def incident_gauges(registry):
    seconds = Gauge("trainwatch_stall_incident_seconds", "x",
                    ["run", "node", "culprit_rank", "kind"], registry=registry)
    Gauge("trainwatch_stall_incident_ranks", "x", ["run", "node", "role"],
          registry=registry).labels("exp1", "n1", "waiting").set(1)
    return seconds


@pytest.fixture
def fast_rules(tmp_path):
    override = tmp_path / "thresholds.yaml"
    override.write_text("stall_for: 30s\nagent_down_for: 30s\n")
    return load_rules(thresholds_file=override)


def test_dedup_and_resolve_are_announced_once(tmp_path, fast_rules):
    run = RunDir(tmp_path / "exp1").create()
    history = History()
    fired = []
    engine = Engine(fast_rules, history, notifiers=[JournalNotifier(str(run.root))],
                    on_firing=fired.append)
    for t in range(0, 120, 15):  # stalled from t=0; the page's `for` is 30s, the action's 0s
        stall(history, t, 100.0 + t)
        engine.evaluate(t)
        states = {a.name: a.state for a in engine.alerts()}
        assert states == {"TrainingStallSuspected": "firing",
                          "TrainingStalled": "pending" if t < 30 else "firing"}
    for t in range(120, 180, 15):
        stall(history, t, 0.0)
        engine.evaluate(t)
    firing, resolved = run.events("alert_firing"), run.events("alert_resolved")
    assert [e["alert"] for e in firing] == ["TrainingStallSuspected", "TrainingStalled"]
    assert len(resolved) == 2
    # each acts once: the early look at once, the page's own look after its `for`
    assert [a.name for a in fired] == ["TrainingStallSuspected", "TrainingStalled"]
    assert firing[1]["labels"]["culprit_rank"] == "0" and firing[1]["labels"]["severity"] == "critical"
    assert firing[1]["value"] == 1.0  # the ranks waiting for the culprit



def fill_journal_page(path):
    """Fill the journal's last page with a line no reader needs, so one more line needs
    a page the full disk does not have."""
    with open(path, "ab") as fh:
        fh.write(b"#" * (4096 - path.stat().st_size % 4096 - 1) + b"\n")


def test_a_transition_the_full_journal_refused_is_journaled_when_it_has_room(
        tmp_path, fast_rules):
    """The journal on a real full tmpfs (StorageFull fires exactly then): the page's
    alert_firing waits in memory with the time it happened, and is written, marked late,
    at the first evaluation after space returns, or when the engine stops."""
    with tmpfs_mount(tmp_path / "exp1", "1m"):
        run = RunDir(tmp_path / "exp1").create()  # an empty journal: no page to fill
        journal = JournalNotifier(run)
        history = History()
        engine = Engine(fast_rules, history, notifiers=[journal])
        full_at = fill_to_the_brim(run.root)
        for t in (0, 30, 45):
            stall(history, t, 100.0 + t)
            engine.evaluate(t)
        assert [a.name for a in engine.firing()] == ["TrainingStallSuspected",
                                                     "TrainingStalled"]
        assert run.events("alert_firing") == [] and len(journal.backlog) == 2
        (run.root / "filler").unlink()
        stall(history, 60, 160.0)
        engine.evaluate(60)  # no transition: the evaluation alone writes the backlog
        firing = run.events("alert_firing")
        assert [e["alert"] for e in firing] == ["TrainingStallSuspected", "TrainingStalled"]
        assert all(e["time"] <= full_at + 30 for e in firing), firing  # when they happened
        assert not journal.backlog
        # Full again at the end: the engine's stop writes what is left once it has room.
        fill_journal_page(run.journal_file)
        fill_to_the_brim(run.root)
        stall(history, 75, 0.0)
        engine.evaluate(75)
        assert len(journal.backlog) == 2 and not run.events("alert_resolved")
        (run.root / "filler").unlink()
        engine.flush()
        assert len(run.events("alert_resolved")) == 2

def test_silenced_alerts_neither_notify_nor_act(tmp_path, fast_rules):
    run = RunDir(tmp_path / "exp1").create()
    silences = Silences(run.root / "alerts" / "silences.json")
    silence = silences.add({"alertname": "TrainingStalled", "run": "exp1"}, 3600, now=0)
    history, fired = History(), []
    engine = Engine(fast_rules, history, silences=silences,
                    notifiers=[JournalNotifier(str(run.root))], on_firing=fired.append)
    for t in (0, 30, 60):
        stall(history, t, 100.0)
        engine.evaluate(t)
    # silencing the page holds the alert that acts before it (TrainingStallSuspected) too
    assert engine.firing() and not fired and not run.events("alert_firing")
    silences.expire(silence.id, now=60)
    stall(history, 90, 100.0, culprit="1")  # a new incident after the silence ended
    engine.evaluate(90)
    engine.evaluate(120)
    assert [(e["alert"], e["labels"]["culprit_rank"]) for e in run.events("alert_firing")] == [
        ("TrainingStallSuspected", "1"), ("TrainingStalled", "1")]
    assert [a.name for a in fired] == ["TrainingStallSuspected", "TrainingStalled"]


def test_silence_cli_roundtrip(tmp_path):
    def tw(*args):
        return subprocess.run([sys.executable, "-m", "trainwatch", "alerts", "silence", *args,
                               "--run-dir", str(tmp_path)], capture_output=True, text=True)
    out = tw("add", "alertname=TrainingStalled", "run=exp1", "--duration", "1h",
             "--comment", "drill")
    assert out.returncode == 0, out.stderr
    sid = out.stdout.split()[1]
    listed = json.loads(tw("list", "--json").stdout)
    assert listed[0]["matchers"] == {"alertname": "TrainingStalled", "run": "exp1"}
    assert tw("expire", sid).returncode == 0
    assert json.loads(tw("list", "--json").stdout) == []
    assert tw("add", "job", "--duration", "1h").returncode == 2
    assert tw("add", "job=x", "--duration", "soon").returncode == 2


def test_scraping_a_real_exporter_and_agent_down(fast_rules):
    registry = CollectorRegistry()
    gauge = incident_gauges(registry)
    gauge.labels("exp1", "n1", "0", "frozen").set(0)
    server, _ = start_http_server(0, "127.0.0.1", registry)
    port = server.server_address[1]
    history = History()
    engine = Engine(fast_rules, history)
    scraper = Scraper(history, [f"127.0.0.1:{port}"], timeout=2)
    try:
        scraper.scrape_all(0)
        gauge.labels("exp1", "n1", "0", "frozen").set(75)
        for t in (15, 30, 45):
            scraper.scrape_all(t)
            engine.evaluate(t)
        assert sorted(a.name for a in engine.firing()) == ["TrainingStallSuspected",
                                                           "TrainingStalled"]
        assert {a.value for a in engine.firing()} == {1}
    finally:
        server.shutdown()
        server.server_close()
    for t in (60, 75, 90):  # the exporter is gone: its series go stale, up becomes 0
        scraper.scrape_all(t)
        engine.evaluate(t)
    names = sorted(a.name for a in engine.firing())
    assert names == ["TrainwatchAgentDown"]
    down = engine.firing()[0]
    assert down.labels["instance"] == f"127.0.0.1:{port}"
    assert Evaluator(history).vector(parse("trainwatch_stall_incident_seconds").root, 90) == {}


def test_webhook_notifier_speaks_the_receivers_format(tmp_path, fast_rules):
    run = RunDir(tmp_path / "exp1").create()
    runner = ActionRunner(run.root, None, Policy())
    receiver = Receiver(fast_rules, runner, TOKEN).start()
    try:
        history = History()
        engine = Engine(fast_rules, history,
                        notifiers=[WebhookNotifier(receiver.url + "/webhook", TOKEN)])
        for t in (0, 30):
            stall(history, t, 100.0)
            engine.evaluate(t)
    finally:
        receiver.stop()
    skipped = run.events("action_skipped")
    assert {e["reason"] for e in skipped} == {"no job controller attached (report only)"}
    assert {e["delivery"] for e in skipped} == {"webhook"}
    assert [e["alert"] for e in skipped] == ["TrainingStallSuspected", "TrainingStalled"]


@pytest.mark.slow
@pytest.mark.skipif(ALERTMANAGER is None, reason="alertmanager missing")
def test_alertmanager_v2_api_receives_firing_and_resolved(tmp_path, fast_rules, processes):
    port = _free_port()
    (tmp_path / "am.yml").write_text("route: {receiver: blackhole}\n"
                                     "receivers: [{name: blackhole}]\n")
    processes([ALERTMANAGER, f"--config.file={tmp_path / 'am.yml'}",
               f"--storage.path={tmp_path / 'am'}", "--cluster.listen-address=",
               f"--web.listen-address=127.0.0.1:{port}"], tmp_path / "am.log")
    _ready(f"http://127.0.0.1:{port}/-/ready")
    am = AlertmanagerNotifier(f"http://127.0.0.1:{port}", resend_seconds=60)
    history = History()
    engine = Engine(fast_rules, history, notifiers=[am])
    now = time.time()
    for dt in (0, 30, 45):
        stall(history, now - 60 + dt, 100.0)
        engine.evaluate(now - 60 + dt)

    def alerts():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/alerts", timeout=5) as r:
            return [a for a in json.load(r) if a["labels"].get("alertname") == "TrainingStalled"]
    got = wait_for(alerts)
    assert got[0]["labels"]["culprit_rank"] == "0" and got[0]["status"]["state"] == "active"
    assert "no progress" in got[0]["annotations"]["summary"]
    stall(history, now, 0.0)
    engine.evaluate(now)  # resolved: sent again with endsAt = now
    wait_for(lambda: not [a for a in alerts() if a["status"]["state"] == "active"])
    assert am.sent >= 2


def test_alerts_watch_cli_scrapes_an_agent_and_journals(tmp_path):
    registry = CollectorRegistry()
    incident_gauges(registry).labels("exp1", "n1", "3", "stuck").set(42)
    server, _ = start_http_server(0, "127.0.0.1", registry)
    (tmp_path / "t.yaml").write_text("evaluation_interval: 1s\nstall_for: 0s\n")
    run = RunDir(tmp_path / "exp1").create()
    proc = subprocess.Popen([sys.executable, "-m", "trainwatch", "alerts", "watch",
                             "--thresholds", str(tmp_path / "t.yaml"), "--run-dir", str(run.root),
                             "--target", f"127.0.0.1:{server.server_address[1]}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        firing = wait_for(lambda: len(run.events("alert_firing")) == 2
                           and run.events("alert_firing"), timeout=60)
        assert {e["alert"] for e in firing} == {"TrainingStallSuspected", "TrainingStalled"}
        assert {e["labels"]["culprit_rank"] for e in firing} == {"3"}
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        server.shutdown()
        server.server_close()


def test_an_action_answered_not_final_is_asked_again_while_its_alert_fires(fast_rules):
    """A refuted stall is looked at again (not only when the alert starts firing), and
    nothing more is asked once an answer is final or the alert resolves."""
    from trainwatch.control.actions import Outcome
    from trainwatch.alerts.loop import EngineLoop
    from trainwatch.control.dispatch import connect_actions

    class Runner:  # answers: not confirmed, not confirmed, then acted
        job, guard_tripped, on_guard = "exp1", False, None
        policy = Policy(recheck_seconds=0.2)

        def __init__(self):
            self.asked = []

        def handle(self, req):  # per alert: not final twice, then final
            self.asked.append(req.alertname)
            final = self.asked.count(req.alertname) >= 3
            return Outcome(final, "x", final=final)

    runner, history = Runner(), History()
    engine = Engine(fast_rules, history)
    loop = EngineLoop(engine, None, interval=1.0)
    connect_actions(engine, runner, loop)
    t = 0.0

    def tick_until(done, seconds=10.0):
        nonlocal t
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            stall(history, t, 100.0 + t)
            loop.tick(t)
            t += 15.0
            time.sleep(0.05)
        return done()

    early = "TrainingStallSuspected"
    assert tick_until(lambda: runner.asked.count(early) >= 3)
    tick_until(lambda: False, seconds=1.0)  # final: never asked again while it fires
    assert runner.asked.count(early) == 3


def test_a_restart_held_by_the_rate_limit_is_asked_again_when_its_window_ends(fast_rules):
    """Not at the next stall recheck (a minute later): a frozen job stayed frozen that long."""
    from trainwatch.control.actions import Outcome
    from trainwatch.alerts.loop import EngineLoop
    from trainwatch.control.dispatch import connect_actions

    class Runner:  # held back for 0.3 s, then acted
        job, guard_tripped, on_guard = "exp1", False, None
        policy = Policy(recheck_seconds=600)

        def __init__(self):
            self.asked = []

        def handle(self, req):
            if req.alertname != "TrainingStallSuspected":  # the page's own action
                return Outcome(True, "restarted")
            self.asked.append(time.monotonic())
            if len(self.asked) == 1:
                return Outcome(False, "rate limited", final=False, retry_after=0.3)
            return Outcome(True, "restarted")

    runner, history = Runner(), History()
    engine = Engine(fast_rules, history)
    loop = EngineLoop(engine, None, interval=1.0)
    connect_actions(engine, runner, loop)
    t = 0.0
    deadline = time.monotonic() + 20
    while len(runner.asked) < 2 and time.monotonic() < deadline:
        stall(history, t, 100.0 + t)
        loop.tick(t)
        t += 1.0
        time.sleep(0.05)
    assert len(runner.asked) == 2 and runner.asked[1] - runner.asked[0] >= 0.3
