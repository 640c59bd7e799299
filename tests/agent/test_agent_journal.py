"""The journal collector: counters from a run's journal, tailed incrementally.

Driven by tests/fixtures/journal/journal.jsonl (a controller-run job's journal in the
shapes alerts/notify.py, control/actions.py, control/controller.py, trainer/train.py and the
checkpoint library write, plus a torn and some alien lines) and by the real writers.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agent_helpers import FIXTURES, collector, make_ctx, publish, samples, value
from trainwatch.agent.status import build_status
from trainwatch.alerts.rules import ACTIONS, load_rules
from trainwatch.contract.layout import CLOSED_EVENT
from trainwatch.rundir.run_dir import RunDir

JOURNAL = FIXTURES / "journal" / "journal.jsonl"
LINES = JOURNAL.read_bytes().splitlines(keepends=True)
NODE = ("node", "node-a")
REPLACED = "trainwatch_collector_journal_replaced_total"
UNREADABLE = "trainwatch_collector_journal_unreadable"


def run_with(tmp_path: Path, data: bytes = b"", name: str = "run") -> RunDir:
    run = RunDir(tmp_path / name).create()
    run.write_run_info({"job": "exp1"})
    run.journal_file.write_bytes(data)
    return run


def append(run: RunDir, data: bytes) -> None:
    with open(run.journal_file, "ab") as fh:
        fh.write(data)


def fired(result, alertname: str, severity: str) -> float:
    return value(result, "trainwatch_alert_fired_total", alertname=alertname,
                 severity=severity)


def totals(result) -> dict[str, dict[tuple, float]]:
    """Every counter the collector exports, by metric and labels."""
    return {name: samples(result, name) for name in (
        "trainwatch_alert_fired_total", "trainwatch_action_taken_total",
        "trainwatch_action_skipped_total", "trainwatch_train_restarts_total",
        "trainwatch_collector_journal_lines_skipped_total")}


def test_fixture_journal_counts_every_kind_of_event(tmp_path):
    run = run_with(tmp_path, JOURNAL.read_bytes())
    result = collector(make_ctx([run.root]), "journal").collect()
    assert fired(result, "TrainingStalled", "critical") == 3  # one glued to a torn line
    assert fired(result, "CheckpointFailed", "warning") == 1
    # Every rule of the rules set is there at 0, so increase() sees its first firing.
    alerts = samples(result, "trainwatch_alert_fired_total")
    rules = {(r.name, r.severity) for r in load_rules().rules}
    assert {(dict(k)["alertname"], dict(k)["severity"]) for k in alerts} == rules
    assert sum(alerts.values()) == 4
    assert all(dict(k)["run"] == "exp1" and dict(k)["node"] == "node-a" for k in alerts)
    assert value(result, "trainwatch_action_taken_total", action="stall_restart") == 1
    assert value(result, "trainwatch_action_taken_total", action="restart") == 0
    assert value(result, "trainwatch_action_skipped_total", action="rollback_skip") == 1
    assert value(result, "trainwatch_action_skipped_total", action="none") == 1
    assert {dict(k)["action"] for k in samples(result, "trainwatch_action_taken_total")} \
        == set(ACTIONS)
    assert value(result, "trainwatch_train_restarts_total", kind="controller") == 1
    assert value(result, "trainwatch_train_restarts_total", kind="torchrun") == 1
    # The newest save of the run's own folder; the mirror copy's write time is not it.
    assert value(result, "trainwatch_checkpoint_last_save_duration_seconds") == 0.55
    assert value(result, "trainwatch_checkpoint_last_blocking_seconds") == 0.07
    assert value(result, "trainwatch_collector_journal_lines_skipped_total") == 4
    summary = result.data[str(run.root)]
    assert summary["caught_up"] and summary["offset"] == len(JOURNAL.read_bytes())
    assert [(s["line"], s["reason"]) for s in summary["skipped"]] == [
        (15, "torn or not JSON"), (16, "not a JSON object"),
        (17, "record version 2 not supported"), (18, "no event name")]


def test_a_run_its_supervisor_stopped_is_over_until_it_starts_again(tmp_path):
    """controller_stopped after the ranks' start: the supervisor stopped the run (ranks it
    SIGKILLed keep a running status; the rules leave such a run alone). Any start after it
    (the controller's, the launcher's, a rank's) makes the run live again."""
    run = run_with(tmp_path)
    journal = collector(make_ctx([run.root]), "journal")

    def stopped() -> float:
        return value(journal.collect(), "trainwatch_run_supervisor_stopped")
    assert stopped() == 0  # no journal yet
    for event in ("controller_started", "job_started", "rank_started", "checkpoint_saved"):
        run.append_event(event, "engine")
    assert stopped() == 0
    run.append_event("job_stopped", "engine", killed=[4242])
    assert stopped() == 0  # a restart's stop: the job is started again right after
    run.append_event("controller_stopped", "engine", exit_code=130, interrupted=True)
    assert stopped() == 1
    assert journal.collect().data[str(run.root)]["supervisor_stopped"] is True
    run.append_event("alert_firing", "engine", alert="TrainingRankDown", severity="critical")
    assert stopped() == 1  # what happens after the stop does not start it
    for start in ("controller_started", "rank_started", "launcher_started"):
        run.append_event(start, "engine")
        assert stopped() == 0, start
        run.append_event("controller_stopped", "engine")
        assert stopped() == 1
    # A fresh agent reads the whole journal: the same answer.
    assert value(collector(make_ctx([run.root]), "journal").collect(),
                 "trainwatch_run_supervisor_stopped") == 1


def test_a_run_closed_by_hand_is_over_until_it_starts_again(tmp_path):
    """run_closed (trainwatch close: the job is gone, e.g. its node rebooted, and no
    supervisor is left to journal a stop) counts as a stop; a new start opens the run."""
    run = run_with(tmp_path)
    journal = collector(make_ctx([run.root]), "journal")
    for event in ("controller_started", "job_started", "rank_started"):
        run.append_event(event, "engine")
    assert value(journal.collect(), "trainwatch_run_supervisor_stopped") == 0
    run.append_event(CLOSED_EVENT, "close", reason="node rebooted")
    assert value(journal.collect(), "trainwatch_run_supervisor_stopped") == 1
    run.append_event("controller_started", "engine")
    assert value(journal.collect(), "trainwatch_run_supervisor_stopped") == 0


def test_incremental_tail_counts_each_line_once_across_collections(tmp_path):
    whole = collector(make_ctx([run_with(tmp_path, JOURNAL.read_bytes(), "whole").root]),
                      "journal").collect()
    run = run_with(tmp_path, b"".join(LINES[:9]))
    tail = collector(make_ctx([run.root]), "journal")
    first = tail.collect()
    assert fired(first, "TrainingStalled", "critical") == 1
    assert value(first, "trainwatch_action_taken_total", action="stall_restart") == 1
    assert value(first, "trainwatch_train_restarts_total", kind="controller") == 0
    assert tail.collect().samples == first.samples  # nothing new: nothing counted again
    append(run, b"".join(LINES[9:]))
    second = tail.collect()
    assert totals(second) == totals(whole)
    assert tail.collect().samples == second.samples


def test_bounded_reads_catch_up_before_exporting(tmp_path):
    """At most max_bytes_per_run per collection, whole lines only. A fresh agent (or a
    reload) counts from the first line and exports nothing for the run until it has read
    to the end: Prometheus never sees the totals climb from 0 again."""
    whole = collector(make_ctx([run_with(tmp_path, JOURNAL.read_bytes(), "whole").root]),
                      "journal").collect()
    run = run_with(tmp_path, JOURNAL.read_bytes())
    journal = collector(make_ctx([run.root], collectors={"journal": {
        "max_bytes_per_run": 1024}}), "journal")
    offsets = [0]
    while not (result := journal.collect()).data[str(run.root)]["caught_up"]:
        # only the gauge that it can be read: no counter before the whole journal is
        assert [(x.name, x.value) for x in result.samples] == [(UNREADABLE, 0.0)]
        offsets.append(result.data[str(run.root)]["offset"])
        assert len(offsets) < 20
    offsets.append(result.data[str(run.root)]["offset"])
    steps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert len(steps) >= 4 and all(0 < s <= 1024 for s in steps)
    assert all(JOURNAL.read_bytes()[o - 1:o] == b"\n" for o in offsets[1:])
    assert offsets[-1] == len(JOURNAL.read_bytes())
    assert totals(result) == totals(whole)


def test_a_torn_last_line_waits_for_its_newline_and_counts_once(tmp_path):
    line = LINES[7]  # alert_firing TrainingStalled
    run = run_with(tmp_path, b"".join(LINES[:7]) + line[:60])
    journal = collector(make_ctx([run.root]), "journal")
    before = journal.collect()
    assert fired(before, "TrainingStalled", "critical") == 0
    assert value(before, "trainwatch_collector_journal_lines_skipped_total") == 0
    assert before.data[str(run.root)]["caught_up"]
    append(run, line[60:-1])  # still no newline
    assert fired(journal.collect(), "TrainingStalled", "critical") == 0
    append(run, b"\n")
    for _ in range(2):
        after = journal.collect()
        assert fired(after, "TrainingStalled", "critical") == 1
        assert value(after, "trainwatch_collector_journal_lines_skipped_total") == 0


def test_truncation_rotation_and_rewrite_start_over_without_lowering_totals(tmp_path):
    stalled = LINES[7]
    run = run_with(tmp_path, stalled * 3)
    journal = collector(make_ctx([run.root]), "journal")
    assert fired(journal.collect(), "TrainingStalled", "critical") == 3

    run.journal_file.write_bytes(stalled)  # truncated in place: shorter than the offset
    result = journal.collect()
    assert fired(result, "TrainingStalled", "critical") == 4
    assert result.data[str(run.root)]["reopened_total"] == 1
    # trainwatch only appends: each of these, while the run goes on, lost its record
    assert value(result, REPLACED) == 1

    os.rename(run.journal_file, run.root / "journal.jsonl.1")  # rotated: a new, longer file
    run.journal_file.write_bytes(LINES[19] * 5)  # CheckpointFailed
    result = journal.collect()
    assert fired(result, "CheckpointFailed", "warning") == 5
    assert fired(result, "TrainingStalled", "critical") == 4
    assert result.data[str(run.root)]["reopened_total"] == 2
    assert value(result, REPLACED) == 2

    # Rewritten in place (same inode) and already longer than the offset: its first bytes
    # differ from what was read, so it is read from the start, not from the old offset.
    with open(run.journal_file, "r+b") as fh:
        fh.write(stalled * 8)
        fh.truncate()
    result = journal.collect()
    assert fired(result, "TrainingStalled", "critical") == 12
    assert fired(result, "CheckpointFailed", "warning") == 5
    assert result.data[str(run.root)]["reopened_total"] == 3

    run.journal_file.unlink()  # gone: totals stay, a new journal is read from its start
    result = journal.collect()
    assert fired(result, "TrainingStalled", "critical") == 12
    assert value(result, REPLACED) == 4
    run.journal_file.write_bytes(stalled)
    result = journal.collect()
    assert fired(result, "TrainingStalled", "critical") == 13
    assert value(result, REPLACED) == 4  # the removal and its new file: one loss
    assert value(result, UNREADABLE) == 0


def test_alien_and_overlong_lines_are_skipped_counted_and_listed(tmp_path):
    long_line = b'{"v":1,"event":"alert_firing","pad":"' + b"x" * 3000 + b'"}\n'
    run = run_with(tmp_path, LINES[7] + b"\x00\xff garbage\n" + b'"just a string"\n'
                   + long_line + LINES[7] + b"{}\n" + b'{"v":"one","event":"x"}\n')
    journal = collector(make_ctx([run.root], collectors={"journal": {
        "max_bytes_per_run": 1024}}), "journal")
    for _ in range(6):
        result = journal.collect()
    assert fired(result, "TrainingStalled", "critical") == 2
    assert value(result, "trainwatch_collector_journal_lines_skipped_total") == 5
    summary = result.data[str(run.root)]
    assert [(s["line"], s["reason"]) for s in summary["skipped"]] == [
        (2, "torn or not JSON"), (3, "not a JSON object"), (4, "line longer than 1024 bytes"),
        (6, "no event name"), (7, "record version 'one' not supported")]
    assert summary["caught_up"] and summary["error"] is None


def test_unknown_names_are_capped_per_run_then_other(tmp_path):
    def alert(name, severity="warning") -> bytes:
        return (f'{{"v":1,"time":1.0,"event":"alert_firing","alert":{name},'
                f'"severity":"{severity}"}}\n').encode()

    run = run_with(tmp_path, b"".join([
        alert('"CustomA"'), alert('"CustomB"'), alert('"CustomA"'), alert('"CustomC"'),
        alert('"TrainingStalled"', "critical"), alert('"free text, not a name"'),
        alert("null"), alert('"CustomA"', "page"),
        b'{"v":1,"event":"action_taken","action":"scale_up"}\n',
        b'{"v":1,"event":"action_taken","action":"drain"}\n',
        b'{"v":1,"event":"action_taken","action":"reboot"}\n',
        b'{"v":1,"event":"action_taken","action":"restart"}\n']))
    result = collector(make_ctx([run.root], collectors={"journal": {"max_extra_names": 2}}),
                       "journal").collect()
    assert fired(result, "CustomA", "warning") == 2
    assert fired(result, "CustomB", "warning") == 1
    assert fired(result, "CustomA", "other") == 1
    assert fired(result, "TrainingStalled", "critical") == 1  # a rule's name is never capped
    assert fired(result, "other", "warning") == 3  # CustomC past the cap, free text, null
    names = {dict(k)["alertname"] for k in samples(result, "trainwatch_alert_fired_total")}
    assert names - {r.name for r in load_rules().rules} == {"CustomA", "CustomB", "other"}
    taken = {dict(k)["action"]: v for k, v in
             samples(result, "trainwatch_action_taken_total").items()}
    assert taken == {**dict.fromkeys(ACTIONS, 0), "restart": 1, "scale_up": 1, "drain": 1,
                     "other": 1}


def test_no_journal_yet_exports_zeros_and_status_lists_the_journal(tmp_path):
    run = RunDir(tmp_path / "run").create()
    ctx = make_ctx([run.root])
    journal = collector(ctx, "journal")
    result = journal.collect()
    assert value(result, "trainwatch_train_restarts_total", run="run", kind="torchrun") == 0
    assert not samples(result, "trainwatch_checkpoint_last_save_duration_seconds")
    run.journal_file.write_bytes(LINES[7] + b"[]\n")
    result = journal.collect()
    publish(ctx, "journal", result)
    publish(ctx, "ranks", collector(ctx, "ranks").collect())
    status = build_status(ctx, listen="127.0.0.1:0", config_loaded_at=0.0)
    entry = status["jobs"][0]["journal"]
    assert entry["lines_skipped_total"] == 1 and entry["skipped"][0]["line"] == 2
    assert entry["path"] == str(run.journal_file)
    # A run dir no longer watched is forgotten (bounded memory).
    ctx.config.run_dirs = []
    assert journal.collect().data == {} and journal.tails == {}


def test_events_from_the_real_writers(tmp_path):
    """The controller, the action runner, the journal notifier and the checkpoint library
    write the journal; the collector reads back what each wrote."""
    torch = pytest.importorskip("torch")
    from trainwatch.control.actions import ActionRequest, ActionRunner, Policy
    from trainwatch.control.controller import JobController
    from trainwatch.alerts.engine import Alert
    from trainwatch.alerts.notify import JournalNotifier
    from trainwatch.rank.checkpoint import CheckpointConfig, Checkpointer

    run = RunDir(tmp_path / "run").create()
    rule = next(r for r in load_rules().rules if r.name == "TrainingStalled")
    alert = Alert(rule, {"alertname": rule.name, "run": "run", "rank": "1"},
                  {"summary": "stalled"}, 12.0, time.time(), state="firing")
    JournalNotifier(str(run.root)).notify("firing", alert, time.time())
    JournalNotifier(str(run.root)).notify("resolved", alert, time.time())

    controller = JobController(run.root, [sys.executable, "-c", "pass"])
    controller.start()
    controller.proc.wait(30)
    controller.restart("TrainingStalled")  # attempt 2
    controller.proc.wait(30)
    runner = ActionRunner(run.root, None, Policy())
    request = ActionRequest("CheckpointTooOld", "checkpoint_now", {"run": "run"}, "f1",
                            "2026-01-01T00:00:00Z", "engine")
    runner.handle(request)
    runner.handle(request)  # a duplicate delivery: skipped
    runner.handle(ActionRequest("TrainingStalled", "stall_restart", {"run": "run"}, "f2",
                                "2026-01-01T00:00:00Z", "engine"))  # no controller: skipped

    model = torch.nn.Linear(4, 2)
    ckpt = Checkpointer(CheckpointConfig(every_steps=1, mode="sync", fsync=False,
                                         mirror_dir=str(tmp_path / "mirror")), run.root)
    ckpt.start()
    try:
        for step in (1, 2):
            ckpt.after_step(step, lambda: {"model": model.state_dict()})
    finally:
        ckpt.close()

    result = collector(make_ctx([run.root]), "journal").collect()
    assert fired(result, "TrainingStalled", "critical") == 1
    assert value(result, "trainwatch_train_restarts_total", kind="controller") == 1
    assert value(result, "trainwatch_action_taken_total", action="checkpoint_now") == 1
    assert value(result, "trainwatch_action_skipped_total", action="checkpoint_now") == 1
    assert value(result, "trainwatch_action_skipped_total", action="stall_restart") == 1
    assert value(result, "trainwatch_collector_journal_lines_skipped_total") == 0
    newest = [e for e in run.events("checkpoint_saved") if "copy" not in e][-1]
    assert newest["step"] == 2 and len(run.events("checkpoint_saved")) == 4  # + mirror copies
    assert value(result, "trainwatch_checkpoint_last_save_duration_seconds") == \
        newest["write_seconds"]
    assert value(result, "trainwatch_checkpoint_last_blocking_seconds") == \
        newest["blocking_seconds"] > 0


def _health(ctx, journal) -> list[str]:
    publish(ctx, "journal", journal.collect())
    return [r for r in build_status(ctx, listen="127.0.0.1:0",
                                    config_loaded_at=0.0)["health_reasons"]
            if "TrainwatchJournalUnreliable" in r]


def test_a_journal_replaced_while_the_run_goes_on_is_a_finding(tmp_path):
    """Deleted and made again (another inode) while the run goes on: counted, and /status
    says it; not so once the supervisor stopped the run, nor with the whole run directory."""
    run = run_with(tmp_path, LINES[7])
    ctx = make_ctx([run.root])
    journal = collector(ctx, "journal")
    assert value(journal.collect(), REPLACED) == 0 and _health(ctx, journal) == []
    run.journal_file.unlink()
    run.append_event("job_started", "controller", attempt=2)  # the supervisor's next line
    reasons = _health(ctx, journal)
    assert value(journal.collect(), REPLACED) == 1
    assert len(reasons) == 1 and "was replaced, truncated or removed while the run goes on" \
        in reasons[0] and "(1 time(s)" in reasons[0]
    status = build_status(ctx, listen="127.0.0.1:0", config_loaded_at=0.0)
    assert status["health"] == "degraded"

    run.append_event("controller_stopped", "supervisor", exit_code=0)  # the run is over
    journal.collect()
    run.journal_file.unlink()  # cleaning up a finished run loses nothing that counts
    assert value(journal.collect(), REPLACED) == 1

    other = run_with(tmp_path, LINES[7], name="other")
    ctx = make_ctx([other.root])
    journal = collector(ctx, "journal")
    journal.collect()
    shutil.rmtree(other.root)  # the whole run directory removed: no run, no journal to miss
    assert value(journal.collect(), REPLACED) == 0


def test_a_journal_the_agent_may_not_read_is_unreadable_from_the_first_look(tmp_path):
    """Permissions changed so the agent's user may not read it (here: this process drops
    to nobody for the look), or a FIFO at its place: 1 before any line was read, a health
    reason; readable again: 0."""
    base = Path(tempfile.mkdtemp(prefix="tw-journal-"))  # under /tmp: others may traverse
    try:
        _unreadable(base)
    finally:
        shutil.rmtree(base)


def _unreadable(base: Path) -> None:
    base.chmod(0o755)
    run = run_with(base, LINES[7])
    run.root.chmod(0o755)
    run.journal_file.chmod(0o600)
    ctx = make_ctx([run.root])
    journal = collector(ctx, "journal")
    if os.geteuid() == 0:
        os.seteuid(65534)  # nobody: the agent's user, to whom the journal is 0600 root's
        try:
            result = journal.collect()
        finally:
            os.seteuid(0)
        assert value(result, UNREADABLE) == 1
        assert "permission denied" in result.data[str(run.root)]["error"]
        assert not samples(result, REPLACED)  # never caught up: no counters yet
        publish(ctx, "journal", result)
        reasons = [r for r in build_status(ctx, listen="127.0.0.1:0",
                                           config_loaded_at=0.0)["health_reasons"]
                   if "TrainwatchJournalUnreliable" in r]
        assert len(reasons) == 1 and "cannot be read" in reasons[0]
    run.journal_file.chmod(0o644)
    assert value(journal.collect(), UNREADABLE) == 0
    run.journal_file.unlink()
    os.mkfifo(run.journal_file)  # a FIFO: never opened, never blocks us
    result = journal.collect()
    assert value(result, UNREADABLE) == 1 and result.data[str(run.root)]["error"]
