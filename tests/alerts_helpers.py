"""Alertmanager for a test: where its binary is, a free loopback port, waiting until ready."""

from __future__ import annotations

import shutil
import socket
import urllib.request


from agent_helpers import wait_for


ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str, timeout: float = 60) -> None:
    def ok():
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False
    wait_for(ok, timeout)
