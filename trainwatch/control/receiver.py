"""A receiver for Alertmanager's webhook (payload version 4) that runs trainwatch's actions.

Prometheus-native users route alerts to it (see deploy/alertmanager/) and get the
same automatic actions as the embedded engine.  It listens on 127.0.0.1 unless told
otherwise, requires ``Authorization: Bearer <token>`` (compared in constant time,
never logged), rejects malformed payloads with a 4xx and a reason before anything
acts, and hands each firing alert whose rule has an action to ``ActionRunner``
(which makes duplicate deliveries harmless).  ``/metrics`` exports the controller's
own state (the restart guard) for Prometheus. It serves through the agent's bounded
server (``trainwatch/serving/httpserver.py``): at most ``MAX_CONNECTIONS`` open, each request
whole within ``READ_TIMEOUT_SECONDS`` of its first byte, bodies capped before reading.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections import deque
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from trainwatch.control.actions import ActionRequest, ActionRunner
from trainwatch.alerts.rules import RuleSet
from trainwatch.config.yamlfile import read_secret
from trainwatch.contract.env import RECEIVER_TOKEN_ENV as TOKEN_ENV
from trainwatch.contract.metrics import METRICS, RESTART_GUARD_METRIC, RUN_LABEL
from trainwatch.contract.ports import LOOPBACK
from trainwatch.errors import listen_error
from trainwatch.serving.httpserver import BoundedHTTPServer, Request, Response

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
READ_TIMEOUT_SECONDS = 10.0      # a request must arrive whole this soon after its first byte
MAX_CONNECTIONS = 64             # open at once; more are closed at once (Alertmanager retries)
MAX_ALERTS_PER_PAYLOAD = 100     # the rest of a bigger payload is journaled as refused
MAX_ACTIONS_PER_WINDOW = 20      # action requests handed to the controller per window...
ACTION_WINDOW_SECONDS = 60.0     # ...beyond which they are journaled as refused


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
    except RecursionError:
        raise PayloadError("body is nested too deeply") from None
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
            if not isinstance(starts, str) or len(starts) > 64:
                raise ValueError(starts)
            datetime.fromisoformat(starts.replace("Z", "+00:00"))
        except ValueError:
            raise PayloadError(f"{where}.startsAt {str(starts)[:64]!r} is not an RFC 3339 "
                               "time") from None
        if not isinstance(alert.get("fingerprint"), str) or not alert["fingerprint"]:
            raise PayloadError(f"{where}.fingerprint is missing")
    return alerts


class Receiver:
    """The webhook server; ``start()`` serves in a thread, ``stop()`` shuts it down."""

    def __init__(self, ruleset: RuleSet, runner: ActionRunner, token: str,
                 host: str = LOOPBACK, port: int = 0):
        self.ruleset = ruleset
        self.runner = runner
        self._token = token.encode()
        self.registry = CollectorRegistry()
        guard = METRICS[RESTART_GUARD_METRIC]
        self.guard = Gauge(guard.name, guard.help, list(guard.labels), registry=self.registry)
        self.guard.labels(runner.job).set(1 if runner.guard_tripped else 0)
        other = METRICS["trainwatch_receiver_other_run_alerts_total"]
        self.other_run = Counter(other.name.removesuffix("_total"), other.help,
                                 list(other.labels), registry=self.registry)
        self.other_run.labels(runner.job)  # from 0, so increase() sees the first one
        try:
            self.server = BoundedHTTPServer(
                (host, port), self._route, max_connections=MAX_CONNECTIONS,
                idle_timeout=READ_TIMEOUT_SECONDS, read_timeout=READ_TIMEOUT_SECONDS,
                max_body=MAX_BODY_BYTES, name="tw-receiver")
        except OSError as exc:
            raise listen_error(exc, host, port, key="--listen") from None
        self._requests: deque[float] = deque()  # monotonic times of recent action requests
        self._requests_lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        assert isinstance(host, str), "an IP server's address is (host, port)"
        return f"http://{host}:{port}"

    def start(self) -> "Receiver":
        self.server.serve_in_thread()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def authorized(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer "):].strip().encode(), self._token)

    def _admit(self) -> bool:
        """One more action request within the window's cap?"""
        now = time.monotonic()
        with self._requests_lock:
            while self._requests and now - self._requests[0] > ACTION_WINDOW_SECONDS:
                self._requests.popleft()
            if len(self._requests) >= MAX_ACTIONS_PER_WINDOW:
                return False
            self._requests.append(now)
            return True

    def _refuse(self, alerts: list[dict[str, Any]], reason: str) -> None:
        """Journal alerts we will not act on, in one event (names and fingerprints capped)."""
        self.runner.run.append_event(
            "action_skipped", "webhook", action=None, reason=f"refused: {reason}",
            count=len(alerts), alerts=[{"alertname": a["labels"]["alertname"],
                                        "fingerprint": a["fingerprint"]} for a in alerts[:20]])
        log.warning("refused %d alert(s): %s", len(alerts), reason)

    def handle_alerts(self, alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        job, ours = self.runner.job, []
        for alert in alerts:
            run = alert["labels"].get(RUN_LABEL)
            if run is None or run == job:
                ours.append(alert)
                continue
            # Another run's alert on a shared webhook: not ours to act on nor to journal.
            self.other_run.labels(job).inc()
            log.debug("dropped %s for run %r (this receiver's run is %r)",
                      alert["labels"]["alertname"], run, job)
            results.append({"alertname": alert["labels"]["alertname"], "outcome": "dropped",
                            "reason": "for another run"})
        alerts = ours
        if len(alerts) > MAX_ALERTS_PER_PAYLOAD:
            rest = alerts[MAX_ALERTS_PER_PAYLOAD:]
            alerts = alerts[:MAX_ALERTS_PER_PAYLOAD]
            self._refuse(rest, f"more than {MAX_ALERTS_PER_PAYLOAD} alerts in one payload")
            results.append({"alertname": None, "outcome": "refused", "count": len(rest),
                            "reason": f"more than {MAX_ALERTS_PER_PAYLOAD} alerts in one "
                                      "payload"})
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
            if not self._admit():
                why = (f"more than {MAX_ACTIONS_PER_WINDOW} action requests in "
                       f"{ACTION_WINDOW_SECONDS:.0f} s")
                self._refuse([alert], why)
                results.append({"alertname": name, "outcome": "refused", "reason": why})
                continue
            req = ActionRequest(name, rule.action, dict(alert["labels"]), alert["fingerprint"],
                                alert["startsAt"], "webhook", dict(alert.get("annotations") or {}))
            outcome = self.runner.handle(req)
            results.append({"alertname": name, "outcome": "taken" if outcome.taken else "skipped",
                            "reason": outcome.reason})
        self.guard.clear()  # the run's name may have changed (run.json written since)
        self.guard.labels(job).set(1 if self.runner.guard_tripped else 0)
        return results

    def _route(self, request: Request) -> Response:
        """The answer to one request, read whole within the server's bounds (in its pool
        of threads): nothing acts before the token, the type and the payload check out."""
        if request.method in ("GET", "HEAD"):
            if request.path == "/healthz":
                return _json(200, {"ok": True})
            if request.path == "/metrics":
                return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry), {}
            return _json(404, {"error": "not found; POST alerts to /webhook"})
        if request.method != "POST" or request.path != "/webhook":
            return _json(404, {"error": "not found; POST alerts to /webhook"})
        if not self.authorized(request.headers.get("authorization")):
            return _json(401, {"error": "missing or wrong bearer token"})
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json" and not (
                ctype.startswith("application/") and ctype.endswith("+json")):
            return _json(415, {"error": f"Content-Type must be application/json, got "
                                        f"{ctype[:64]!r}"})
        if "content-length" not in request.headers:
            return _json(411, {"error": "Content-Length required"})
        try:
            alerts = parse_payload(request.body)
        except PayloadError as exc:
            return _json(400, {"error": str(exc)})
        return _json(200, {"results": self.handle_alerts(alerts)})


def _json(code: int, body: dict[str, Any]) -> Response:
    return code, "application/json", (json.dumps(body) + "\n").encode(), {}
