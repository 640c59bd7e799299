"""``trainwatch run``: the agent, the embedded alert engine and a training job, together.

The embedded default on one machine: no Prometheus, no Alertmanager.  It starts
``trainwatch agent`` on the run directory, evaluates the alert rules against the
agent's /metrics, runs ``trainwatch train`` under the job controller (restarts,
rollbacks and the no-progress guard as the rules say), shows a live view, and stops
everything cleanly on Ctrl-C or when training ends.  The journal tells the story.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Iterator

import click
from rich.console import Console, Group
from rich.live import Live
from rich.logging import RichHandler
from rich.table import Table
from rich.text import Text

from trainwatch.agent.config import load_config as load_agent_config
from trainwatch.alerts.actions import ActionRunner, Policy
from trainwatch.alerts.controller import JobController, train_command
from trainwatch.alerts.engine import Engine
from trainwatch.alerts.evaluate import History
from trainwatch.alerts.loop import EngineLoop, connect_actions
from trainwatch.alerts.notify import AlertmanagerNotifier, JournalNotifier, WebhookNotifier
from trainwatch.alerts.promql import parse_duration
from trainwatch.alerts.rules import load_rules
from trainwatch.alerts.scrape import Scraper
from trainwatch.alerts.silences import Silences
from trainwatch.alerts.supervise import Supervisor
from trainwatch.contract.layout import AGENT_LOG, JOB_LOG
from trainwatch.contract.ports import LOOPBACK
from trainwatch.contract.stall import RECORD_KEY as STALL_RECORD_KEY
from trainwatch.errors import ConfigError
from trainwatch.proctree import stop
from trainwatch.rundir import RunDir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(run: RunDir, port: int, config: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trainwatch", "agent", "--run-dir", str(run.root),
           "--listen", f"{LOOPBACK}:{port}"]
    if config:
        cmd += ["--config", str(config)]
    with open(run.logs_dir / AGENT_LOG, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def wait_for_agent(proc: subprocess.Popen, target: str, timeout: float = 60.0) -> bool:
    """Wait until the agent answers /healthz, so the engine's first scrapes are not
    failures; False (and a warning) if it died or is still not up after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://{target}/healthz", timeout=1):
                return True
        except OSError:
            time.sleep(0.2)
    click.echo(f"trainwatch agent on {target} is not up (see logs/agent.log): alerts that "
               "need its metrics are blind until it is", err=True)
    return False


@contextlib.contextmanager
def _logs_above(console: Console) -> Iterator[None]:
    """Log records printed above the live view, not through it (the root logger's
    handler writes to the real stderr, which would tear the view)."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [RichHandler(console=console, show_path=False)]
    try:
        yield
    finally:
        root.handlers = saved


def live_view(run: RunDir, engine: Engine, started: float) -> Group:
    """Steps, loss, throughput per rank; firing alerts; the last actions."""
    ranks = Table(title=f"trainwatch run · {run.root.name} · {time.time() - started:.0f}s",
                  expand=True)
    for col in ("rank", "state", "step", "phase", "loss", "tokens/s"):
        ranks.add_column(col)
    for s in run.statuses().records:
        m = s.get("metrics") or {}
        loss, tps = m.get("loss"), m.get("tokens_per_second")
        ranks.add_row(str(s.get("rank")), str(s.get("state")), str(m.get("step", s.get("step"))),
                      str(s.get("phase")),
                      f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
                      f"{tps:,.0f}" if isinstance(tps, (int, float)) else "-")
    alerts = Table(title="alerts", expand=True)
    for col in ("alert", "state", "severity", "summary"):
        alerts.add_column(col)
    for a in engine.alerts():
        if a.state != "inactive":
            alerts.add_row(a.name, a.state, a.rule.severity, a.annotations.get("summary", ""))
    actions = Text()
    for e in run.events("action_taken", "action_skipped", "job_started", "job_exited")[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(e.get("time", 0)))
        what = e.get("reason") or f"returncode {e.get('returncode')}"
        actions.append(f"{when} {e['event']}: {what}\n")
    return Group(ranks, alerts, actions)


@click.command("run")
@click.option("--nproc-per-node", type=int, required=True, help="Ranks on this machine.")
@click.option("--run-dir", required=True, type=click.Path(file_okay=False),
              help="Where the run keeps its state (status, metrics, journal, logs).")
@click.option("--steps", type=int, help="Override train.steps.")
@click.option("--config", type=click.Path(dir_okay=False),
              help="Trainer YAML config (see examples/trainer.yaml).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override one trainer config key, e.g. --set optim.lr=1e-3 (repeatable).")
@click.option("--max-restarts", type=int, default=1, show_default=True,
              help="torchrun's own restarts of failed ranks before the controller steps in.")
@click.option("--thresholds", "thresholds_file", type=click.Path(dir_okay=False),
              help="Alert threshold overrides.")
@click.option("--rules", "rules_file", type=click.Path(dir_okay=False), help="Rules file.")
@click.option("--agent-config", type=click.Path(dir_okay=False), help="Agent config file.")
@click.option("--webhook", multiple=True, help="Also POST alerts to this URL (repeatable).")
@click.option("--alertmanager", help="Also send alerts to this Alertmanager (base URL).")
@click.option("--dry-run", is_flag=True, help="Journal what actions would do; do nothing.")
@click.option("--no-live", is_flag=True,
              help="No live view (for logs and CI): only alerts and the outcome are printed.")
def run(nproc_per_node, run_dir, steps, config, overrides, max_restarts, thresholds_file,
        rules_file,
        agent_config, webhook, alertmanager, dry_run, no_live) -> None:
    """Train with the agent and the embedded alert engine watching (Ctrl-C stops all)."""
    ruleset = load_rules(rules_file, thresholds_file)  # bad rules: exit 2 before anything runs
    if nproc_per_node < 1:
        raise ConfigError(f"must be at least 1, got {nproc_per_node}", key="--nproc-per-node")
    # Validated here, or a bad file would make the agent die unseen; its stall options are
    # recorded with the run, so report and diagnose judge stalls as this agent did.
    stall = load_agent_config(agent_config, run_dirs=[run_dir]).stall
    run_ = RunDir(run_dir).create()
    interval = parse_duration(ruleset.thresholds["evaluation_interval"])
    history = History()
    notifiers = [JournalNotifier(str(run_.root))]
    notifiers += [WebhookNotifier(url) for url in webhook]
    if alertmanager:
        notifiers.append(AlertmanagerNotifier(alertmanager))
    silences = Silences(run_.silences_file)
    engine = Engine(ruleset, history, silences=silences, notifiers=notifiers)
    port = _free_port()
    agent_proc = start_agent(run_, port, agent_config)
    targets = [f"{LOOPBACK}:{port}"]
    loop = EngineLoop(engine, Scraper(history, targets), interval)
    controller = JobController(run_.root, train_command(run_.root, nproc_per_node, config=config,
                                                   steps=steps, overrides=list(overrides),
                                                   max_restarts=max_restarts))
    runner = ActionRunner(run_.root, controller,
                          Policy.from_thresholds(ruleset.thresholds, dry_run=dry_run),
                          silences=silences)
    connect_actions(engine, runner, loop)
    supervisor = Supervisor(controller, runner)
    run_.append_event("controller_started", "engine", nproc_per_node=nproc_per_node,
                      agent=targets, rules=len(ruleset.rules), dry_run=dry_run,
                      **{STALL_RECORD_KEY: stall})
    started = time.time()
    interrupted = False
    # SIGTERM stops everything as cleanly as Ctrl-C does (trainwatch.cli.main makes sure
    # SIGINT raises KeyboardInterrupt).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        controller.start("trainwatch run")
        wait_for_agent(agent_proc, targets[0])
        loop.start()
        supervisor.start()
        if no_live:
            while not supervisor.finished.wait(1.0):
                pass
        else:
            with Live(live_view(run_, engine, started), refresh_per_second=2) as live, \
                    _logs_above(live.console):
                while not supervisor.finished.wait(0.5):
                    live.update(live_view(run_, engine, started))
                live.update(live_view(run_, engine, started))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        supervisor.stop()
        loop.stop()
        loop.tick()  # a last evaluation, so what ended the run (e.g. the guard) is announced
        if controller.alive():
            controller.stop("interrupted" if interrupted else "controller stopped")
        stop(agent_proc)
        code = 130 if interrupted else (supervisor.exit_code or 0)
        run_.append_event("controller_stopped", "engine", exit_code=code,
                          interrupted=interrupted, seconds=round(time.time() - started, 3),
                          actions=len(run_.events("action_taken")))
    if code == 2:
        raise ConfigError("the training job rejected its input (exit 2); "
                          f"{_last_lines(run_.logs_dir / JOB_LOG)}")
    if code and code != 130:
        skipped = run_.events("action_skipped")
        why = f": {skipped[-1].get('reason')}" if skipped else ""
        click.echo(f"trainwatch run: the job failed and was not restarted{why}; see "
                   f"{run_.journal_file} and {run_.logs_dir}/", err=True)
    if code:
        sys.exit(code if code in (2, 130) else 1)


def _last_lines(path, n: int = 3) -> str:
    """The end of the job's log: the job's own error message, for `trainwatch run` to show."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"no {path}"
    return f"{path} ends with:\n  " + "\n  ".join(lines[-n:]) if lines else f"{path} is empty"

