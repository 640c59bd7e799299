"""A minimal client for NCCL's RAS endpoint (NCCL >= 2.24; JSON output in newer NCCL).

Protocol (line based, as the ``ncclras`` client speaks it): ``CLIENT PROTOCOL 2`` ->
``SERVER PROTOCOL n``; ``TIMEOUT s`` -> ``OK``; ``SET FORMAT json`` -> ``OK``;
``STATUS`` -> the JSON document until the server closes the connection.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

PROTOCOL = 2
MAX_BYTES = 8 << 20


class RasError(Exception):
    pass


def _readline(sock: socket.socket, deadline: float) -> str:
    data = b""
    while not data.endswith(b"\n"):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(1024)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def query_status(address: str, timeout: float = 5.0) -> dict[str, Any]:
    """Ask the RAS endpoint for the job status as JSON; raise RasError/OSError."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    with socket.create_connection((host.strip("[]") or "localhost", int(port)),
                                  timeout=timeout) as sock:
        sock.sendall(f"CLIENT PROTOCOL {PROTOCOL}\n".encode())
        hello = _readline(sock, deadline)
        if not hello.upper().startswith("SERVER PROTOCOL"):
            raise RasError(f"unexpected RAS greeting {hello[:80]!r}")
        sock.sendall(f"TIMEOUT {max(1, int(timeout) - 1)}\n".encode())
        if _readline(sock, deadline).upper() != "OK":
            raise RasError("RAS refused the TIMEOUT command")
        sock.sendall(b"SET FORMAT json\n")
        if _readline(sock, deadline).upper() != "OK":
            raise RasError("RAS endpoint does not speak JSON (NCCL too old for SET FORMAT)")
        sock.sendall(b"STATUS\n")
        chunks, size = [], 0
        while size < MAX_BYTES:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    try:
        doc = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise RasError(f"RAS status is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise RasError("RAS status is not a JSON object")
    return doc


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Counts trainwatch exports from a RAS status document."""
    comms = doc.get("communicators") or []
    missing = errors = 0
    for comm in comms:
        if not isinstance(comm, dict):
            continue
        missing += int(comm.get("missing_ranks_count") or 0)
        for rank in comm.get("ranks") or []:
            status = (rank or {}).get("status") or {}
            if status.get("async_error") or status.get("abort_flag"):
                errors += 1
    return {"nccl_version": doc.get("nccl_version"),
            "communicators": int(doc.get("communicators_count") or len(comms)),
            "ranks_missing": missing, "errors": errors}
