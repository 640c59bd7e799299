"""Run every gatherer in order; each one degrades to "could not see", never raises."""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from trainwatch.diagnose import (agent_links, agents, checkpoints, flight_recorder, journal, node_cpu,
                                 node_network, oom,
                                 processes, prometheus, rank_dumps, run_state, saved_evidence, stacks,
                                 supervisor, workers)
from trainwatch.diagnose.model import Evidence
from trainwatch.rundir.run_dir import RunDir

log = logging.getLogger(__name__)


@dataclass
class Options:
    agent_urls: list[str] = field(default_factory=list)
    prometheus_url: str | None = None
    timeout: float = 5.0
    native: bool = False
    request_dumps: bool = True


def gather(run: RunDir, options: Options,
           progress: Callable[[str], None] = lambda step: None) -> Evidence:
    ev = Evidence(run_dir=str(run.root), collected_at=time.time(), host=socket.gethostname())
    steps: list[tuple[str, Callable[[], None]]] = [
        ("rank status", lambda: run_state.gather(run, ev)),
        ("processes", lambda: processes.gather(ev)),
        ("node cpu", lambda: node_cpu.begin(run, ev)),
        ("oom kills", lambda: oom.gather(ev)),
        ("journal", lambda: journal.gather(run, ev)),
        ("supervisor", lambda: supervisor.gather(run, ev)),
        ("rank dumps", lambda: rank_dumps.gather(run, ev, options.timeout)
         if options.request_dumps else None),
        ("saved evidence", lambda: saved_evidence.gather(run, ev)),
        ("stacks", lambda: stacks.gather(ev, options.timeout, options.native)),
        ("data workers", lambda: workers.gather(ev, options.timeout)),
        ("cpu", lambda: processes.sample_cpu(ev)),
        ("node cpu share", lambda: node_cpu.finish(ev)),
        ("node network", lambda: node_network.gather(run, ev)),
        ("flight recorder", lambda: flight_recorder.gather(ev)),
        ("agents", lambda: agents.gather(ev, options.agent_urls, options.timeout)),
        ("agents' links", lambda: agent_links.gather(run, ev)),
        ("prometheus", lambda: prometheus.gather(ev, options.prometheus_url, options.timeout)),
        ("checkpoints", lambda: checkpoints.gather(run, ev)),
    ]
    for name, step in steps:
        progress(name)
        try:
            step()
        except Exception as exc:  # one broken source must not hide the rest
            log.debug("diagnose: %s failed", name, exc_info=True)
            ev.cannot_see(f"{name}: gathering failed ({exc!r})")
    return ev
