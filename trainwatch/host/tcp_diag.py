"""The kernel's own view of TCP connections: every socket's round-trip time, its best RTT
and its retransmissions, dumped over netlink (``NETLINK_SOCK_DIAG``, ``INET_DIAG``: what
``ss -tin`` shows), and which sockets a process holds (``/proc/PID/fd``).

Evidence that does not share the failure: a rank behind a slow link reports only that its
collectives take long; the kernel's per-socket RTT says which link is slow, and the
socket's ``min_rtt`` (its best RTT, a windowed minimum over minutes) says how fast that
link was before. The dump covers the network namespace of the calling thread; any user
may read it. ``parse_dump`` is separate so tests can give it packed messages.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
from typing import Any, Container

from trainwatch.host.socket_fds import SocketFds

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
TCP_ESTABLISHED = 1
ACTIVE_MS = 10_000   # a connection that sent or received data this recently (ms)
_NLMSG = struct.Struct("=IHHII")              # len, type, flags, seq, pid
_REQ = struct.Struct("=BBBxI48x")             # inet_diag_req_v2: family, proto, ext, states
_MSG = struct.Struct("=BBBB2H16s16sI8sIIIII")  # inet_diag_msg (sport/dport big-endian)
_RTA = struct.Struct("=HH")
# struct tcp_info (linux/tcp.h): the fields read, by byte offset; all u32 unless noted.
_TCP_INFO = {"retransmits": (2, "B"), "unacked": (24, "I"), "lost": (32, "I"),
             "last_data_sent": (44, "I"), "last_data_recv": (52, "I"), "rtt": (68, "I"),
             "rttvar": (72, "I"), "total_retrans": (100, "I"), "bytes_acked": (120, "Q"),
             "min_rtt": (148, "I"), "delivery_rate": (160, "Q")}


def _align(n: int) -> int:
    return (n + 3) & ~3


def _addr(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    addr = ipaddress.IPv6Address(raw)
    return str(addr.ipv4_mapped or addr)


_INODE = struct.Struct("=I")
_INODE_AT = _MSG.size - _INODE.size
_FIELDS = [(name, offset, struct.Struct("=" + kind)) for name, (offset, kind) in _TCP_INFO.items()]


# All of them in one unpack when the kernel sent them all (every kernel since 4.10).
_ALL = struct.Struct("=" + "".join(f"{max(0, offset - prev_end)}x{field.format[1:]}"
                                   for prev_end, (_, offset, field) in zip(
                                       [0] + [o + f.size for _, o, f in _FIELDS], _FIELDS)))
_NAMES = [name for name, _, _ in _FIELDS]


def _tcp_info(payload: bytes) -> dict[str, Any]:
    info: dict[str, Any]
    if len(payload) >= _ALL.size:
        info = dict(zip(_NAMES, _ALL.unpack_from(payload)))
    else:
        info = {name: field.unpack_from(payload, offset)[0] for name, offset, field in _FIELDS
                if len(payload) >= offset + field.size}
    us = {k: info.pop(k) for k in ("rtt", "rttvar", "min_rtt") if k in info}
    info.update({f"{k}_ms": round(v / 1000, 3) for k, v in us.items()})
    return info


def parse_dump(data: bytes, only: Container[int] | None = None
               ) -> tuple[list[dict[str, Any]], bool]:
    """The sockets in one read of the dump (those whose inode is in ``only``, when given:
    a node's other sockets are not parsed), and whether the dump is done. A socket has
    ``family``, ``state``, ``src``, ``sport``, ``dst``, ``dport``, ``inode`` and, when the
    kernel sent it, its tcp_info: ``rtt_ms``, ``rttvar_ms``, ``min_rtt_ms``,
    ``total_retrans``, ``retransmits``, ``unacked``, ``lost``, ``last_data_sent``,
    ``last_data_recv`` (ms ago), ``bytes_acked``, ``delivery_rate`` (bytes/s)."""
    out: list[dict[str, Any]] = []
    offset = 0
    while offset + _NLMSG.size <= len(data):
        length, kind, _, _, _ = _NLMSG.unpack_from(data, offset)
        if length < _NLMSG.size or offset + length > len(data):
            break
        body = data[offset + _NLMSG.size:offset + length]
        offset += _align(length)
        if kind == NLMSG_DONE:
            return out, True
        if kind == NLMSG_ERROR:
            errno = -struct.unpack_from("=i", body)[0] if len(body) >= 4 else 0
            raise OSError(errno, f"sock_diag: {os.strerror(errno)}")
        if kind != SOCK_DIAG_BY_FAMILY or len(body) < _MSG.size or (
                only is not None and _INODE.unpack_from(body, _INODE_AT)[0] not in only):
            continue
        (family, state, _, _, sport, dport, src, dst, _, _, _, _, _, _,
         inode) = _MSG.unpack_from(body)
        entry: dict[str, Any] = {
            "family": family, "state": state, "src": _addr(family, src),
            "sport": socket.ntohs(sport), "dst": _addr(family, dst),
            "dport": socket.ntohs(dport), "inode": inode}
        attr = _MSG.size
        while attr + _RTA.size <= len(body):
            rta_len, rta_type = _RTA.unpack_from(body, attr)
            if rta_len < _RTA.size:
                break
            if rta_type == INET_DIAG_INFO:
                entry.update(_tcp_info(body[attr + _RTA.size:attr + rta_len]))
            attr += _align(rta_len)
        out.append(entry)
    return out, False


def tcp_sockets(states: int = 1 << TCP_ESTABLISHED,
                only: Container[int] | None = None) -> list[dict[str, Any]]:
    """Every TCP socket (IPv4 and IPv6) in ``states`` of the calling thread's network
    namespace (or those whose inode is in ``only``), with its tcp_info (``parse_dump``).
    OSError when netlink is refused."""
    found: list[dict[str, Any]] = []
    for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
        with contextlib.closing(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW,
                                              NETLINK_SOCK_DIAG)) as sock:
            request = _REQ.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), states)
            sock.send(_NLMSG.pack(_NLMSG.size + len(request), SOCK_DIAG_BY_FAMILY,
                                  NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + request)
            done = False
            while not done:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                sockets, done = parse_dump(chunk, only)
                found.extend(sockets)
    return found


def recently_active(s: dict[str, Any], within_ms: int = ACTIVE_MS) -> bool:
    """Whether a socket with an RTT sent or received data within ``within_ms``: an idle
    connection's RTT is its last exchange's, however long ago."""
    recent = [s.get(k) for k in ("last_data_sent", "last_data_recv")]
    return isinstance(s.get("rtt_ms"), (int, float)) and any(
        isinstance(t, int) and t <= within_ms for t in recent)


def socket_inodes(pid: int, proc_root: str = "/proc") -> set[int]:
    """The inodes of the sockets a process holds open (empty when it cannot be read)."""
    return SocketFds(0.0, proc_root).inodes(pid) or set()
