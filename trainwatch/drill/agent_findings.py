"""The agent's findings during a drill.

Findings (a stall, a straggler) are conditions on the agent's ``/status``, not journal
events, so a drill polls the agent that ``trainwatch run`` started (its address is in the
``controller_started`` event) and keeps every finding it saw, with the agent's own
``detected_at``. The agent also lists recently cleared findings, so one that came and went
between two polls is not missed.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from trainwatch.rundir.run_dir import RunDir

KEPT = ("id", "kind", "rank", "stall_kind", "severity", "detected_at", "since", "message")


class FindingsWatcher:
    def __init__(self, run: RunDir, *, timeout_seconds: float = 2.0):
        self.run = run
        self.timeout = timeout_seconds
        self.address: str | None = None
        self.seen: dict[tuple[str, float], dict[str, Any]] = {}
        self.errors = 0
        self.last_error: str | None = None

    def _find_agent(self) -> str | None:
        started = self.run.events("controller_started")
        targets = started[-1].get("agent") if started else None
        return targets[0] if isinstance(targets, list) and targets else None

    def poll(self) -> None:
        """One look at the agent's /status; an agent not up yet (or gone) is counted."""
        if self.address is None:
            self.address = self._find_agent()
            if self.address is None:
                return
        try:
            with urllib.request.urlopen(f"http://{self.address}/status",
                                        timeout=self.timeout) as resp:
                status = json.loads(resp.read())
        except (OSError, ValueError, urllib.error.URLError) as exc:
            self.errors += 1
            self.last_error = str(exc)
            return
        for finding in (status.get("findings") or []) + (status.get("recently_cleared") or []):
            if not isinstance(finding, dict) or not isinstance(finding.get("id"), str):
                continue
            detected = finding.get("detected_at")
            if not isinstance(detected, (int, float)):
                continue
            self.seen.setdefault((finding["id"], float(detected)),
                                 {k: finding.get(k) for k in KEPT})

    def findings(self) -> list[dict[str, Any]]:
        return sorted(self.seen.values(), key=lambda f: f["detected_at"])
