"""One run identity from the run directory to the receiver (issue #22, items 1 and 5).

A run's name is run.json's ``job`` as whoever created the directory wrote it (the Slurm
prolog's ``slurm-<id>``, the launcher, ``trainwatch run``): telemetry, the agent and the
receiver all read it there. A receiver on a webhook shared by several runs drops the
other runs' alerts without a journal line, and counts them.
"""

from __future__ import annotations

import logging
import urllib.request

import pytest

from control_helpers import TOKEN, _payload, _post
from trainwatch.control.actions import ActionRunner, Policy
from trainwatch.control.receiver import Receiver
from trainwatch.alerts.rules import load_rules
from trainwatch.contract.env import JOB_ENV
from trainwatch.rundir.run_dir import RunDir


@pytest.fixture
def receiver_in(monkeypatch):
    started = []
    monkeypatch.delenv(JOB_ENV, raising=False)

    def start(run_dir):
        rec = Receiver(load_rules(), ActionRunner(run_dir, None, Policy(dry_run=True)),
                       TOKEN).start()
        started.append(rec)
        return rec
    yield start
    for rec in started:
        rec.stop()


def _metric(rec, name: str) -> str:
    with urllib.request.urlopen(rec.url + "/metrics", timeout=10) as resp:
        return "\n".join(line for line in resp.read().decode().splitlines()
                         if line.startswith(name))


def test_another_runs_alert_is_dropped_silently_and_counted(tmp_path, receiver_in, caplog):
    caplog.set_level(logging.INFO)
    rec = receiver_in(tmp_path / "exp1")
    for fingerprint in ("01", "02", "01"):  # Alertmanager repeats it every minute
        code, body = _post(rec.url, _payload(fingerprint=fingerprint, job="exp2"))
        assert code == 200 and body["results"] == [
            {"alertname": "TrainingStallSuspected", "outcome": "dropped",
             "reason": "for another run"}]
    flood = [_payload(fingerprint=f"{i:04x}", job="exp2")["alerts"][0] for i in range(150)]
    _, body = _post(rec.url, {**_payload(), "alerts": flood})  # past the payload cap too
    assert {r["outcome"] for r in body["results"]} == {"dropped"}
    assert rec.runner.run.events() == []  # no journal line, no duplicate either
    assert "exp2" not in caplog.text
    assert _metric(rec, "trainwatch_receiver_other_run_alerts_total") == \
        'trainwatch_receiver_other_run_alerts_total{run="exp1"} 153.0'
    # its own run's alert still reaches the runner (a dry run, no controller: journaled)
    _, body = _post(rec.url, _payload(fingerprint="03", job="exp1"))
    assert body["results"][0]["outcome"] == "skipped"
    assert len(rec.runner.run.events("action_skipped")) == 1


def test_the_receiver_names_its_run_as_run_json_does(tmp_path, receiver_in, monkeypatch):
    # The directory's creator named the run; the receiver, started without a name, and
    # even one whose environment says otherwise, goes by run.json.
    run = RunDir(tmp_path / "slurm-201").create()
    rec = receiver_in(run.root)
    assert rec.runner.job == "slurm-201"  # no run.json yet: the directory's name
    run.write_run_info({"job": "expA-201"})
    monkeypatch.setenv(JOB_ENV, "something-else")
    assert rec.runner.job == "expA-201"
    _, body = _post(rec.url, _payload(fingerprint="01", job="slurm-201"))
    assert body["results"][0]["outcome"] == "dropped"
    _, body = _post(rec.url, _payload(fingerprint="02", job="expA-201"))
    assert body["results"][0]["outcome"] == "skipped"
    assert 'run="expA-201"' in _metric(rec, "trainwatch_action_restart_guard_tripped")


def test_the_launcher_and_telemetry_keep_the_name_run_json_has(tmp_path, monkeypatch):
    from trainwatch.trainer.launcher import LaunchSpec
    from trainwatch.rank.telemetry import Telemetry
    run = RunDir(tmp_path / "slurm-202").create()
    monkeypatch.setenv(JOB_ENV, "expB-202")
    assert LaunchSpec(run.root, 1).job == "expB-202"  # no run.json: the environment's
    run.write_run_info({"job": "slurm-202"})
    assert LaunchSpec(run.root, 1).job == "slurm-202"
    assert Telemetry(run.root, enabled=False).job == "slurm-202"
