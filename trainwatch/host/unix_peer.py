"""The other end of a connected unix socket, which /proc does not show.

/proc/net/unix lists a unix socket's inode and path but not its peer, so a process blocked
in ``recv`` on a ``socketpair`` looked like a socket to nowhere. The kernel's sock_diag
netlink interface (``UNIX_DIAG_PEER``, what ``ss -x`` reads) names the peer's inode; the
processes holding ``socket:[that inode]`` hold the other end — often the very process that
waits (a socketpair it holds both ends of). Unprivileged, no subprocess; None where the
kernel has no unix_diag or the socket lives in another network namespace.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
UDIAG_SHOW_PEER = 0x4
UNIX_DIAG_PEER = 2
_NO_COOKIE = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_REQUEST = struct.Struct("=BBHIIIII")  # unix_diag_req: family, protocol, pad, states, ino, show, cookie[2]
_MESSAGE_SIZE = 16  # unix_diag_msg: family, type, state, pad, ino, cookie[2]
_ATTR = struct.Struct("=HH")  # rtattr: len, type


def peer_inode(inode: int, timeout: float = 1.0) -> int | None:
    """The inode of the socket connected to unix socket ``inode``; None when unknown."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as sock:
            sock.settimeout(timeout)
            request = _REQUEST.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, inode, UDIAG_SHOW_PEER,
                                    _NO_COOKIE, _NO_COOKIE)
            sock.sendto(_HEADER.pack(_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY,
                                     NLM_F_REQUEST, 1, 0) + request, (0, 0))
            data = sock.recv(65536)
    except (OSError, ValueError, AttributeError):  # no AF_NETLINK, no unix_diag, a timeout
        return None
    return parse_peer(data)


def parse_peer(data: bytes) -> int | None:
    """The ``UNIX_DIAG_PEER`` attribute of a sock_diag answer (None for an error answer or a
    socket with no peer: a listener, an unconnected socket)."""
    if len(data) < _HEADER.size:
        return None
    length, kind, _, _, _ = _HEADER.unpack_from(data)
    if kind != SOCK_DIAG_BY_FAMILY:
        return None
    offset, end = _HEADER.size + _MESSAGE_SIZE, min(length, len(data))
    while offset + _ATTR.size <= end:
        size, attr = _ATTR.unpack_from(data, offset)
        if size < _ATTR.size:
            return None
        if attr == UNIX_DIAG_PEER and size >= _ATTR.size + 4:
            peer = struct.unpack_from("=I", data, offset + _ATTR.size)[0]
            return peer or None
        offset += (size + 3) & ~3
    return None


def describe_unix_wait(wait: dict[str, Any]) -> str:
    """``blocked in recv on a unix socketpair; the other end is held by pid 42 (this
    process)``: a unix socket is always on this host, so its other end is never "a peer
    not on this host"."""
    local, remote = wait.get("local") or "", wait.get("remote") or ""
    what = ("a unix socketpair" if not local and not remote and wait.get("peer_inode")
            else "a unix socket" + (f" {local}" if local else "")
            + (f" connected to {remote}" if remote else ""))
    peers = wait.get("peers") or []
    if peers:
        who = "the other end is held by " + ", ".join(
            f"pid {p['pid']} ({'this process' if p.get('self') else p.get('cmdline') or '?'})"
            for p in peers[:3])
    elif wait.get("peer_inode"):
        who = (f"no process visible here holds its other end (socket:[{wait['peer_inode']}]; "
               "another pid namespace, or one this user may not read)")
    else:
        who = ("its other end could not be found (the kernel's unix sock_diag did not "
               "answer); a unix socket's peer is on this host")
    return f"blocked in {wait.get('direction')} on {what}; {who}"
