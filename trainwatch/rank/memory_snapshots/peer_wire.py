"""The peer-copy wire: one snapshot file per TCP connection, authenticated, streamed.

Why a TCP side channel and not a gloo group: docs/architecture.md ("Peer copies travel on
their own TCP connections"). One connection carries one file:

    receiver -> sender   MAGIC, a fresh 32-byte nonce
    sender   -> receiver header length (4 bytes), header JSON, HMAC(secret, "head", nonce, header)
    receiver -> sender   one status byte: ACCEPT, or FULL / REFUSED / BUSY and the end
    sender   -> receiver the file's bytes (``bytes`` of them, in 1 MiB chunks),
                         sha256 of them, HMAC(secret, "tail", nonce, header, sha256)
    receiver -> sender   STORED, or BAD (the bytes are not what was sent, or not whole)

The job-wide ``secret`` never travels on this wire and is never logged; the nonce makes a
recorded transfer useless to replay; the trailer's MAC over the sha256 authenticates every
byte, so nothing is stored that a rank of this job did not send. Every socket operation has
a timeout, so a dead or stalled peer costs one connection, never a hang. The sender checks
that the file did not change while it was read (the snapshotter rewrote that buffer): then
it closes instead of sending a trailer, and the receiver keeps nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"TWPEER1\n"
NONCE_BYTES = 32
MAC_BYTES = 32
SHA_BYTES = 32
MAX_HEADER = 4096
MAX_FILE = 1 << 40  # a header claiming more is refused (1 TiB: no rank's snapshot)
CHUNK = 1 << 20

ACCEPT, STORED, FULL, REFUSED, BUSY, BAD = range(6)
STATUS = {ACCEPT: "accepted", STORED: "stored", FULL: "full", REFUSED: "refused",
          BUSY: "busy", BAD: "bad"}
COPY = "copy"    # the ring: this rank's newest snapshot, to its holder
FETCH = "fetch"  # at resume: a snapshot a rank lacks, from a rank that has it
PART = "part"    # every step: this rank's own part (RNGs, data position), to its holder
KINDS = (COPY, FETCH, PART)
HEADER_FIELDS = {"kind": str, "from_rank": int, "to_rank": int, "rank": int, "step": int,
                 "world_size": int, "digest": str, "bytes": int}


class WireError(Exception):
    """A transfer that did not complete; ``str()`` says how (never the secret)."""


class FileChanged(WireError):
    """The snapshot file was rewritten while it was sent: nothing was stored, no one failed."""


@dataclass(frozen=True)
class Endpoint:
    """Where a rank's receiver listens."""

    rank: int
    host: str
    port: int


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over length-prefixed parts (no two part lists give the same input)."""
    h = hmac.new(secret, label, hashlib.sha256)
    for part in parts:
        h.update(struct.pack(">Q", len(part)))
        h.update(part)
    return h.digest()


def recv_exact(sock: socket.socket, count: int) -> bytes:
    buf = bytearray(count)
    view, got = memoryview(buf), 0
    while got < count:
        n = sock.recv_into(view[got:], count - got)
        if n == 0:
            raise WireError(f"peer closed after {got} of {count} bytes")
        got += n
    return bytes(buf)


def parse_header(raw: bytes) -> dict[str, Any]:
    """The header's fields, type-checked; WireError for anything else."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"header is not JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != set(HEADER_FIELDS):
        raise WireError("header fields are not the expected ones")
    for key, kind in HEADER_FIELDS.items():
        if type(doc[key]) is not kind:
            raise WireError(f"header field {key!r} is not {kind.__name__}")
    if doc["kind"] not in KINDS or not 0 <= doc["bytes"] <= MAX_FILE or min(
            doc["rank"], doc["step"], doc["from_rank"], doc["to_rank"]) < 0 or doc["world_size"] < 1:
        raise WireError("header values out of range")
    return doc


def push_file(endpoint: Endpoint, secret: bytes, header: dict[str, Any], path: Path,
              timeout: float) -> str:
    """Send the file at ``path`` to ``endpoint`` (``header`` without ``bytes``: the file's
    size is added); the receiver's answer (``STATUS`` name), or WireError."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return _push(sock, secret, header, path)
    except OSError as exc:  # refused, reset, timed out, unreachable
        raise WireError(f"{type(exc).__name__}: {exc}") from None


def _push(sock: socket.socket, secret: bytes, header: dict[str, Any], path: Path) -> str:
    hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES)
    if hello[:len(MAGIC)] != MAGIC:
        raise WireError("not a trainwatch peer-copy receiver")
    nonce = hello[len(MAGIC):]
    with open(path, "rb", buffering=0) as fh:
        before = os.fstat(fh.fileno())
        raw = json.dumps({**header, "bytes": before.st_size}, sort_keys=True).encode()
        sock.sendall(struct.pack(">I", len(raw)) + raw + mac(secret, b"head", nonce, raw))
        status = recv_exact(sock, 1)[0]
        if status != ACCEPT:
            return STATUS.get(status, "unknown")
        digest, left = hashlib.sha256(), before.st_size
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while left:
            n = fh.readinto(view[:min(CHUNK, left)])
            if not n:
                raise FileChanged("the file got shorter while it was sent")
            digest.update(view[:n])
            sock.sendall(view[:n])
            left -= n
        after = os.fstat(fh.fileno())
    if (after.st_mtime_ns, after.st_size, after.st_ino) != (
            before.st_mtime_ns, before.st_size, before.st_ino):
        raise FileChanged("the file changed while it was sent (rewritten by the snapshotter)")
    sha = digest.digest()
    sock.sendall(sha + mac(secret, b"tail", nonce, raw, sha))
    status = recv_exact(sock, 1)[0]
    return STATUS.get(status, "unknown")


def greet(sock: socket.socket, secret: bytes) -> tuple[bytes, bytes, dict[str, Any]]:
    """Receiver side, up to the header: (nonce, raw header, header); WireError when the
    peer does not prove it holds the job's secret."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + nonce)
    (length,) = struct.unpack(">I", recv_exact(sock, 4))
    if length > MAX_HEADER:
        raise WireError(f"header of {length} bytes")
    raw = recv_exact(sock, length)
    if not hmac.compare_digest(recv_exact(sock, MAC_BYTES), mac(secret, b"head", nonce, raw)):
        raise WireError("unauthenticated: the header's MAC is not the job's")
    return nonce, raw, parse_header(raw)


def receive_into(sock: socket.socket, fd: int, size: int) -> str:
    """Receiver side: ``size`` bytes from the peer written to ``fd``; their sha256 hex.
    OSError from the write (ENOSPC: the tmpfs filled) is the caller's."""
    digest, left = hashlib.sha256(), size
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while left:
        n = sock.recv_into(view[:min(CHUNK, left)])
        if n == 0:
            raise WireError(f"peer closed with {left} of {size} bytes to come")
        digest.update(view[:n])
        written = 0
        while written < n:
            written += os.write(fd, view[written:n])
        left -= n
    return digest.hexdigest()


def check_trailer(sock: socket.socket, secret: bytes, nonce: bytes, raw: bytes,
                  sha256_hex: str) -> None:
    """WireError unless the trailer's sha256 is what arrived and its MAC is the job's."""
    trailer = recv_exact(sock, SHA_BYTES + MAC_BYTES)
    sha, tag = trailer[:SHA_BYTES], trailer[SHA_BYTES:]
    if not hmac.compare_digest(tag, mac(secret, b"tail", nonce, raw, sha)):
        raise WireError("unauthenticated: the trailer's MAC is not the job's")
    if sha.hex() != sha256_hex:
        raise WireError("the bytes that arrived are not the bytes that were sent")
