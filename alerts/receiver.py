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
import socket
import sys
import threading
import time
from collections import deque
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from trainwatch.alerts.actions import ActionRequest, ActionRunner
from trainwatch.alerts.rules import RuleSet
from trainwatch.configfile import read_secret
from trainwatch.contract.env import RECEIVER_TOKEN_ENV as TOKEN_ENV
from trainwatch.contract.metrics import METRICS, RUN_LABEL
from trainwatch.errors import listen_error

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
READ_TIMEOUT_SECONDS = 10.0      # a client that stops sending is dropped, never waited on
MAX_ALERTS_PER_PAYLOAD = 100     # the rest of a bigger payload is journaled as refused
MAX_ACTIONS_PER_WINDOW = 20      # action requests handed to the controller per window...
ACTION_WINDOW_SECONDS = 60.0     # ...beyond which they are journaled as refused
_DISCONNECTS = (ConnectionError, TimeoutError, OSError)


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (a scrape timeout, a closed connection) is one log line,
        not a traceback; anything else is a bug and keeps its traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, _DISCONNECTS):
            log.info("client %s went away: %s", client_address[0], type(exc).__name__)
        else:
            log.exception("error serving %s", client_address[0])


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
        other = METRICS["trainwatch_receiver_other_run_alerts_total"]
        self.other_run = Counter(other.name.removesuffix("_total"), other.help,
                                 list(other.labels), registry=self.registry)
        self.other_run.labels(runner.job)  # from 0, so increase() sees the first one
        try:
            self.server = _Server((host, port), self._handler())
        except OSError as exc:
            raise listen_error(exc, host, port, key="--listen") from None
        self.thread: threading.Thread | None = None
        self._requests: deque[float] = deque()  # monotonic times of recent action requests
        self._requests_lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        assert isinstance(host, str), "an IP server's address is (host, port)"
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

    def _handler(self):
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "trainwatch-receiver"
            timeout = READ_TIMEOUT_SECONDS  # socket timeout: reads never wait longer

            def log_message(self, fmt: str, *args: Any) -> None:  # path and status only
                log.info("%s %s", self.address_string(), fmt % args)

            def _reply(self, code: int, body: dict[str, Any] | bytes,
                       content_type: str = "application/json") -> None:
                data = body if isinstance(body, bytes) else (json.dumps(body) + "\n").encode()
                self.send_response(code)
                if self.close_connection:
                    self.send_header("Connection", "close")
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
                    self._refuse(404, "not found; POST alerts to /webhook")
                    return
                if not receiver.authorized(self.headers.get("Authorization")):
                    self._refuse(401, "missing or wrong bearer token")
                    return
                ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
                if ctype != "application/json" and not (
                        ctype.startswith("application/") and ctype.endswith("+json")):
                    self._refuse(415, f"Content-Type must be application/json, got "
                                      f"{ctype[:64]!r}")
                    return
                raw = self.headers.get("Content-Length")
                if raw is None:
                    self._refuse(411, "Content-Length required")
                    return
                if not raw.strip().isdigit():  # negative, signed, hex, empty: not a length
                    self._refuse(400, f"bad Content-Length {raw[:32]!r}")
                    return
                length = int(raw)
                if length > MAX_BODY_BYTES:
                    self._refuse(413, f"body larger than {MAX_BODY_BYTES} bytes")
                    return
                try:
                    body = self.rfile.read(length)  # each wait bounded by the socket timeout
                except TimeoutError:
                    self._refuse(408, f"body not received within {self.timeout:g} s")
                    return
                if len(body) < length:
                    self._refuse(400, "body shorter than its Content-Length")
                    return
                try:
                    alerts = parse_payload(body)
                except PayloadError as exc:
                    self._reply(400, {"error": str(exc)})
                    return
                self._reply(200, {"results": receiver.handle_alerts(alerts)})

            def _refuse(self, code: int, error: str) -> None:
                """Answer and close without reading the body. Closing a socket with unread
                data resets it, which can destroy the answer in flight, so we stop sending,
                then discard at most 64 KiB for at most a second before closing."""
                self.close_connection = True
                self._reply(code, {"error": error})
                try:
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_WR)
                    self.connection.settimeout(1.0)
                    left = 64 << 10
                    while left > 0 and (chunk := self.connection.recv(min(left, 16384))):
                        left -= len(chunk)
                except OSError:
                    pass

        return Handler
