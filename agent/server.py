"""HTTP endpoints: /metrics, /status, /healthz.  Only formats stored values.

One asyncio event loop serves every connection, with h11 parsing HTTP/1.1: an idle or
slow client costs a socket and a coroutine, never a thread, so hundreds of idle
connections under the unit's TasksMax cannot starve a scrape (a thread per connection
did). Bounded everywhere: at most ``max_connections`` open (more are closed at once), a
connection idle for ``idle_timeout`` is closed, a request must arrive whole within
``read_timeout`` of its first byte, and rendering runs in a fixed pool of ``workers``
threads so a slow render never stalls the loop.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Callable

import h11

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD_BYTES = 16 << 10  # a scrape's request line and headers are a few hundred


class AgentHTTPServer:
    """Binds at construction (so a taken port fails early); ``serve_in_thread`` serves."""

    def __init__(self, address: tuple[str, int], metrics: Callable[[str], tuple[bytes, str]],
                 status: Callable[[], dict], healthy: Callable[[], bool], *,
                 max_connections: int = 1024, idle_timeout: float = 30.0,
                 read_timeout: float = 10.0, workers: int = 2):
        self.metrics, self.status, self.healthy = metrics, status, healthy
        self.max_connections, self.idle_timeout = max_connections, idle_timeout
        self.read_timeout = read_timeout
        self.socket = socket.create_server(address, family=_family(address[0]), backlog=1024)
        self.server_address = self.socket.getsockname()
        self.open_connections = 0
        self.refused_connections = 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agent-http")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def serve_in_thread(self) -> threading.Thread:
        self._thread = threading.Thread(target=self._serve, daemon=True, name="agent-http")
        self._thread.start()
        self._started.wait(10)
        return self._thread

    def _serve(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        server = loop.run_until_complete(asyncio.start_server(
            self._connection, sock=self.socket, limit=MAX_REQUEST_HEAD_BYTES))
        self._started.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            loop.run_until_complete(server.wait_closed())
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    def shutdown(self) -> None:
        loop, self._loop = self._loop, None  # idempotent: a second stop does nothing
        if loop is not None and self._thread is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def server_close(self) -> None:
        self.socket.close()

    # ------------------------------------------------------------------ connections
    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        peer = _peer(writer)
        if self.open_connections >= self.max_connections:
            self.refused_connections += 1
            writer.close()
            return
        self.open_connections += 1
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES)
        try:
            while True:
                request = await self._next_request(conn, reader)
                if request is None:
                    break
                code, content_type, body, extra = await self._respond(request)
                await self._send(conn, writer, request, code, content_type, body, extra)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            log.info("bad request from %s: %s", peer, exc)
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                try:
                    await self._send(conn, writer, None, exc.error_status_hint, "text/plain",
                                     b"bad request\n", {})
                except (ConnectionError, h11.LocalProtocolError):
                    pass
        except asyncio.TimeoutError:
            log.debug("closing %s: no whole request within the read timeout", peer)
        except (ConnectionError, h11.LocalProtocolError) as exc:
            log.info("client %s went away: %s", peer, exc.__class__.__name__)
        finally:
            self.open_connections -= 1
            writer.close()

    async def _next_request(self, conn: h11.Connection,
                            reader: asyncio.StreamReader) -> h11.Request | None:
        """The next whole request (its body read and dropped), or None when the client
        closed or stayed idle past ``idle_timeout``."""
        request, deadline = None, None
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if deadline is None:  # idle between requests: wait for the first byte
                    try:
                        data = await asyncio.wait_for(reader.read(65536), self.idle_timeout)
                    except asyncio.TimeoutError:
                        return None
                    deadline = time.monotonic() + self.read_timeout
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise asyncio.TimeoutError
                    data = await asyncio.wait_for(reader.read(65536), left)
                if not data and conn.their_state is not h11.IDLE:
                    raise ConnectionResetError("closed in the middle of a request")
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.EndOfMessage):
                return request
            elif isinstance(event, h11.ConnectionClosed):
                return None
            # h11.Data (a request body) is read and ignored: no endpoint takes one.

    async def _respond(self, request: h11.Request) -> tuple[int, str, bytes, dict[str, str]]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        path = request.target.decode("latin-1").split("?", 1)[0]
        if request.method not in (b"GET", b"HEAD"):
            return 405, "text/plain", b"method not allowed\n", {"allow": "GET, HEAD"}
        loop = asyncio.get_running_loop()
        try:
            if path == "/metrics":
                body, content_type = await loop.run_in_executor(
                    self._pool, self.metrics, headers.get("accept", ""))
                if _accepts_gzip(headers.get("accept-encoding", "")):
                    body = await loop.run_in_executor(self._pool, gzip.compress, body, 6)
                    return 200, content_type, body, {"content-encoding": "gzip",
                                                     "vary": "Accept, Accept-Encoding"}
                return 200, content_type, body, {"vary": "Accept, Accept-Encoding"}
            if path == "/status":
                body = await loop.run_in_executor(self._pool, self._status_body)
                return 200, "application/json", body, {}
            if path == "/healthz":
                ok = self.healthy()
                return (200 if ok else 503), "text/plain", b"ok\n" if ok else b"unhealthy\n", {}
            if path == "/":
                return 200, "text/plain", b"trainwatch agent: /metrics /status /healthz\n", {}
            return 404, "text/plain", b"not found\n", {}
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the server
            log.exception("error serving %s", path)
            return 500, "text/plain", f"error: {type(exc).__name__}\n".encode(), {}

    def _status_body(self) -> bytes:
        return json.dumps(self.status(), indent=1, default=str).encode()

    async def _send(self, conn: h11.Connection, writer: asyncio.StreamWriter,
                    request: h11.Request | None, code: int, content_type: str, body: bytes,
                    extra: dict[str, str]) -> None:
        headers = [("content-type", content_type), ("content-length", str(len(body))),
                   *extra.items()]
        writer.write(conn.send(h11.Response(status_code=code, headers=headers,
                                            reason=HTTPStatus(code).phrase.encode())))
        if request is None or request.method != b"HEAD":
            writer.write(conn.send(h11.Data(data=body)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()


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


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
