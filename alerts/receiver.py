"""A receiver for Alertmanager's webhook (payload version 4) that runs trainwatch's actions.

Prometheus-native users route alerts to it (see deploy/alertmanager/) and get the
same automatic actions as the embedded engine.  It listens on 127.0.0.1 unless told
otherwise, requires ``Authorization: Bearer <token>`` (compared in constant time,
never logged), rejects malformed payloads with a 4xx and a reason before anything
acts, and hands each firing alert whose rule has an action to ``ActionRunner``
(which makes duplicate deliveries harmless).  ``/metrics`` exports the controller's
own state (the restart guard) for Prometheus.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from trainwatch.alerts.actions import ActionRequest, ActionRunner
from trainwatch.alerts.rules import RuleSet
from trainwatch.configfile import read_secret
from trainwatch.contract.env import RECEIVER_TOKEN_ENV as TOKEN_ENV
from trainwatch.contract.metrics import METRICS
from trainwatch.errors import listen_error

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20


class PayloadError(ValueError):
    """A webhook body that is not a valid Alertmanager version 4 payload."""


def load_token(token_file: str | None = None) -> str:
    """The token from --token-file or $TRAINWATCH_RECEIVER_TOKEN; refusing to run without."""
    return read_secret(token_file, TOKEN_ENV,
                       f"a token is required: set {TOKEN_ENV} or pass --token-file "
                       "(anything that acts needs a token)")


def parse_payload(body: bytes) -> list[dict[str, Any]]:
    """Validate a version 4 payload; return its alerts.  PayloadError says what is wrong."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PayloadError(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise PayloadError("body must be a JSON object")
    if doc.get("version") != "4":
        raise PayloadError(f"unsupported payload version {doc.get('version')!r} (expected \"4\")")
    alerts = doc.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("'alerts' must be a list")
    for i, alert in enumerate(alerts):
        where = f"alerts[{i}]"
        if not isinstance(alert, dict):
            raise PayloadError(f"{where} must be an object")
        if alert.get("status") not in ("firing", "resolved"):
            raise PayloadError(f"{where}.status must be 'firing' or 'resolved'")
        labels = alert.get("labels")
        if not isinstance(labels, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise PayloadError(f"{where}.labels must map strings to strings")
        if not labels.get("alertname"):
            raise PayloadError(f"{where}.labels has no alertname")
        if not isinstance(alert.get("annotations", {}), dict):
            raise PayloadError(f"{where}.annotations must be an object")
        starts = alert.get("startsAt")
        try:
            datetime.fromisoformat(str(starts).replace("Z", "+00:00"))
        except ValueError:
            raise PayloadError(f"{where}.startsAt {starts!r} is not an RFC 3339 time") from None
        if not isinstance(alert.get("fingerprint"), str) or not alert["fingerprint"]:
            raise PayloadError(f"{where}.fingerprint is missing")
    return alerts


class Receiver:
    """The webhook server; ``start()`` serves in a thread, ``stop()`` shuts it down."""

    def __init__(self, ruleset: RuleSet, runner: ActionRunner, token: str,
                 host: str = "127.0.0.1", port: int = 0):
        self.ruleset = ruleset
        self.runner = runner
        self._token = token.encode()
        self.registry = CollectorRegistry()
        guard = METRICS["trainwatch_action_restart_guard_tripped"]
        self.guard = Gauge(guard.name, guard.help, list(guard.labels), registry=self.registry)
        self.guard.labels(runner.job).set(1 if runner.guard_tripped else 0)
        try:
            self.server = ThreadingHTTPServer((host, port), self._handler())
        except OSError as exc:
            raise listen_error(exc, host, port, key="--listen") from None
        self.server.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "Receiver":
        self.thread = threading.Thread(target=self.server.serve_forever, name="tw-receiver",
                                       daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def authorized(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer "):].strip().encode(), self._token)

    def handle_alerts(self, alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        results = []
        for alert in alerts:
            name = alert["labels"]["alertname"]
            rule = self.ruleset.get(name)
            if alert["status"] != "firing":
                results.append({"alertname": name, "outcome": "ignored", "reason": "resolved"})
                continue
            if rule is None or not rule.action:
                results.append({"alertname": name, "outcome": "ignored",
                                "reason": "no automatic action for this alert"})
                continue
            req = ActionRequest(name, rule.action, dict(alert["labels"]), alert["fingerprint"],
                                alert["startsAt"], "webhook", dict(alert.get("annotations") or {}))
            outcome = self.runner.handle(req)
            results.append({"alertname": name, "outcome": "taken" if outcome.taken else "skipped",
                            "reason": outcome.reason})
        self.guard.labels(self.runner.job).set(1 if self.runner.guard_tripped else 0)
        return results

    def _handler(self):
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "trainwatch-receiver"

            def log_message(self, fmt: str, *args: Any) -> None:  # path and status only
                log.info("%s %s", self.address_string(), fmt % args)

            def _reply(self, code: int, body: dict[str, Any] | bytes,
                       content_type: str = "application/json") -> None:
                data = body if isinstance(body, bytes) else (json.dumps(body) + "\n").encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self._reply(200, {"ok": True})
                elif self.path == "/metrics":
                    self._reply(200, generate_latest(receiver.registry), CONTENT_TYPE_LATEST)
                else:
                    self._reply(404, {"error": "not found; POST alerts to /webhook"})

            def do_POST(self) -> None:
                if self.path != "/webhook":
                    self._reply(404, {"error": "not found; POST alerts to /webhook"})
                    return
                if not receiver.authorized(self.headers.get("Authorization")):
                    self._reply(401, {"error": "missing or wrong bearer token"})
                    return
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self._reply(411, {"error": "Content-Length required"})
                    return
                if length > MAX_BODY_BYTES:
                    self._reply(413, {"error": f"body larger than {MAX_BODY_BYTES} bytes"})
                    return
                try:
                    alerts = parse_payload(self.rfile.read(length))
                except PayloadError as exc:
                    self._reply(400, {"error": str(exc)})
                    return
                self._reply(200, {"results": receiver.handle_alerts(alerts)})

        return Handler
