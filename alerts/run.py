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
from rich.console import Console
from rich.live import Live
from rich.logging import RichHandler

from trainwatch.alerts.actions import ActionRunner, Policy
from trainwatch.alerts.controller import JobController, train_command
from trainwatch.alerts.engine import Engine
from trainwatch.alerts.evaluate import History
from trainwatch.alerts.loop import EngineLoop, connect_actions
from trainwatch.alerts.notify import AlertmanagerNotifier, JournalNotifier, WebhookNotifier
from trainwatch.alerts.promql import parse_duration
from trainwatch.alerts.rules import load_rules
from trainwatch.alerts.run_checks import check_launch
from trainwatch.alerts.run_summary import ALREADY_COMPLETE, render as render_summary, summarize
from trainwatch.alerts.run_view import Progress, live_view
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
        s.bind((LOOPBACK, 0))
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


@click.command("run")
@click.option("--nproc-per-node", type=int, required=True, help="Ranks on this machine.")
@click.option("--run-dir", required=True, type=click.Path(file_okay=False),
              help="Where the run keeps its state (status, metrics, journal, logs).")
@click.option("--steps", type=click.IntRange(min=1), help="Override train.steps.")
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
    # Everything is checked before anything starts or the run directory is touched.
    ruleset = load_rules(rules_file, thresholds_file)
    plan = check_launch(run_dir, nproc_per_node=nproc_per_node, config=config,
                        overrides=list(overrides), steps=steps,
                        agent_config=agent_config)
    console = Console()
    if plan.already_complete:
        console.print(ALREADY_COMPLETE, highlight=False)
        render_summary(summarize(run_dir, "already complete", plan.target_steps), console)
        return
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
    agent_url = f"http://{targets[0]}"
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
                      **{STALL_RECORD_KEY: plan.agent_stall})
    started = time.time()
    interrupted = False
    progress = Progress(plan.target_steps)
    job_log_start = _size(run_.logs_dir / JOB_LOG)
    # SIGTERM stops everything as cleanly as Ctrl-C does (trainwatch.cli.main makes sure
    # SIGINT raises KeyboardInterrupt).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        controller.start("trainwatch run")
        click.echo(f"trainwatch run: {run_.root}: starting {nproc_per_node} rank(s) under "
                   f"torchrun; agent {agent_url}")
        wait_for_agent(agent_proc, targets[0])
        loop.start()
        supervisor.start()
        if no_live:
            _progress_lines(run_, supervisor, progress)
        else:
            view = lambda: live_view(run_, engine, progress.update(run_), started, agent_url)  # noqa: E731
            with Live(view(), refresh_per_second=2, console=console) as live, \
                    _logs_above(live.console):
                while not supervisor.finished.wait(0.5):
                    live.update(view())
                live.update(view())
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
        raise ConfigError("the training job rejected its input (exit 2): "
                          + _new_lines(run_.logs_dir / JOB_LOG, job_log_start))
    outcome = "interrupted" if interrupted else "failed" if code else "finished"
    render_summary(summarize(run_.root, outcome, plan.target_steps), console)
    if code and code != 130:
        skipped = run_.events("action_skipped")
        why = f": {skipped[-1].get('reason')}" if skipped else ""
        click.echo(f"trainwatch run: the job failed and was not restarted{why}; see "
                   f"{run_.journal_file} and {run_.logs_dir}/", err=True)
    if code:
        sys.exit(code if code in (2, 130) else 1)


def _progress_lines(run: RunDir, supervisor: Supervisor, progress: Progress,
                    every: float = 10.0) -> None:
    """Without the live view: a progress line every ``every`` seconds."""
    while not supervisor.finished.wait(every):
        click.echo(f"trainwatch run: {progress.update(run).line()}")


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _new_lines(path, offset: int, n: int = 5) -> str:
    """What the job wrote to its log in this launch (the log is kept across launches)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return f"no {path}"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return f"nothing in {path}"
    return "\n  " + "\n  ".join(lines[-n:])
