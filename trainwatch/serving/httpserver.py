"""A small HTTP/1.1 server bounded against slow and many clients: the agent's endpoints and
the webhook receiver both serve through it.

One asyncio event loop serves every connection, with h11 parsing HTTP/1.1: an idle or
slow client costs a socket and a coroutine, never a thread, so hundreds of idle
connections cannot starve a scrape or a webhook (a thread per connection did). Bounded
everywhere: at most ``max_connections`` open (more are closed at once), a connection idle
for ``idle_timeout`` is closed, a request must arrive whole, body included, within
``read_timeout`` of its first byte (a client sending a byte a second is cut off, with a
408 once its head is in), a body larger than ``max_body`` is refused with a 413 unread,
and ``respond`` runs in a fixed pool of ``workers`` threads so a slow answer never stalls
the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Callable

import h11

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD_BYTES = 16 << 10  # request line and headers: a few hundred bytes in practice
SEND_PIECE_BYTES = 64 << 10  # a response body is written this much at a time (``_send``)


@dataclass
class Request:
    method: str
    path: str      # without the query string
    headers: dict[str, str]  # names lower-cased
    body: bytes


# (status code, content type, body, extra headers)
Response = tuple[int, str, bytes, dict[str, str]]


class _Refused(Exception):
    """A request answered before it is read whole (its body is too large)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class BoundedHTTPServer:
    """Binds at construction (so a taken port fails early); ``serve_in_thread`` serves."""

    def __init__(self, address: tuple[str, int], respond: Callable[[Request], Response], *,
                 max_connections: int = 1024, idle_timeout: float = 30.0,
                 read_timeout: float = 10.0, workers: int = 2, max_body: int = 0,
                 name: str = "http"):
        self.respond, self.name = respond, name
        self.max_connections, self.idle_timeout = max_connections, idle_timeout
        self.read_timeout, self.max_body = read_timeout, max_body
        self.socket = socket.create_server(address, family=_family(address[0]), backlog=1024)
        self.server_address = self.socket.getsockname()
        self.open_connections = 0
        self.refused_connections = 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def serve_in_thread(self) -> threading.Thread:
        self._thread = threading.Thread(target=self._serve, daemon=True, name=self.name)
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
                await self._send(conn, writer, request.method, code, content_type, body, extra)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            log.info("bad request from %s: %s", peer, exc)
            await self._answer_early(conn, writer, reader, exc.error_status_hint,
                                     "bad request")
        except _Refused as exc:
            log.info("refused a request from %s: %s", peer, exc.message)
            await self._answer_early(conn, writer, reader, exc.code, exc.message)
        except asyncio.TimeoutError:
            log.info("closing %s: no whole request within %g s", peer, self.read_timeout)
            await self._answer_early(conn, writer, reader, 408, f"request not received "
                                     f"within {self.read_timeout:g} s")
        except (ConnectionError, h11.LocalProtocolError) as exc:
            log.info("client %s went away: %s", peer, exc.__class__.__name__)
        finally:
            self.open_connections -= 1
            writer.close()

    async def _next_request(self, conn: h11.Connection,
                            reader: asyncio.StreamReader) -> Request | None:
        """The next whole request, body included, or None when the client closed or stayed
        idle past ``idle_timeout``."""
        head, body, deadline = None, bytearray(), None
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
                head = event
                length = dict(event.headers).get(b"content-length")
                if length is not None and int(length) > self.max_body:  # h11 checked it
                    raise _Refused(413, f"body larger than {self.max_body} bytes")
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > self.max_body:
                    raise _Refused(413, f"body larger than {self.max_body} bytes")
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None, "h11 gives a request before its end"
                headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                           for k, v in head.headers}
                path = head.target.decode("latin-1").split("?", 1)[0]
                return Request(head.method.decode("latin-1"), path, headers, bytes(body))
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _respond(self, request: Request) -> Response:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, self.respond, request)
        except Exception as exc:  # one bad request must not kill the server
            log.exception("error serving %s", request.path)
            return 500, "text/plain", f"error: {type(exc).__name__}\n".encode(), {}

    async def _answer_early(self, conn: h11.Connection, writer: asyncio.StreamWriter,
                            reader: asyncio.StreamReader, code: int, message: str) -> None:
        """Answer a request that was not read whole, then close. Closing a socket with
        unread data resets it, which can destroy the answer in flight, so we stop sending,
        then discard at most 64 KiB for at most a second before closing."""
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # an answer is under way already
        try:
            await self._send(conn, writer, "", code, "application/json",
                             (json.dumps({"error": message}) + "\n").encode(),
                             {"connection": "close"})
            writer.write_eof()
            left, until = 64 << 10, time.monotonic() + 1.0
            while left > 0 and (wait := until - time.monotonic()) > 0:
                chunk = await asyncio.wait_for(reader.read(min(left, 16384)), wait)
                if not chunk:
                    break
                left -= len(chunk)
        except (ConnectionError, h11.LocalProtocolError, asyncio.TimeoutError, OSError):
            pass

    async def _send(self, conn: h11.Connection, writer: asyncio.StreamWriter, method: str,
                    code: int, content_type: str, body: bytes, extra: dict[str, str]) -> None:
        headers = [("content-type", content_type), ("content-length", str(len(body))),
                   *extra.items()]
        writer.write(conn.send(h11.Response(status_code=code, headers=headers,
                                            reason=HTTPStatus(code).phrase.encode())))
        if method != "HEAD":
            # A piece at a time, each let go before the next: a large body written whole
            # was copied by the transport (the part the socket did not take at once, sliced
            # and buffered: ~2.6 MiB for a 1.3 MiB /metrics body on a new connection).
            for start in range(0, len(body), SEND_PIECE_BYTES):
                writer.write(conn.send(h11.Data(data=body[start:start + SEND_PIECE_BYTES])))
                await writer.drain()
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
