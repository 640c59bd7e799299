"""The embedded engine's clock: scrape the agents, add local gauges, evaluate, repeat."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from trainwatch.alerts.engine import Engine
from trainwatch.alerts.evaluate import labels_key
from trainwatch.alerts.rules import AGENT_JOB
from trainwatch.alerts.scrape import Scraper

log = logging.getLogger(__name__)


class EngineLoop:
    """Runs ``Engine.evaluate`` every ``interval`` seconds in a thread."""

    def __init__(self, engine: Engine, scraper: Scraper | None, interval: float):
        self.engine = engine
        self.scraper = scraper
        if scraper is not None:
            # Label the scrapes with the job the rules select (a user's `agent_job`), as the
            # user's Prometheus would: else TrainwatchAgentDown could never match here.
            scraper.job = engine.ruleset.thresholds[AGENT_JOB]
        self.interval = interval
        # Gauges the controller itself owns (e.g. the restart guard), refreshed every tick.
        self.local: dict[tuple, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0
        # Called with the tick's time after each evaluation (re-asking open actions).
        self.after_tick: list[Callable[[float], None]] = []

    def set_local(self, labels: dict[str, str], value: float) -> None:
        self.local[labels_key(labels)] = value

    def tick(self, t: float | None = None) -> None:
        t = time.time() if t is None else t
        if self.scraper is not None:
            self.scraper.scrape_all(t)
        for key, value in self.local.items():
            self.engine.history.add(key, t, value)
        self.engine.evaluate(t)
        for hook in self.after_tick:
            hook(t)
        self.ticks += 1

    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="tw-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.engine.flush()  # what the journal refused while its disk was full

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.time()
            try:
                self.tick(started)
            except Exception:  # the engine keeps evaluating
                log.exception("engine tick failed")
            self._stop.wait(max(0.0, self.interval - (time.time() - started)))
