"""``trainwatch alerts``: check, export, test and silence the rules; serve the webhook receiver."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import click

from trainwatch.alerts.promql import parse_duration
from trainwatch.clitypes import NPROC_PER_NODE, run_dir_option
from trainwatch.contract.env import RECEIVER_TOKEN_ENV
from trainwatch.contract.layout import ALERTS_DIR, SILENCES_FILE
from trainwatch.contract.ports import LOOPBACK, RECEIVER_LISTEN
from trainwatch.errors import EXIT_PROBLEM, ConfigError, output_error
from trainwatch.rundir import RunDir

_rules_opt = click.option("--rules", "rules_file", type=click.Path(dir_okay=False),
                          help="Rules file (default: the packaged alerts/rules.yaml).")
_thresholds_opt = click.option("--thresholds", "thresholds_file",
                               type=click.Path(dir_okay=False),
                               help="Threshold overrides (only the keys you change).")


def _load(rules_file, thresholds_file):
    from trainwatch.alerts.rules import load_rules
    return load_rules(rules_file, thresholds_file)


def _silences(run: RunDir | None, file: str | None):
    from trainwatch.alerts.silences import Silences
    if file:
        return Silences(file)
    if run is not None:
        if not run.root.is_dir():  # a typo must not write a silence nothing reads
            raise ConfigError("no such run directory (a silence there would mute nothing)",
                              file=str(run.root), key="--run-dir")
        return Silences(run.silences_file)
    raise ConfigError("give --run-dir DIR or --file FILE for the silences")


@click.group("alerts")
def alerts() -> None:
    """Alert rules (one source), the embedded engine and the webhook receiver."""


@alerts.command("check")
@_rules_opt
@_thresholds_opt
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def check(rules_file, thresholds_file, as_json) -> None:
    """Validate the rules and thresholds (exit 2 with file and line on a problem)."""
    ruleset = _load(rules_file, thresholds_file)
    if as_json:
        click.echo(json.dumps([{"alert": r.name, "severity": r.severity, "action": r.action,
                                "for_seconds": r.for_seconds, "expr": r.expr,
                                "metrics": sorted(r.metrics)} for r in ruleset.rules],
                              indent=2))
        return
    for rule in ruleset.rules:
        click.echo(f"{rule.name:28s} {rule.severity:8s} {rule.action or '-'}")
    click.echo(f"{len(ruleset.rules)} alerts OK")


@alerts.command("export")
@_rules_opt
@_thresholds_opt
@click.option("--format", "fmt", type=click.Choice(["prometheus", "prometheusrule"]),
              default="prometheus", show_default=True,
              help="Prometheus rule groups (a rule_files file) or a Kubernetes PrometheusRule.")
@click.option("--runbook-base", default=None,
              help="URL prefix for runbook_url (default: the project's runbooks folder).")
@click.option("--name", default="trainwatch", show_default=True,
              help="PrometheusRule metadata.name.")
@click.option("--namespace", default="monitoring", show_default=True,
              help="PrometheusRule metadata.namespace.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to a file.")
def export(rules_file, thresholds_file, fmt, runbook_base, name, namespace, output) -> None:
    """Print Prometheus rule groups or a Kubernetes PrometheusRule."""
    from trainwatch.alerts import export as ex
    from trainwatch.alerts.rules import DEFAULT_RUNBOOK_BASE
    ruleset = _load(rules_file, thresholds_file)
    base = runbook_base or DEFAULT_RUNBOOK_BASE
    text = (ex.prometheus_yaml(ruleset, base) if fmt == "prometheus"
            else ex.prometheusrule_yaml(ruleset, base, name, namespace))
    if output:
        try:
            Path(output).write_text(text)
        except OSError as exc:
            raise output_error(exc, output, key="--output") from None
    else:
        click.echo(text, nl=False)


@alerts.command("test")
@_rules_opt
@_thresholds_opt
@click.argument("test_file", type=click.Path(exists=True, dir_okay=False))
def test(rules_file, thresholds_file, test_file) -> None:
    """Replay a `promtool test rules` file through the embedded engine (exit 1 on mismatch)."""
    from trainwatch.alerts.replay import replay_file
    from trainwatch.alerts.rules import DEFAULT_RUNBOOK_BASE
    ruleset = _load(rules_file, thresholds_file)
    rows = replay_file(ruleset, test_file, runbook_base=DEFAULT_RUNBOOK_BASE)
    if not rows:
        raise ConfigError("no alert_rule_test checks to replay (promtool's `tests:` list, each "
                          "with `alert_rule_test:` entries)", file=test_file)
    failed = [r for r in rows if not r[3]]
    for name, chk, got, ok in rows:
        if not ok:
            click.echo(f"FAILED {name}: {chk.alertname} at {chk.eval_time:.0f}s: expected "
                       f"{[e.get('exp_labels') for e in chk.expected]}, got "
                       f"{[a.labels for a in got]}")
    click.echo(f"{len(rows) - len(failed)}/{len(rows)} checks passed")
    if failed:
        sys.exit(EXIT_PROBLEM)


@alerts.group("silence")
def silence() -> None:
    """Mute notifications and actions for matching alerts."""


_silence_file = [run_dir_option(f"Keep silences in RUN_DIR/{ALERTS_DIR}/{SILENCES_FILE}."),
                 click.option("--file", type=click.Path(dir_okay=False),
                              help="Keep silences in this file instead.")]


def _with_silence_file(fn):
    for opt in reversed(_silence_file):
        fn = opt(fn)
    return fn


@silence.command("add")
@_with_silence_file
@click.argument("matchers", nargs=-1, required=True)
@click.option("--duration", default="2h", show_default=True, help="How long (e.g. 30m, 2h).")
@click.option("--comment", default="", help="Why (shown in the journal and `list`).")
@click.option("--author", default="", help="Who.")
def silence_add(run, file, matchers, duration, comment, author) -> None:
    """Silence alerts matching label=value MATCHERS (e.g. alertname=TrainingStalled run=exp1)."""
    from trainwatch.alerts.silences import parse_matchers
    try:
        seconds = parse_duration(duration)
    except ValueError as exc:
        raise ConfigError(str(exc), key="--duration") from None
    s = _silences(run, file).add(parse_matchers(list(matchers)), seconds, comment, author)
    click.echo(f"silence {s.id} until {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s.ends_at))}")


@silence.command("list")
@_with_silence_file
@click.option("--all", "show_all", is_flag=True, help="Include expired silences.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def silence_list(run, file, show_all, as_json) -> None:
    """List active silences."""
    now = time.time()
    rows = [s for s in _silences(run, file).load() if show_all or s.active(now)]
    if as_json:
        click.echo(json.dumps([s.__dict__ for s in rows], indent=2))
        return
    if not rows:
        click.echo("no silences" if show_all else "no active silences")
    for s in rows:
        matchers = " ".join(f"{k}={v}" for k, v in s.matchers.items())
        state = "active" if s.active(now) else "expired"
        click.echo(f"{s.id}  {state:7s} {matchers}  until "
                   f"{time.strftime('%H:%M:%S', time.localtime(s.ends_at))}  {s.comment}")


@silence.command("expire")
@_with_silence_file
@click.argument("silence_id")
def silence_expire(run, file, silence_id) -> None:
    """End a silence now."""
    _silences(run, file).expire(silence_id)
    click.echo(f"silence {silence_id} expired")


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"'{text}' is not HOST:PORT", key="--listen")
    return host or LOOPBACK, int(port)


def _check_target(text: str) -> None:
    """A scrape target is HOST:PORT or an http(s) URL with a host, or ConfigError (exit 2
    before the engine starts: a bad one would only be retried and logged forever)."""
    parts = urlsplit(text if "://" in text else f"http://{text}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or \
            (port is None and "://" not in text):
        raise ConfigError(f"'{text}' is not HOST:PORT or an http(s) URL", key="--target")


def _job_command(run_dir, job_command, nproc_per_node, config, steps) -> list[str] | None:
    import shlex

    from trainwatch.alerts.controller import train_command
    if job_command and nproc_per_node:
        raise ConfigError("give either --job-command or --nproc-per-node, not both")
    if job_command:
        return shlex.split(job_command)
    if nproc_per_node:
        return train_command(run_dir, nproc_per_node, config=config, steps=steps)
    return None


@alerts.command("receive")
@_rules_opt
@_thresholds_opt
@run_dir_option("The run directory whose job this receiver acts on.", required=True)
@click.option("--listen", default=RECEIVER_LISTEN, show_default=True, metavar="HOST:PORT",
              help="Where to serve the webhook (loopback unless you say otherwise).")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help=f"File holding the bearer token (default: ${RECEIVER_TOKEN_ENV}).")
@click.option("--nproc-per-node", type=NPROC_PER_NODE, help="Also run and supervise `trainwatch train`.")
@click.option("--config", type=click.Path(dir_okay=False), help="Trainer config file.")
@click.option("--steps", type=int, help="Override train.steps.")
@click.option("--job-command",
              help="Supervise this command (quoted, e.g. 'torchrun --nproc-per-node 4 "
                   "train.py') instead of `trainwatch train`: the same as `trainwatch run -- "
                   "COMMAND` (docs/own-trainer.md).")
@click.option("--straggler-command",
              help="Scheduler adapter run for stragglers, e.g. 'scontrol requeue {slurm_job_id}'.")
@click.option("--dry-run", is_flag=True, help="Journal what would be done; do nothing.")
def receive(rules_file, thresholds_file, run, listen, token_file, nproc_per_node, config,
            steps, job_command, straggler_command, dry_run) -> None:
    """Serve Alertmanager's webhook (POST /webhook) and run trainwatch's automatic actions."""
    from trainwatch.alerts.actions import ActionRunner, Policy
    from trainwatch.alerts.command import supervised_job
    from trainwatch.alerts.controller import JobController
    from trainwatch.alerts.receiver import Receiver, load_token
    from trainwatch.alerts.silences import Silences
    from trainwatch.alerts.supervise import Supervisor
    from trainwatch.runlock import hold
    ruleset = _load(rules_file, thresholds_file)
    token = load_token(token_file)
    host, port = _listen(listen)
    run_dir = str(run.root)
    command = _job_command(run_dir, job_command, nproc_per_node, config, steps)
    controller: JobController | None = None
    # Acting as the job's supervisor: the run's one supervisor (trainwatch.runlock).
    lock = hold(run, "trainwatch alerts receive") if command else None
    if job_command and command is not None:  # the same supervision as `trainwatch run -- COMMAND`
        controller = supervised_job(run_dir, command, "trainwatch alerts receive")
    elif command:
        controller = JobController(run_dir, command)
    policy = Policy.from_thresholds(ruleset.thresholds, dry_run=dry_run,
                                    straggler_command=straggler_command)
    runner = ActionRunner(run_dir, controller, policy,
                          silences=Silences(run.silences_file))
    receiver = Receiver(ruleset, runner, token, host, port).start()
    click.echo(f"receiving Alertmanager webhooks on {receiver.url}/webhook "
               f"(job {runner.job}{', dry run' if dry_run else ''})")
    supervisor = None
    # SIGTERM (systemctl stop, a pod's end) stops the job it started as Ctrl-C does, never
    # leaving it orphaned.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if controller is not None:
        controller.start()
        supervisor = Supervisor(controller, runner).start()
    try:
        while supervisor is None or not supervisor.finished.wait(1.0):
            if supervisor is None:
                time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        receiver.stop()
        if supervisor is not None:
            supervisor.stop()
        if controller is not None:
            controller.close("receiver stopped")
        if lock is not None:
            lock.release()
    if supervisor is not None and supervisor.exit_code:
        sys.exit(EXIT_PROBLEM)


@alerts.command("watch")
@_rules_opt
@_thresholds_opt
@click.option("--target", "targets", multiple=True, required=True, metavar="HOST:PORT",
              help="An agent's HOST:PORT to scrape (repeatable).")
@run_dir_option("Journal alerts and read silences here.")
@click.option("--webhook", multiple=True, help="POST alerts to this URL (repeatable).")
@click.option("--webhook-token-file", type=click.Path(dir_okay=False),
              help="Bearer token for the webhooks.")
@click.option("--alertmanager", help="Send alerts to this Alertmanager (base URL).")
def watch(rules_file, thresholds_file, targets, run, webhook, webhook_token_file,
          alertmanager) -> None:
    """Run the embedded engine against agents' /metrics (no Prometheus); Ctrl-C stops."""
    from trainwatch.alerts.engine import Engine, Notifier
    from trainwatch.alerts.evaluate import History
    from trainwatch.alerts.loop import EngineLoop
    from trainwatch.alerts.notify import AlertmanagerNotifier, JournalNotifier, WebhookNotifier
    from trainwatch.alerts.receiver import load_token
    from trainwatch.alerts.scrape import Scraper
    from trainwatch.alerts.silences import Silences
    ruleset = _load(rules_file, thresholds_file)
    for target in targets:
        _check_target(target)
    token = load_token(webhook_token_file) if webhook_token_file else None
    history = History()
    notifiers: list[Notifier] = [JournalNotifier(str(run.root) if run else None)]
    notifiers += [WebhookNotifier(u, token) for u in webhook]
    if alertmanager:
        notifiers.append(AlertmanagerNotifier(alertmanager))
    silences = Silences(run.silences_file) if run else None
    engine = Engine(ruleset, history, silences=silences, notifiers=notifiers)
    loop = EngineLoop(engine, Scraper(history, list(targets)),
                      parse_duration(ruleset.thresholds["evaluation_interval"]))
    click.echo(f"evaluating {len(ruleset.rules)} rules against {', '.join(targets)}")
    loop.start()
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        loop.stop()
