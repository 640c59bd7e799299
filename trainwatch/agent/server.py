"""HTTP endpoints: /metrics, /status, /healthz.  Only formats stored values.

Served by ``trainwatch/serving/httpserver.py`` (one event loop, bounded connections, request
deadlines, a fixed pool of rendering threads), the same server as the webhook receiver's.
"""

from __future__ import annotations

import gzip
import json
from typing import Callable

from trainwatch.serving.httpserver import BoundedHTTPServer, Request, Response

# zlib level of a gzipped /metrics body: level 1 takes a third of level 6's CPU on it
# (2.1 vs 6.4 ms for 64 ranks' 318 KB) for a body 27 % larger (44 vs 35 KB); Prometheus asks
# for gzip on every scrape, and a node's CPU is dearer than a scrape's bytes.
GZIP_LEVEL = 1


class AgentHTTPServer(BoundedHTTPServer):
    """Binds at construction (so a taken port fails early); ``serve_in_thread`` serves."""

    def __init__(self, address: tuple[str, int], metrics: Callable[[str], tuple[bytes, str]],
                 status: Callable[[], dict], healthy: Callable[[], bool], *,
                 max_connections: int = 1024, idle_timeout: float = 30.0,
                 read_timeout: float = 10.0, workers: int = 2):
        self.metrics, self.status, self.healthy = metrics, status, healthy
        # content type -> (body, its gzip): a body served again (a second Prometheus, a
        # scrape within the body's life) is not compressed again
        self._packed: dict[str, tuple[bytes, bytes]] = {}
        super().__init__(address, self._route, max_connections=max_connections,
                         idle_timeout=idle_timeout, read_timeout=read_timeout,
                         workers=workers, name="agent-http")

    def _route(self, request: Request) -> Response:
        """The answer to one request (in the server's pool of threads)."""
        if request.method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n", {"allow": "GET, HEAD"}
        headers, path = request.headers, request.path
        if path == "/metrics":
            body, content_type = self.metrics(headers.get("accept", ""))
            if _accepts_gzip(headers.get("accept-encoding", "")):
                return 200, content_type, self._gzipped(body, content_type), {
                    "content-encoding": "gzip", "vary": "Accept, Accept-Encoding"}
            return 200, content_type, body, {"vary": "Accept, Accept-Encoding"}
        if path == "/status":
            return 200, "application/json", self._status_body(), {}
        if path == "/healthz":
            ok = self.healthy()
            return (200 if ok else 503), "text/plain", b"ok\n" if ok else b"unhealthy\n", {}
        if path == "/":
            return 200, "text/plain", b"trainwatch agent: /metrics /status /healthz\n", {}
        return 404, "text/plain", b"not found\n", {}

    def _gzipped(self, body: bytes, content_type: str) -> bytes:
        packed = self._packed.get(content_type)
        if packed is None or packed[0] is not body:
            packed = self._packed[content_type] = (body, gzip.compress(body, GZIP_LEVEL))
        return packed[1]

    def _status_body(self) -> bytes:
        return json.dumps(self.status(), indent=1, default=str).encode()


def _accepts_gzip(header: str) -> bool:
    for item in header.split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() in ("gzip", "*"):
            q = params.strip().removeprefix("q=").strip()
            try:
                return not params.strip().startswith("q=") or float(q) > 0
            except ValueError:
                return False
    return False
