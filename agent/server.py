"""HTTP endpoints: /metrics, /status, /healthz.  Only formats stored values."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)


class AgentHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], metrics: Callable[[], bytes],
                 status: Callable[[], dict], healthy: Callable[[], bool]):
        self.metrics, self.status, self.healthy = metrics, status, healthy
        super().__init__(address, _Handler)

    def serve_in_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, daemon=True, name="agent-http")
        thread.start()
        return thread


class _Handler(BaseHTTPRequestHandler):
    server: AgentHTTPServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, self.server.metrics())
            elif path == "/status":
                body = json.dumps(self.server.status(), indent=1, default=str).encode()
                self._send(200, "application/json", body)
            elif path == "/healthz":
                ok = self.server.healthy()
                self._send(200 if ok else 503, "text/plain", b"ok\n" if ok else b"unhealthy\n")
            elif path == "/":
                self._send(200, "text/plain",
                           b"trainwatch agent: /metrics /status /healthz\n")
            else:
                self._send(404, "text/plain", b"not found\n")
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the server
            log.exception("error serving %s", path)
            self._send(500, "text/plain", f"error: {type(exc).__name__}\n".encode())

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args) -> None:
        log.debug("%s - %s", self.address_string(), fmt % args)
