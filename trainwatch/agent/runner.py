"""Runs every enabled collector on its own schedule, each isolated behind a timeout.

APScheduler fires one job per collector (``max_instances=1``: never two runs of one
collector; ``coalesce`` + ``misfire_grace_time``: runs missed while the machine was
busy collapse into one), except a collector registered ``after`` another of the same
interval: it runs in its leader's job, right after each of the leader's runs (finished,
failed, timed out or still hung), so it judges the newest values, one scheduler wake-up
serves both and their results are rendered together.  The job hands the run to the
collector's own daemon thread and waits at most ``timeout`` seconds: a collector that hangs (a dead NFS mount, a wedged
driver) is marked ``timeout`` and is not started again until that thread returns, so
hung threads never pile up and never block the agent's exit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from trainwatch.agent.context import AgentContext
from trainwatch.agent.registry import Collector, CollectorSpec, Result, all_collectors
from trainwatch.agent.state import CollectorRecord

log = logging.getLogger(__name__)


class _Worker:
    """One long-lived daemon thread per collector, so a run costs no thread start.

    The runner submits a run only when the previous one has returned, so at most one
    waits here; a hung run keeps its thread, and a daemon thread never blocks the
    agent's exit (a ThreadPoolExecutor's threads would).
    """

    def __init__(self, collector: Collector):
        self.collector = collector
        self._queue: queue.SimpleQueue[Future | None] = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name=f"collector-{collector.name}").start()

    def submit(self) -> Future:
        future: Future = Future()
        self._queue.put(future)
        return future

    def close(self) -> None:
        self._queue.put(None)  # the thread ends once any run in progress returns

    def _loop(self) -> None:
        while (future := self._queue.get()) is not None:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.collector.collect())
            except BaseException as exc:  # reported as the collector's failure
                future.set_exception(exc)


class CollectorRunner:
    """Owns the collectors, their schedule and their self-metrics in the state store."""

    def __init__(self, ctx: AgentContext):
        self.ctx = ctx
        self.collectors: dict[str, Collector] = {}
        self._workers: dict[str, _Worker] = {}
        self._followers: dict[str, list[str]] = {}  # leader -> run in its job, right after
        self._inflight: dict[str, tuple[Future, float]] = {}
        self._scheduler: BackgroundScheduler | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        specs = all_collectors()
        self._scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(max_workers=max(4, len(specs) + 1))},
            job_defaults={"coalesce": True, "max_instances": 1}, timezone="UTC")
        self._configure()
        self._scheduler.start()

    def stop(self) -> None:
        """Stop scheduling; waits for running collectors are abandoned at once, so a
        collector stuck on a hung mount never delays the agent's exit."""
        self._stopping.set()
        if self._scheduler is not None and self._scheduler.running:
            self._scheduler.shutdown(wait=False)
        self._close_workers()

    @property
    def running(self) -> bool:
        return bool(self._scheduler and self._scheduler.running)

    def reload(self, ctx: AgentContext) -> None:
        """Apply a new config: rebuild collectors, keep their counters."""
        with self._lock:
            self.ctx.config = ctx.config
            assert self._scheduler is not None
            self._scheduler.remove_all_jobs()
            self._configure()

    def _configure(self) -> None:
        from datetime import datetime, timedelta, timezone
        assert self._scheduler is not None
        self.collectors.clear()
        self._close_workers()
        self._followers = {}
        for name, spec in sorted(all_collectors().items()):
            opts = self.ctx.config.collector(name)
            enabled = bool(opts["enabled"])
            old = self.ctx.store.get(name)
            record = CollectorRecord(name, enabled, float(opts["interval"]),
                                     float(opts["timeout"]),
                                     state="pending" if enabled else "disabled")
            if old is not None:  # keep counters across reloads
                record = CollectorRecord(
                    name, enabled, record.interval, record.timeout,
                    state=old.state if enabled else "disabled", reason=old.reason,
                    samples=old.samples if enabled else (), data=old.data if enabled else None,
                    last_run_at=old.last_run_at, last_success_at=old.last_success_at,
                    duration=old.duration, runs=old.runs, errors=old.errors,
                    timeouts=old.timeouts)
            self.ctx.store.set(record)
            if not enabled:
                continue
            self.collectors[name] = spec.factory(self.ctx, opts)
            self._workers[name] = _Worker(self.collectors[name])
            if self._follows(spec, record.interval):
                assert spec.after is not None
                self._followers.setdefault(spec.after, []).append(name)
                continue
            self._scheduler.add_job(self.run_once, "interval", args=[name], id=name,
                                    seconds=record.interval,
                                    misfire_grace_time=max(1, int(record.interval)),
                                    next_run_time=datetime.now(timezone.utc)
                                    + timedelta(seconds=spec.first_delay))

    def _follows(self, spec: CollectorSpec, interval: float) -> bool:
        """Does this collector run in its leader's job (the leader on, same interval)?"""
        if spec.after is None:
            return False
        leader = self.ctx.config.collector(spec.after)
        return bool(leader["enabled"]) and float(leader["interval"]) == interval

    def _close_workers(self) -> None:
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()

    def _wait(self, future: Future, timeout: float) -> Any:
        deadline = time.monotonic() + timeout  # <= 0: only a result already there
        while True:
            if future.done():
                return future.result()
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stopping.is_set():
                raise FutureTimeout()
            try:
                return future.result(timeout=min(remaining, 0.25))
            except FutureTimeout:
                continue

    # -- one run -------------------------------------------------------------------
    def run_once(self, name: str) -> None:
        """Run one collector with its timeout and record the outcome, then those that
        follow it (each with its own timeout, side by side; also used by tests)."""
        self._finish(name, self._start(name))
        followers = [(each, self._start(each)) for each in self._followers.get(name, ())]
        for each, run in followers:
            self._finish(each, run)

    def _start(self, name: str) -> tuple[Future, float, float] | None:
        """Hand a run to the collector's thread: (its future, when it started, its
        deadline on the monotonic clock), or None when the collector is off or its
        previous run is still hung."""
        worker = self._workers.get(name)
        if worker is None:
            return None
        store = self.ctx.store
        record = store.get(name)
        assert record is not None
        pending = self._inflight.get(name)
        if pending is not None:
            future, since = pending
            if not future.done():
                store.update(name, state="timeout", samples=(),
                             reason=f"previous run still hung after {time.time() - since:.1f} s"
                                    " (not restarted until it returns)")
                return None
            del self._inflight[name]
        started = time.time()
        store.update(name, runs=record.runs + 1, bump=False)
        return worker.submit(), started, time.monotonic() + record.timeout

    def _finish(self, name: str, run: tuple[Future, float, float] | None) -> None:
        """Wait for a started run up to its timeout and record its outcome."""
        if run is None:
            return
        future, started, deadline = run
        store = self.ctx.store
        record = store.get(name)
        assert record is not None
        try:
            result: Any = self._wait(future, deadline - time.monotonic())
        except FutureTimeout:
            if self._stopping.is_set():
                return
            self._inflight[name] = (future, started)
            record = store.get(name)
            assert record is not None
            store.update(name, state="timeout", samples=(), last_run_at=started,
                         timeouts=record.timeouts + 1,
                         reason=f"did not finish within {record.timeout:g} s (hung?)")
            log.warning("collector %s timed out after %.1f s", name, record.timeout)
            return
        except Exception as exc:  # a failing collector must not stop the rest
            record = store.get(name)
            assert record is not None
            store.update(name, state="failed", samples=(), last_run_at=started,
                         duration=time.time() - started, errors=record.errors + 1,
                         reason=f"{type(exc).__name__}: {exc}")
            if record.errors < 5 or record.errors % 100 == 0:
                log.warning("collector %s failed: %r", name, exc)
            return
        if not isinstance(result, Result):
            result = Result(state="failed", reason=f"returned {type(result).__name__}")
        store.finish(name, result, started=started, duration=time.time() - started)
