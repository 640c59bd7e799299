"""Where the embedded engine sends alerts: the journal/log, webhooks, Alertmanager's v2 API.

Notifiers never raise into the engine (it counts and logs their failures) and use
short timeouts, so a dead receiver cannot stall evaluation.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections import deque
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainwatch.alerts.engine import Alert
from trainwatch.rundir.run_dir import RunDir

log = logging.getLogger(__name__)


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def _post(url: str, body: Any, headers: dict[str, str] | None = None,
          timeout: float = 5.0) -> int:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status


JOURNAL_BACKLOG = 256  # transitions kept while the journal cannot be written


class JournalNotifier:
    """alert_firing / alert_resolved events in the run's journal, and a log line.

    The alert that matters most on a full disk, StorageFull, fires exactly when the
    journal cannot take it: a transition the journal refuses waits in a bounded backlog,
    with the time it happened, and is written at the next transition or evaluation once
    the disk takes writes again (the oldest give way past ``JOURNAL_BACKLOG``, counted)."""

    def __init__(self, run: RunDir | str | Path | None):
        if isinstance(run, (str, Path)):  # a path: a caller with no RunDir (a test, a script)
            run = RunDir(run) if str(run) else None
        self.run = run  # None: the log line only
        self.backlog: deque[tuple[str, dict[str, Any]]] = deque()
        self.dropped = 0  # transitions the backlog had no room for
        self._failing = False

    def notify(self, kind: str, alert: Alert, t: float) -> None:
        log.warning("alert %s %s %s: %s", alert.name, kind,
                    {k: v for k, v in alert.labels.items() if k != "alertname"},
                    alert.annotations.get("summary", ""))
        if self.run is None:
            return
        if len(self.backlog) >= JOURNAL_BACKLOG:
            self.backlog.popleft()
            self.dropped += 1
        self.backlog.append((f"alert_{kind}", {
            "alert": alert.name, "severity": alert.rule.severity, "labels": alert.labels,
            "summary": alert.annotations.get("summary"), "value": alert.as_dict()["value"],
            "fingerprint": alert.fingerprint, "starts_at": rfc3339(alert.active_at),
            "time": time.time(), "mono": time.monotonic()}))
        self.flush()

    def resend(self, alerts: list[Alert], t: float) -> None:
        """Every evaluation: what the journal refused before, now that it may take it."""
        if self.backlog:
            self.flush()

    def flush(self) -> None:
        """Write the backlog, oldest first, until the journal refuses (OSError: the
        engine's warning names it once, not at every evaluation)."""
        if self.run is None:
            return
        while self.backlog:
            event, fields = self.backlog[0]
            late = {"journaled_late": True} if time.time() - fields["time"] > 1.0 else {}
            lost = {"unjournaled_before": self.dropped} if self.dropped else {}
            try:
                self.run.append_event(event, "engine", **fields, **late, **lost)
            except OSError:
                if self._failing:
                    return  # said when it began
                self._failing = True
                raise
            self.backlog.popleft()
            self.dropped = 0
        self._failing = False


def webhook_alert(alert: Alert, kind: str, t: float) -> dict[str, Any]:
    """One alert in Alertmanager's webhook (version 4) shape."""
    ends_at = "0001-01-01T00:00:00Z"
    if kind == "resolved":
        assert alert.resolved_at is not None, "the engine resolves an alert at a time"
        ends_at = rfc3339(alert.resolved_at)
    return {"status": kind, "labels": alert.labels, "annotations": alert.annotations,
            "startsAt": rfc3339(alert.active_at), "endsAt": ends_at,
            "generatorURL": "", "fingerprint": alert.fingerprint}


class WebhookNotifier:
    """POSTs each transition as an Alertmanager-style (version 4) webhook payload."""

    def __init__(self, url: str, token: str | None = None, receiver: str = "trainwatch"):
        self.url, self.token, self.receiver = url, token, receiver

    def notify(self, kind: str, alert: Alert, t: float) -> None:
        payload = {"version": "4", "groupKey": f"{{}}:{{alertname=\"{alert.name}\"}}",
                   "truncatedAlerts": 0, "status": kind, "receiver": self.receiver,
                   "groupLabels": {"alertname": alert.name}, "commonLabels": alert.labels,
                   "commonAnnotations": alert.annotations, "externalURL": "",
                   "alerts": [webhook_alert(alert, kind, t)]}
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        _post(self.url, payload, headers)


class AlertmanagerNotifier:
    """Alertmanager's v2 API: POST /api/v2/alerts, re-sent while firing, endsAt on resolve.

    Like Prometheus, firing alerts carry an endsAt a few resend intervals ahead, so
    Alertmanager resolves them by itself if the engine dies.
    """

    def __init__(self, url: str, resend_seconds: float = 60.0, generator_url: str = ""):
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.resend_seconds = resend_seconds
        self.generator_url = generator_url
        self.last_sent: float | None = None
        self.sent = 0

    def _body(self, alerts: list[Alert], t: float) -> list[dict[str, Any]]:
        out = []
        for a in alerts:
            ends = t + 4 * self.resend_seconds
            if a.state == "inactive":
                assert a.resolved_at is not None, "the engine resolves an alert at a time"
                ends = a.resolved_at
            out.append({"labels": a.labels, "annotations": a.annotations,
                        "startsAt": rfc3339(a.active_at), "endsAt": rfc3339(ends),
                        "generatorURL": self.generator_url})
        return out

    def notify(self, kind: str, alert: Alert, t: float) -> None:
        _post(self.url, self._body([alert], t))
        self.sent += 1

    def resend(self, alerts: list[Alert], t: float) -> None:
        if not alerts or (self.last_sent is not None and t - self.last_sent < self.resend_seconds):
            return
        self.last_sent = t
        _post(self.url, self._body(alerts, t))
        self.sent += 1
