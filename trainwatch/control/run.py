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
import re
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Callable, Iterator

import click
from rich.console import Console
from rich.live import Live
from rich.logging import RichHandler

from trainwatch.agent.config import load_config as load_agent_config
from trainwatch.control.actions import ActionRunner, Policy
from trainwatch.control.command import (TELEMETRY_GRACE_SECONDS, TelemetryWatch, resolve,
                                       supervised_job)
from trainwatch.control.controller import JobController, train_command
from trainwatch.alerts.engine import Engine, Notifier
from trainwatch.alerts.evaluate import History
from trainwatch.alerts.loop import EngineLoop
from trainwatch.control.dispatch import connect_actions
from trainwatch.alerts.notify import AlertmanagerNotifier, JournalNotifier, WebhookNotifier
from trainwatch.alerts.promql import parse_duration
from trainwatch.alerts.rules import load_rules
from trainwatch.control.run_checks import check_launch, check_run_dir, refuse_rehearsal_dir
from trainwatch.control.run_summary import (ALREADY_COMPLETE, ended_nonfinite,
                                            render as render_summary, summarize,
                                            unsaved_end)
from trainwatch.control.run_view import Progress, live_view
from trainwatch.alerts.scrape import Scraper
from trainwatch.alerts.silences import Silences
from trainwatch.control.supervise import Supervisor
from trainwatch.config.clitypes import MAX_RESTARTS, NPROC_PER_NODE, run_dir_option, seconds
from trainwatch.contract.layout import AGENT_LOG, JOB_LOG, LOGS_DIR
from trainwatch.contract.ports import LOOPBACK
from trainwatch.contract.stall import RECORD_KEY as STALL_RECORD_KEY
from trainwatch.errors import (EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, ConfigError,
                               FormatError)
from trainwatch.process.proctree import spawn, stop
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import read_run_file_tail
from trainwatch.rundir.runlock import hold
from trainwatch.process.stopsignals import stop_on_sigterm, stopping

# The end of the job's log a refusal or a failed launch quotes: its last lines, never the
# whole log of a job that printed gigabytes.
JOB_LOG_TAIL_BYTES = 64 * 1024


def _free_port(port: int = 0) -> int:
    """``port`` on loopback if it is free (exit 2 if not), else any free one."""
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {LOOPBACK}:{port}: {exc.strerror or exc}",
                              key="--agent-port") from None
        return s.getsockname()[1]


def start_agent(run: RunDir, port: int, config: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trainwatch", "agent", "--run-dir", str(run.root),
           "--listen", f"{LOOPBACK}:{port}"]
    if config:
        cmd += ["--config", str(config)]
    with open(run.logs_dir / AGENT_LOG, "ab") as log:
        return spawn(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                     start_new_session=True)


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
    click.echo(f"trainwatch agent on {target} is not up (see {LOGS_DIR}/{AGENT_LOG}): alerts that "
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


class _RunCommand(click.Command):
    """``trainwatch run [RUN_DIR] [OPTIONS] [-- COMMAND...]``: what follows ``--`` is the
    user's own job, untouched; before it, options and at most one RUN_DIR in any order."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        split = args.index("--") if "--" in args else len(args)
        command = args[split + 1:]
        rest = super().parse_args(ctx, args[:split])
        before = ctx.params.pop("positional", ())
        if len(before) > 1:
            raise click.UsageError(f"one RUN_DIR before --, got {' '.join(before)}; your own "
                                   "job goes after --: trainwatch run RUN_DIR -- COMMAND ...",
                                   ctx)
        ctx.params["run_dir_arg"] = before[0] if before else None
        ctx.params["command"] = tuple(command)
        return rest

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[-- COMMAND [ARGS]...]"]


@click.command("run", cls=_RunCommand)
@click.option("--nproc-per-node", type=NPROC_PER_NODE,
              help="Ranks on this machine (the reference trainer; not with a COMMAND).")
@run_dir_option("Where the run keeps its state (status, metrics, journal, logs); or give it "
                "as RUN_DIR.", own_argument=True, required=True)
@click.option("--steps", type=click.IntRange(min=1), help="Override train.steps.")
@click.option("--config", type=click.Path(dir_okay=False),
              help="Trainer YAML config (see examples/trainer.yaml).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override one trainer config key, e.g. --set optim.lr=1e-3 (repeatable).")
@click.option("--max-restarts", type=int,
              help="torchrun's own restarts of failed ranks before the controller steps in "
                   f"(reference trainer; default {MAX_RESTARTS}). With a COMMAND, give "
                   "torchrun's own flag.")
@click.option("--thresholds", "thresholds_file", type=click.Path(dir_okay=False),
              help="Alert threshold overrides.")
@click.option("--rules", "rules_file", type=click.Path(dir_okay=False), help="Rules file.")
@click.option("--agent-config", type=click.Path(dir_okay=False), help="Agent config file.")
@click.option("--webhook", multiple=True, help="Also POST alerts to this URL (repeatable).")
@click.option("--alertmanager", help="Also send alerts to this Alertmanager (base URL).")
@click.option("--dry-run", is_flag=True, help="Journal what actions would do; do nothing.")
@click.option("--no-live", is_flag=True,
              help="No live view (for logs and CI): only alerts and the outcome are printed.")
@click.option("--telemetry-grace", type=seconds(), default=TELEMETRY_GRACE_SECONDS,
              show_default=True, metavar="SECONDS",
              help="With a COMMAND: say so when no rank has published telemetry this long "
                   "after a start.")
@click.option("--agent-port", type=click.IntRange(1, 65535), metavar="PORT",
              help="The agent's port on loopback, for a Prometheus or a dashboard pointed at "
                   "it (default: a free port, printed at the start).")
@click.argument("positional", nargs=-1, metavar="[RUN_DIR]")
def run(nproc_per_node, run, steps, config, overrides, max_restarts, thresholds_file,
        rules_file, agent_config, webhook, alertmanager, dry_run, no_live, telemetry_grace,
        agent_port, command) -> None:
    """Train with the agent and the embedded alert engine watching (Ctrl-C stops all).

    \b
    trainwatch run runs/exp1 --nproc-per-node 4                  the reference trainer
    trainwatch run runs/exp1 -- COMMAND [ARGS...]                your own job, e.g.
        trainwatch run runs/exp1 -- torchrun --nproc-per-node 4 train.py
    (--run-dir runs/exp1 instead of RUN_DIR works too.)

    A COMMAND gets $TRAINWATCH_RUN_DIR and is restarted, rolled back and stopped like the
    reference trainer; what it must do for that is in docs/own-trainer.md.
    """
    # Everything is checked before anything starts or the run directory is touched; then
    # the run's lock (one supervisor per run directory; what a killed one left is stopped).
    run_dir = str(run.root)
    refuse_rehearsal_dir(run_dir)
    port = _free_port(agent_port or 0)
    ruleset = load_rules(rules_file, thresholds_file)
    console = Console()
    if not console.is_terminal:  # logs and pipes: lines long enough not to break commands
        console = Console(width=120)
    if command:
        plan = None
        agent_stall = check_command(
            run_dir, list(command), nproc_per_node=nproc_per_node, steps=steps, config=config,
            overrides=overrides, max_restarts=max_restarts, agent_config=agent_config)
        lock = hold(run, "trainwatch run")
        controller = supervised_job(run_dir, list(command), "trainwatch run")
    else:
        if nproc_per_node is None:
            raise ConfigError("give --nproc-per-node (the reference trainer) or -- COMMAND "
                              "(your own job)", key="--nproc-per-node")
        plan = check_launch(run_dir, nproc_per_node=nproc_per_node, config=config,
                            overrides=list(overrides), steps=steps, agent_config=agent_config)
        if plan.already_complete:
            console.print(ALREADY_COMPLETE, highlight=False)
            render_summary(summarize(run_dir, "already complete", plan.target_steps), console)
            return
        lock = hold(run, "trainwatch run")
        controller = JobController(run_dir, train_command(
            run_dir, nproc_per_node, config=config, steps=steps, overrides=list(overrides),
            max_restarts=MAX_RESTARTS if max_restarts is None else max_restarts))
        agent_stall = plan.agent_stall
    target_steps = plan.target_steps if plan is not None else None
    run_ = controller.run
    interval = parse_duration(ruleset.thresholds["evaluation_interval"])
    history = History()
    notifiers: list[Notifier] = [JournalNotifier(str(run_.root))]
    notifiers += [WebhookNotifier(url) for url in webhook]
    if alertmanager:
        notifiers.append(AlertmanagerNotifier(alertmanager))
    silences = Silences(run_.silences_file)
    engine = Engine(ruleset, history, silences=silences, notifiers=notifiers)
    agent_proc = start_agent(run_, port, agent_config)
    targets = [f"{LOOPBACK}:{port}"]
    agent_url = f"http://{targets[0]}"
    loop = EngineLoop(engine, Scraper(history, targets), interval)
    runner = ActionRunner(run_.root, controller,
                          Policy.from_thresholds(ruleset.thresholds, dry_run=dry_run),
                          silences=silences)
    connect_actions(engine, runner, loop)
    supervisor = Supervisor(controller, runner)
    watch = (TelemetryWatch(controller, lambda text: click.echo(text, err=True),
                            grace=telemetry_grace) if command else None)
    controller.journal("controller_started", nproc_per_node=nproc_per_node,
                       command=list(command) or None, agent=targets, rules=len(ruleset.rules),
                       dry_run=dry_run, **{STALL_RECORD_KEY: agent_stall})
    started = time.time()
    interrupted = False
    progress = Progress(target_steps)
    job_log_start = _size(run_.logs_dir / JOB_LOG)
    stop_on_sigterm()  # stops everything as cleanly as Ctrl-C does
    try:
        controller.start("trainwatch run")
        what = (f"starting {' '.join(command)}" if command
                else f"starting {nproc_per_node} rank(s) under torchrun")
        click.echo(f"trainwatch run: {run_.root}: {what}; agent {agent_url}")
        wait_for_agent(agent_proc, targets[0])
        loop.start()
        supervisor.start()
        if watch is not None:
            watch.start()
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
        click.echo("trainwatch run: stopping the job (SIGTERM, time to save a checkpoint; "
                   f"SIGKILL after {controller.stop_grace:.0f} s) and the agent; another "
                   "Ctrl-C does not cut that short", err=True)
    finally:
        stopping()
        _shut_down(controller, [
            ("the telemetry watch", watch.stop if watch is not None else lambda: None),
            ("the supervisor", supervisor.stop), ("the engine", loop.stop),
            # a last evaluation, so what ended the run (e.g. the guard) is announced
            ("the last evaluation", loop.tick),
            ("the job", lambda: controller.close("interrupted" if interrupted
                                                 else "controller stopped")),
            ("the agent", lambda: stop(agent_proc))])
        code = EXIT_INTERRUPTED if interrupted else (supervisor.exit_code or EXIT_OK)
        # Finished with NaN weights, or with its training on no disk (the last save failed),
        # is not finished: CI must not pass it (exit 1, said why).
        nonfinite = ended_nonfinite(run_) if code == EXIT_OK else None
        unsaved = unsaved_end(run_) if code == EXIT_OK and not nonfinite else None
        if nonfinite or unsaved:
            code = EXIT_PROBLEM
        # A job that died of trainwatch's own ConfigError before any rank published (a
        # framework callback's misspelt keyword) rejected its input, as a rank that says so.
        refused = _refused_at_launch(run_, job_log_start) if supervisor.launch_failed else None
        if refused:
            code = EXIT_USAGE
        controller.journal("controller_stopped", exit_code=code, interrupted=interrupted,
                           seconds=round(time.time() - started, 3),
                           actions=len(run_.events("action_taken")))
        if controller.unrecorded:
            click.echo("trainwatch run: could not record (is the disk full?): "
                       + "; ".join(controller.unrecorded[-10:]), err=True)
        lock.release()
    if code == EXIT_USAGE:
        raise ConfigError("the training job rejected its input (exit 2): "
                          + (supervisor.rejected_input or refused
                             or _new_lines(run_, job_log_start)))
    outcome = "interrupted" if interrupted else "failed" if code else "finished"
    render_summary(summarize(run_.root, outcome, target_steps), console)
    if nonfinite:
        click.echo(f"trainwatch run: training ended with {nonfinite}: the model "
                   "diverged or was poisoned and nothing rolled it back (a rollback acts only "
                   f"while the job runs); see {run_.journal_file}", err=True)
    elif unsaved:
        click.echo(f"trainwatch run: the job ended, but {unsaved}: what it trained since is "
                   f"not saved (is the disk full?); see {run_.journal_file}", err=True)
    elif supervisor.launch_failed:
        first = _first_error(run_, job_log_start)
        click.echo("trainwatch run: the job failed before any rank started (not restarted: "
                   "it would fail the same way)" + (f": {first}" if first else "")
                   + "; the end of its log:" + _new_lines(run_, job_log_start, n=20), err=True)
    elif code and code != EXIT_INTERRUPTED:
        skipped = run_.events("action_skipped")
        why = (f": {supervisor.not_restarted}" if supervisor.not_restarted
               else f": {skipped[-1].get('reason')}" if skipped else "")
        click.echo(f"trainwatch run: the job failed and was not restarted{why}; see "
                   f"{run_.journal_file} and {run_.logs_dir}/", err=True)
    if code:
        sys.exit(code if code in (EXIT_USAGE, EXIT_INTERRUPTED) else EXIT_PROBLEM)


def _shut_down(controller: JobController, steps: list[tuple[str, Callable[[], object]]]) -> None:
    """Every step of the shutdown, whatever one raises (a full disk under the journal):
    everything the run started stops; what failed is listed with what was not recorded."""
    for what, step in steps:
        try:
            step()
        except Exception as exc:  # the steps after it must still run
            controller.unrecorded.append(f"stopping {what}: {exc}")


def check_command(run_dir, command, *, nproc_per_node, steps, config, overrides,
                  max_restarts, agent_config) -> dict:
    """The checks of a ``-- COMMAND`` launch (the trainer's options do not apply); the
    agent's stall options. ConfigError (exit 2) before anything starts."""
    given = [name for name, value in (("--nproc-per-node", nproc_per_node), ("--steps", steps),
                                      ("--config", config), ("--set", overrides),
                                      ("--max-restarts", max_restarts)) if value]
    if given:
        verb = "configures" if len(given) == 1 else "configure"
        raise ConfigError(f"{', '.join(given)} {verb} the reference trainer; with a COMMAND "
                          "put your job's own options in the command", key=given[0])
    check_run_dir(run_dir)
    resolve(command)
    agent = load_agent_config(agent_config, run_dirs=[str(run_dir)])  # else it dies unseen
    return agent.stall


def _progress_lines(run: RunDir, supervisor: Supervisor, progress: Progress,
                    every: float = 10.0) -> None:
    """Without the live view: a progress line every ``every`` seconds."""
    while not supervisor.finished.wait(every):
        since = supervisor.controller.started_at
        click.echo(f"trainwatch run: {progress.update(run, since=since).line()}")


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# A line that says why a launch failed (a missing script, an import error, a bad option),
# not the launcher's failure table (its "error_file:" field) that follows it.
_CONFIG_ERROR_LINE = f"{ConfigError.__module__}.{ConfigError.__qualname__}: "  # a traceback's end
_WHY_LINE = re.compile(r"can't open file|No such file|not found|\b\w*Error\b:?|error:", re.I)


def _launch_log(run: RunDir, offset: int) -> str | None:
    """The end of what the job wrote to its log in this launch (the log is kept across
    launches), by the safe reader and at most JOB_LOG_TAIL_BYTES of it."""
    try:
        return read_run_file_tail(run.logs_dir / JOB_LOG, run.root, max_bytes=JOB_LOG_TAIL_BYTES,
                                  start=offset).decode(errors="replace")
    except (OSError, FormatError):
        return None


def _first_error(run: RunDir, offset: int) -> str | None:
    """The first line of this launch's log that says why it failed, else None."""
    text = _launch_log(run, offset) or ""
    return next((ln.strip()[:300] for ln in text.splitlines()
                 if _WHY_LINE.search(ln) and "error_file" not in ln
                 and not ln.lstrip().startswith(("File ", "Traceback"))), None)


def _refused_at_launch(run: RunDir, offset: int) -> str | None:
    """What trainwatch's ConfigError said, if the launch's log ends a traceback with one."""
    text = _launch_log(run, offset) or ""
    return next((ln.split(_CONFIG_ERROR_LINE, 1)[1].strip()[:300]
                 for ln in text.splitlines() if _CONFIG_ERROR_LINE in ln), None)


def _new_lines(run: RunDir, offset: int, n: int = 5) -> str:
    """The last ``n`` lines of this launch's log, indented (or why there are none)."""
    path = run.logs_dir / JOB_LOG
    text = _launch_log(run, offset)
    if text is None:
        return f"no {path}"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return f"nothing in {path}"
    return "\n  " + "\n  ".join(lines[-n:])
