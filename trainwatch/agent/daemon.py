"""The agent process: wires the config, the collector runner and the HTTP server,
and handles signals (SIGHUP reloads the config, SIGTERM/SIGINT stop cleanly)."""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from typing import Callable

import psutil

from trainwatch.agent.config import AgentConfig, load_config
from trainwatch.agent.context import AgentContext
from trainwatch.agent.exporter import CachedExposition, SnapshotExporter
from trainwatch.agent.runner import CollectorRunner
from trainwatch.agent.server import AgentHTTPServer
from trainwatch.agent.status import build_status
from trainwatch.errors import ConfigError, listen_error

log = logging.getLogger(__name__)
GC_YOUNG_OBJECTS = 10_000  # objects alive since the last collection that start the next


class Agent:
    """``say`` gets the normal lines (serving, config reloaded, stopped): INFO by default;
    the command prints them, where the default WARNING level would hide INFO (systemd's
    journal shows the command's output). ``reload_args`` are ``load_config``'s keywords
    for a reload (the command's run directories, listen address, and its ``read``)."""

    def __init__(self, config: AgentConfig, *, reload_args: dict | None = None,
                 say: Callable[[str], None] = log.info):
        self.say = say
        self.ctx = AgentContext(config)
        self.reload_args = reload_args or {}
        self.runner = CollectorRunner(self.ctx)
        self.exporter = SnapshotExporter(self.ctx)
        self.exposition = CachedExposition(self.ctx, self.exporter)
        self.config_loaded_at = time.time()
        self._stop = threading.Event()
        self._reload = threading.Event()
        self.server: AgentHTTPServer | None = None
        if config.proc_root != "/proc":
            psutil.PROCFS_PATH = config.proc_root  # fixture trees in tests

    @property
    def address(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> None:
        host, port = self.ctx.config.host_port
        try:
            self.server = AgentHTTPServer((host, port), self.exposition.body, self.status,
                                          lambda: self.runner.running)
        except OSError as exc:
            from_file = not self.reload_args.get("listen") and self.ctx.config.file
            raise listen_error(exc, host, port, key="listen" if from_file else "--listen",
                               file=from_file or None) from None
        self.runner.start()
        # What the agent has loaded by now (modules, config, collectors: ~50k objects)
        # lives as long as it does: frozen out of the cyclic collector's way, a full
        # collection walks only what was made since (at 64 ranks it had taken ~17 ms,
        # every ~30 s, of a process that collects every second).
        gc.freeze()
        # Nearly all it makes after that dies by reference counting within a second (rows,
        # records, parsed beats). A young collection every 700 objects alive ran twice a
        # second at 64 ranks, walking those transients: 1.4 ms of CPU a second, ~5 % of
        # the agent's. Every 10,000 it runs about every half minute (0.09 ms a second).
        gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])
        self.server.serve_in_thread()
        self.say(f"trainwatch agent serving on http://{self.address} (/metrics /status /healthz)")

    def status(self) -> dict:
        return build_status(self.ctx, listen=self.address if self.server else "",
                            config_loaded_at=self.config_loaded_at)

    def reload(self) -> bool:
        """Re-read the config file; a bad file is logged and the running config kept."""
        try:
            config = load_config(self.ctx.config.file, **self.reload_args)
        except ConfigError as exc:
            log.error("config reload failed, keeping the running config: %s", exc)
            return False
        if config.listen != self.ctx.config.listen:
            log.warning("listen address changes need a restart; still on %s", self.address)
            config.listen = self.ctx.config.listen
        self.config_loaded_at = time.time()  # before applying: /status never shows the new
        self.runner.reload(AgentContext(config))  # collectors with the old load time
        self.say(f"trainwatch agent: config reloaded from {config.file}")
        return True

    def stop(self) -> None:
        self.runner.stop()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def run_forever(self, started: Callable[[], None] | None = None,
                    stopping: Callable[[], None] | None = None) -> None:
        """Block until SIGTERM/SIGINT; SIGHUP triggers a reload (handled outside the signal).
        ``started`` runs once the agent serves, ``stopping`` before it stops (what a caller
        runs beside it: ``trainwatch run``'s pager, control/supervisor_pager.py)."""
        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        signal.signal(signal.SIGINT, lambda *_: self._stop.set())
        signal.signal(signal.SIGHUP, lambda *_: self._reload.set())
        self.start()
        try:
            if started is not None:
                started()
            while not self._stop.is_set():
                if self._reload.wait(0.5):
                    self._reload.clear()
                    self.reload()
        finally:
            try:
                if stopping is not None:
                    stopping()
            finally:
                self.stop()
                self.say("trainwatch agent stopped")
