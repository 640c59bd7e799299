"""``trainwatch alerts``: check, export, test and silence the rules; serve the webhook receiver."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import click

from trainwatch.alerts.promql import parse_duration
from trainwatch.config.clitypes import run_dir_option
from trainwatch.contract.env import RECEIVER_TOKEN_ENV
from trainwatch.contract.layout import ALERTS_DIR, SILENCES_FILE
from trainwatch.config.yamlfile import read_secret
from trainwatch.errors import EXIT_PROBLEM, ConfigError, output_error
from trainwatch.rundir.run_dir import RunDir

rules_option = click.option("--rules", "rules_file", type=click.Path(dir_okay=False),
                          help="Rules file (default: the packaged alerts/rules.yaml).")
thresholds_option = click.option("--thresholds", "thresholds_file",
                               type=click.Path(dir_okay=False),
                               help="Threshold overrides (only the keys you change).")


def load_ruleset(rules_file, thresholds_file):
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
    """Alert rules (one source) and the embedded engine."""


@alerts.command("check")
@rules_option
@thresholds_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def check(rules_file, thresholds_file, as_json) -> None:
    """Validate the rules and thresholds (exit 2 with file and line on a problem)."""
    ruleset = load_ruleset(rules_file, thresholds_file)
    if as_json:
        click.echo(json.dumps([{"alert": r.name, "severity": r.severity, "action": r.action,
                                "for_seconds": r.for_seconds, "expr": r.expr,
                                "metrics": sorted(r.metrics)} for r in ruleset.rules],
                              indent=2))
        return
    width = max(len(rule.name) for rule in ruleset.rules)
    for rule in ruleset.rules:
        click.echo(f"{rule.name:{width}s} {rule.severity:8s} {rule.action or '-'}")
    click.echo(f"{len(ruleset.rules)} alerts OK")


@alerts.command("export")
@rules_option
@thresholds_option
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
    ruleset = load_ruleset(rules_file, thresholds_file)
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
@rules_option
@thresholds_option
@click.argument("test_file", type=click.Path(exists=True, dir_okay=False))
def test(rules_file, thresholds_file, test_file) -> None:
    """Replay a `promtool test rules` file through the embedded engine (exit 1 on mismatch)."""
    from trainwatch.alerts.replay import replay_file
    from trainwatch.alerts.rules import DEFAULT_RUNBOOK_BASE
    ruleset = load_ruleset(rules_file, thresholds_file)
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


@alerts.command("watch")
@rules_option
@thresholds_option
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
    from trainwatch.alerts.scrape import Scraper
    from trainwatch.alerts.silences import Silences
    ruleset = load_ruleset(rules_file, thresholds_file)
    for target in targets:
        _check_target(target)
    token = (read_secret(webhook_token_file, RECEIVER_TOKEN_ENV, "") if webhook_token_file
             else None)
    history = History()
    notifiers: list[Notifier] = [JournalNotifier(run)]
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
