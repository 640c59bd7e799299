"""The embedded alert engine: the same rules as Prometheus, with no Prometheus.

It keeps a short sample history (``History``), evaluates every rule at each
tick, and moves each alert through inactive -> pending -> firing -> resolved
exactly as Prometheus' alerting rules do (``for``, ``keep_firing_for``), so the
replay tests can demand the same firing moments as ``promtool test rules``.
Each alert is identified by its label set (its fingerprint); a firing alert is
announced once (deduplicated) and its resolution once; silenced alerts are
evaluated but neither announced nor acted on.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from trainwatch.alerts.evaluate import Evaluator, History, labels_key
from trainwatch.alerts.rules import Rule, RuleSet, render_template

log = logging.getLogger(__name__)

RESOLVED_RETENTION_SECONDS = 15 * 60  # as Prometheus: resolved alerts are re-sent this long


def fingerprint(labels: dict[str, str]) -> str:
    """A stable id for an alert's label set (hex, like Alertmanager's fingerprints)."""
    text = "\xff".join(f"{k}\xfe{v}" for k, v in sorted(labels.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Alert:
    rule: Rule
    labels: dict[str, str]
    annotations: dict[str, str]
    value: float
    active_at: float
    state: str = "pending"  # pending | firing | inactive (resolved)
    fired_at: float | None = None
    resolved_at: float | None = None
    keep_firing_since: float | None = None
    last_sent_at: float | None = None
    announced: str | None = None  # the last state announced to notifiers

    @property
    def name(self) -> str:
        return self.rule.name

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.labels)

    def as_dict(self) -> dict:
        return {"alertname": self.name, "state": self.state, "labels": self.labels,
                "annotations": self.annotations,
                "value": None if math.isnan(self.value) else self.value,
                "active_at": self.active_at, "fired_at": self.fired_at,
                "resolved_at": self.resolved_at, "fingerprint": self.fingerprint,
                "severity": self.rule.severity, "action": self.rule.action}


@dataclass
class Transition:
    """What changed at one evaluation: an alert started firing or was resolved."""

    kind: str  # "firing" | "resolved"
    alert: Alert
    silenced: bool


class Notifier(Protocol):
    """Where transitions go (alerts/notify.py): the journal, webhooks, Alertmanager."""

    def notify(self, kind: str, alert: Alert, t: float) -> None: ...


class Engine:
    """Evaluates a RuleSet over a History; notifies and triggers actions on transitions."""

    def __init__(self, ruleset: RuleSet, history: History | None = None, *,
                 runbook_base: str | None = None, silences=None,
                 notifiers: Iterable[Notifier] = (), on_firing: Callable[[Alert], None] | None = None):
        self.ruleset = ruleset
        self.history = history if history is not None else History()
        self.evaluator = Evaluator(self.history)
        self.runbook_base = runbook_base
        self.silences = silences
        self.notifiers = list(notifiers)
        self.on_firing = on_firing
        self.active: dict[str, dict[str, Alert]] = {r.name: {} for r in ruleset.rules}
        self.errors: dict[str, str] = {}
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, t: float) -> list[Transition]:
        """One evaluation of every rule at time ``t``; returns the transitions."""
        with self.lock:
            transitions: list[Transition] = []
            for rule in self.ruleset.rules:
                transitions += self._eval_rule(rule, t)
            self.history.prune(t)
        for tr in transitions:
            self._announce(tr, t)
        self._resend(t)
        return transitions

    def _eval_rule(self, rule: Rule, t: float) -> list[Transition]:
        try:
            result = self.evaluator.vector(rule.ast, t)
            self.errors.pop(rule.name, None)
        except (TypeError, ValueError) as exc:
            # Like Prometheus: a failing rule is reported, the other rules keep running.
            if self.errors.get(rule.name) != str(exc):
                log.warning("rule %s failed to evaluate: %s", rule.name, exc)
            self.errors[rule.name] = str(exc)
            return []
        active = self.active[rule.name]
        seen: set[str] = set()
        for key, value in result.items():
            labels = {k: v for k, v in key if k != "__name__"}
            labels.update({"alertname": rule.name, "severity": rule.severity})
            annotations = {"summary": render_template(rule.summary, labels, value),
                           "description": render_template(rule.description, labels, value)}
            if self.runbook_base is not None:
                annotations["runbook_url"] = rule.runbook_url(self.runbook_base)
            if rule.action:
                annotations["trainwatch_action"] = rule.action
            fp = fingerprint(labels)
            seen.add(fp)
            alert = active.get(fp)
            if alert is not None and alert.state != "inactive":
                alert.value, alert.annotations = value, annotations
                alert.keep_firing_since = None
                continue
            active[fp] = Alert(rule, labels, annotations, value, active_at=t)
        transitions = []
        for fp, alert in list(active.items()):
            if fp not in seen:
                keep = False
                if rule.keep_firing_seconds and alert.state == "firing":
                    if alert.keep_firing_since is None:
                        alert.keep_firing_since = t
                    keep = t - alert.keep_firing_since < rule.keep_firing_seconds
                if not keep:
                    if alert.state == "pending" or (
                            alert.resolved_at is not None
                            and t - alert.resolved_at > RESOLVED_RETENTION_SECONDS):
                        del active[fp]
                    if alert.state != "inactive":
                        was_firing = alert.state == "firing"
                        alert.state, alert.resolved_at = "inactive", t
                        if was_firing:
                            transitions.append(Transition("resolved", alert,
                                                          self.is_silenced(alert, t)))
                    continue
            if alert.state == "pending" and t - alert.active_at >= rule.for_seconds:
                alert.state, alert.fired_at = "firing", t
                transitions.append(Transition("firing", alert, self.is_silenced(alert, t)))
        return transitions

    # ------------------------------------------------------------------ queries
    def alerts(self, state: str | None = None) -> list[Alert]:
        with self.lock:
            return [a for per_rule in self.active.values() for a in per_rule.values()
                    if state is None or a.state == state]

    def firing(self) -> list[Alert]:
        return self.alerts("firing")

    def is_silenced(self, alert: Alert, t: float) -> bool:
        return bool(self.silences and self.silences.matching(alert.labels, t))

    # ------------------------------------------------------------------ notifications
    def _announce(self, tr: Transition, t: float) -> None:
        alert = tr.alert
        if alert.announced == tr.kind:
            return  # deduplicated: this state was already announced
        alert.announced = tr.kind
        if tr.silenced:
            log.info("alert %s %s (silenced)", alert.name, tr.kind)
            return
        for notifier in self.notifiers:
            try:
                notifier.notify(tr.kind, alert, t)
            except Exception as exc:  # a broken receiver must not stop the engine
                log.warning("notifier %s failed: %s", type(notifier).__name__, exc)
        if tr.kind == "firing" and alert.rule.action and self.on_firing is not None:
            try:
                self.on_firing(alert)
            except Exception:
                log.exception("action for %s failed", alert.name)

    def flush(self) -> None:
        """Notifiers holding what they could not deliver (the journal on a full disk) try
        once more: the engine's last act before it stops."""
        for notifier in self.notifiers:
            flush = getattr(notifier, "flush", None)
            if flush is not None:
                try:
                    flush()
                except Exception as exc:
                    log.warning("notifier %s failed: %s", type(notifier).__name__, exc)

    def _resend(self, t: float) -> None:
        """Notifiers that want it (Alertmanager) get every firing/recently resolved alert again."""
        batch = [a for a in self.alerts()
                 if a.fired_at is not None and not self.is_silenced(a, t)]
        for notifier in self.notifiers:
            resend = getattr(notifier, "resend", None)
            if resend is not None:
                try:
                    resend(batch, t)
                except Exception as exc:
                    log.warning("notifier %s failed: %s", type(notifier).__name__, exc)


def ingest_samples(history: History, samples: Iterable[tuple[dict[str, str], float]],
                   t: float) -> None:
    """Add directly given samples (``({"__name__": ..., labels...}, value)``) at time ``t``."""
    for labels, value in samples:
        history.add(labels_key(labels), t, value)
