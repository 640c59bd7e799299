"""Default network addresses. Servers bind to loopback unless told otherwise."""

from __future__ import annotations

LOOPBACK = "127.0.0.1"
AGENT_PORT = 9464      # trainwatch agent: /metrics, /status, /healthz
RECEIVER_PORT = 9465   # trainwatch alerts receive: the Alertmanager webhook

AGENT_LISTEN = f"{LOOPBACK}:{AGENT_PORT}"
RECEIVER_LISTEN = f"{LOOPBACK}:{RECEIVER_PORT}"
