"""The pager the agent of ``trainwatch run`` carries: the alerts about the supervisor are
the agent's to send (a frozen or dead supervisor's engine sends nothing), and a dead
supervisor is paged at once, from what the agent sees of it. The frozen case, end to end,
is tests/control/test_supervisor_watched_e2e.py."""

from __future__ import annotations

import os
import signal

from agent_helpers import start_supervisor, wait_for
from trainwatch.alerts.rules import load_rules
from trainwatch.alerts.silences import Silences
from trainwatch.control.supervisor_pager import SupervisorPager, agent_rules, supervisor_rules
from trainwatch.node import node_name
from trainwatch.rundir.run_dir import RunDir


def test_the_supervisors_engine_leaves_the_agent_the_rules_about_itself():
    rules = load_rules()
    mine = {r.name for r in agent_rules(rules).rules}
    theirs = {r.name for r in supervisor_rules(rules).rules}
    assert mine == {"TrainwatchSupervisorDown"}
    assert not mine & theirs and mine | theirs == {r.name for r in rules.rules}


def _pages(run: RunDir) -> list[dict]:
    return [e for e in run.events("alert_firing") if e["alert"] == "TrainwatchSupervisorDown"]


def test_a_dead_supervisor_is_paged_at_once_a_live_or_silenced_one_is_not(tmp_path):
    run = RunDir(tmp_path / "run").create()
    run.write_run_info({"job": "exp1"})
    pager = SupervisorPager(run, load_rules(), "127.0.0.1:1", node_name())
    proc = start_supervisor(run)
    try:
        assert pager.page_dead() is False and not _pages(run)  # alive: nothing to page
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        silence = Silences(run.silences_file).add({"alertname": "TrainwatchSupervisorDown"},
                                                  3600, "on it")
        assert pager.page_dead() is False and not _pages(run)  # silenced
        Silences(run.silences_file).expire(silence.id)
        assert pager.page_dead() is True
    finally:
        proc.kill()
        proc.wait(10)
    page = wait_for(lambda: _pages(run), 5, what="the page in the journal")[0]
    assert page["severity"] == "critical"
    assert page["labels"]["run"] == "exp1" and page["labels"]["node"] == node_name()
    assert page["summary"] == f"The supervisor of job exp1 on {node_name()} is down."
