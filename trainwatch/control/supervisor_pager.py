"""The agent ``trainwatch run`` starts, with the page about its supervisor that the
supervisor cannot send.

The embedded engine lives in the supervisor: frozen (SIGSTOP, Ctrl-Z) or dead, it pages
about nothing, itself included, and with no Prometheus nothing else would. The agent
``trainwatch run`` starts is a process of its own, in a session of its own, so a frozen
supervisor leaves it running: this module runs that agent with an engine of its own beside
it, for the rules about the supervisor (``PAGED_BY_AGENT``: TrainwatchSupervisorDown, the
same rule and ``for`` Prometheus evaluates) on the agent's own /metrics, sending where the
supervisor sends its alerts (the run's journal, ``--webhook``, ``--alertmanager``), the
run's silences honoured. The supervisor's engine leaves those rules out: one path each.

A supervisor that dies takes its agent with it (``PR_SET_PDEATHSIG``, so nothing it
started outlives it): the agent's last act is then the page, ``dead``, sent at once (a
death is no single ambiguous signal: its process is gone and its lock record names it
still), before it stops. Started as ``python -m trainwatch.control.supervisor_pager``
by ``control/embedded_agent.py``.
"""

from __future__ import annotations

import logging
import os
import time

import click

from trainwatch.agent.collectors.supervisor import DEAD, judge
from trainwatch.agent.config import load_config
from trainwatch.agent.daemon import Agent
from trainwatch.alerts.engine import Alert, Engine, Notifier
from trainwatch.alerts.evaluate import History
from trainwatch.alerts.loop import EngineLoop
from trainwatch.alerts.notify import AlertmanagerNotifier, JournalNotifier, WebhookNotifier
from trainwatch.alerts.promql import parse_duration
from trainwatch.alerts.rules import RuleSet, load_rules, render_template
from trainwatch.alerts.scrape import Scraper
from trainwatch.alerts.silences import Silences
from trainwatch.config.clitypes import RUN_DIR_PATH
from trainwatch.contract.alerts import PAGED_BY_AGENT
from trainwatch.rundir.run_dir import RunDir

log = logging.getLogger("trainwatch.control.supervisor_pager")  # also when run as __main__


def agent_rules(ruleset: RuleSet) -> RuleSet:
    """The rules about the supervisor, which its agent sends."""
    return RuleSet([r for r in ruleset.rules if r.name in PAGED_BY_AGENT],
                   ruleset.thresholds, ruleset.files)


def supervisor_rules(ruleset: RuleSet) -> RuleSet:
    """Every other rule: the supervisor's own engine."""
    return RuleSet([r for r in ruleset.rules if r.name not in PAGED_BY_AGENT],
                   ruleset.thresholds, ruleset.files)


class SupervisorPager:
    """An engine on the agent's own /metrics for ``PAGED_BY_AGENT``, and the page of a
    dead supervisor when the agent is stopped by that death."""

    def __init__(self, run: RunDir, ruleset: RuleSet, target: str, node: str, *,
                 webhooks: tuple[str, ...] = (), alertmanager: str | None = None):
        self.run, self.node = run, node
        notifiers: list[Notifier] = [JournalNotifier(run)]
        notifiers += [WebhookNotifier(url) for url in webhooks]
        if alertmanager:
            notifiers.append(AlertmanagerNotifier(alertmanager))
        rules = agent_rules(ruleset)
        history = History()
        self.engine = Engine(rules, history, silences=Silences(run.silences_file),
                             notifiers=notifiers)
        self.scraper = Scraper(history, [target])
        self.loop = EngineLoop(self.engine, self.scraper,
                               parse_duration(rules.thresholds["evaluation_interval"]))
        self.parent = os.getppid()  # the supervisor that started this agent

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        """Stop the engine; if the supervisor died (what stopped us), page that now."""
        self.loop.stop()
        if os.getppid() != self.parent:
            self.page_dead()

    def page_dead(self, t: float | None = None) -> bool:
        """Send TrainwatchSupervisorDown at once for a supervisor found dead (True if sent)."""
        rule = self.engine.ruleset.get("TrainwatchSupervisorDown")
        verdict = judge(self.run, self.node)
        if rule is None or verdict is None or verdict["state"] != DEAD:
            return False
        t = time.time() if t is None else t
        labels = {"job": self.scraper.job, "instance": self.scraper.targets[0].split("://")[-1],
                  "run": self.run.run_name(), "node": self.node,
                  "alertname": rule.name, "severity": rule.severity}
        alert = Alert(rule, labels, {
            "summary": render_template(rule.summary, labels, 0.0),
            "description": render_template(rule.description, labels, 0.0)},
            0.0, active_at=t, state="firing", fired_at=t)
        if self.engine.is_silenced(alert, t):
            log.warning("the supervisor of %s is dead (%s); its page is silenced",
                        self.run.root, verdict["holder"])
            return False
        log.warning("the supervisor of %s is dead (%s): paging %s", self.run.root,
                    verdict["holder"], rule.name)
        for notifier in self.engine.notifiers:
            try:
                notifier.notify("firing", alert, t)
            except Exception as exc:  # the next notifier still gets it
                log.warning("notifier %s failed: %s", type(notifier).__name__, exc)
        return True


@click.command()
@click.option("--run-dir", "run", type=RUN_DIR_PATH, required=True)
@click.option("--listen", required=True)
@click.option("--config", "config_file", type=click.Path(dir_okay=False))
@click.option("--rules", "rules_file", type=click.Path(dir_okay=False))
@click.option("--thresholds", "thresholds_file", type=click.Path(dir_okay=False))
@click.option("--webhook", multiple=True)
@click.option("--alertmanager")
def main(run, listen, config_file, rules_file, thresholds_file, webhook, alertmanager) -> None:
    """The agent of ``trainwatch run`` on RUN_DIR, with the supervisor's pager."""
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    reload_args = {"run_dirs": (run,), "discover": (), "listen": listen}
    agent = Agent(load_config(config_file, **reload_args), reload_args=reload_args,
                  say=click.echo)
    pager = SupervisorPager(RunDir(run), load_rules(rules_file, thresholds_file), listen,
                            agent.ctx.node, webhooks=webhook, alertmanager=alertmanager)
    agent.run_forever(started=pager.start, stopping=pager.stop)


if __name__ == "__main__":
    main()
