"""Ranks: every local rank's status file plus its OS process.

Reads each run directory through ``trainwatch.rundir.run_dir.RunDir`` (torn, empty, alien or
newer-version status files are skipped, listed in /status and counted once per file
version), inspects each rank's process with psutil, and exports the trainwatch_train_*,
trainwatch_rank_*, trainwatch_process_* and (from the checkpoint library's facts in the
status files) trainwatch_checkpoint_* and the non-finite guard's series.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from trainwatch.agent import jobview
from trainwatch.host.pid_namespace import HostPids
from trainwatch.host.procinfo import ProcessTracker
from trainwatch.agent.rankfiles import RankFiles
from trainwatch.agent.registry import Collector, Result, label_values, register
from trainwatch.agent.series import MAX_LABELLED, Block, Rows, Series, SeriesBook, kept
from trainwatch.contract.collectives import read_field
from trainwatch.contract.replicas import digests
from trainwatch.rundir.beat import (MERGED_COUNTERS, MERGED_FIELDS, MERGED_METRICS, declared_budgets,
                             merge_beat)
from trainwatch.contract.metrics import (COUNTER_FIELD_METRICS, EVAL_FIELD_METRICS,
                                          PHASE_SECONDS_FIELD, PHASE_TIME_METRIC,
                                          STATUS_FIELD_METRICS, STEP_FIELD_METRICS)
from trainwatch.contract.states import KNOWN_PHASES, PROCESS_STATES, RANK_STATES
from trainwatch.contract.timing import job_window
from trainwatch.errors import FormatError
from trainwatch.node import CLOCKS_AGREE_SECONDS, boot_id
from trainwatch.contract.layout import RUN_FORMAT
from trainwatch.rundir.safe_read import SKIP_REASONS, Skipped, SkippedFile, read_record

log = logging.getLogger(__name__)
_CHECKPOINT_COUNTERS = {  # checkpoint facts field -> job-level metric (max over ranks)
    "saves_total": "trainwatch_checkpoint_saves_total",
    "failures_total": "trainwatch_checkpoint_failures_total",
    "nonfinite_skipped_total": "trainwatch_train_nonfinite_skipped_steps_total",
}


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


_Table = tuple[tuple[str, ...], list[Series]]  # a rank's fields and their series


def _fields(metrics: dict[str, str], merged: frozenset[str], from_beat: bool) -> tuple[str, ...]:
    """A table's fields: those a beat may bring newer than the status (``merge_beat``),
    or the rest; one tuple for every rank's table."""
    return tuple(field for field in metrics if (field in merged) == from_beat)


_STATUS_OWN = _fields(STATUS_FIELD_METRICS, MERGED_FIELDS, False)
_STATUS_BEAT = _fields(STATUS_FIELD_METRICS, MERGED_FIELDS, True)
_STEP_OWN = _fields(STEP_FIELD_METRICS, MERGED_METRICS, False)
_STEP_BEAT = _fields(STEP_FIELD_METRICS, MERGED_METRICS, True)
_EVAL = _fields(EVAL_FIELD_METRICS, frozenset(), False)
_COUNTER_OWN = _fields(COUNTER_FIELD_METRICS, MERGED_COUNTERS, False)
_COUNTER_BEAT = _fields(COUNTER_FIELD_METRICS, MERGED_COUNTERS, True)


# Extra label pairs of the one-hot tables and phase series, one tuple for every rank's.
_STATE_LABELS = {name: (("state", name),) for name in RANK_STATES}
_PROCESS_LABELS = {name: (("state", name),) for name in PROCESS_STATES}
_PHASE_LABELS = {name: (("phase", name),) for name in KNOWN_PHASES}


@dataclass(slots=True)
class _Seen:
    value: float
    anchor: float  # monotonic time at which the value was new
    looked: float  # monotonic time of the last look


class _RankSeries(SeriesBook):
    """A rank's series, made once while its labels stay the same (a rank exports dozens
    of series every second), in tables its rows are read from without a lookup each."""

    __slots__ = ("states", "processes", "phases", "status_fields",
                 "step_fields", "eval_fields", "counter_fields", "info", "info_of",
                 "beat_fields", "beat_step_fields", "beat_counter_fields", "kept", "_one_hot")

    def __init__(self, base: dict[str, str]):
        super().__init__(base)
        self.info: Series | None = None
        self.info_of: tuple[Any, Any] | None = None  # (backend, device) ``info`` is for
        # The one-hot tables' series, made here once (not looked up by label: none is
        # asked for by label again), their extra labels shared by every rank's.
        self.states = [(name, Series("trainwatch_rank_state", base, extra))
                       for name, extra in _STATE_LABELS.items()]
        self.processes = [(name, Series("trainwatch_process_state", base, extra))
                          for name, extra in _PROCESS_LABELS.items()]
        self.phases = {name: Series("trainwatch_rank_phase", base, extra)
                       for name, extra in _PHASE_LABELS.items()}
        # Fields a beat may bring newer than the status (``merge_beat``) apart from the rest.
        self.status_fields = self._table(STATUS_FIELD_METRICS, _STATUS_OWN)
        self.beat_fields = self._table(STATUS_FIELD_METRICS, _STATUS_BEAT)
        self.step_fields = self._table(STEP_FIELD_METRICS, _STEP_OWN)
        self.beat_step_fields = self._table(STEP_FIELD_METRICS, _STEP_BEAT)
        self.eval_fields = self._table(EVAL_FIELD_METRICS, _EVAL)
        self.counter_fields = self._table(COUNTER_FIELD_METRICS, _COUNTER_OWN)
        self.beat_counter_fields = self._table(COUNTER_FIELD_METRICS, _COUNTER_BEAT)
        # (what they were made of, rows): the status's own rows and the process's, kept
        # while the same parsed status and the same process facts stand (seconds at a time).
        self.kept: dict[str, tuple[tuple[Any, ...], Block]] = {}
        # (table, its value) -> its rows: a state or phase's rows are made once
        self._one_hot: dict[tuple[str, str], Block] = {}

    def _table(self, metrics: dict[str, str], fields: tuple[str, ...]) -> _Table:
        """(the fields, their series): the fields' tuple is every rank's (``_fields``)."""
        return fields, [self.one(metrics[field]) for field in fields]

    def rows_of(self, part: str, made_of: tuple[Any, ...],
                make: Callable[[Rows], None]) -> Block:
        """The rows ``make`` adds for these very objects (``is``: a parse or an inspection
        makes new ones), made again only when one of them is another; the block of
        before while they come out the same (a status parsed again, every few seconds)."""
        held = self.kept.get(part)
        if held is not None and all(a is b for a, b in zip(held[0], made_of)):
            return held[1]
        rows = Rows()
        make(rows)
        block = kept(held[1] if held is not None else None, rows.pairs)
        self.kept[part] = (made_of, block)
        return block

    def one_hot(self, table: str, value: str) -> Block:
        """The rows of a state or phase table (``states``, ``phases``): 1 for ``value``,
        0 for the rest; a phase of the rank's own naming adds its own series (1). Made
        once per value (a rank inventing names: made again after ``MAX_LABELLED``)."""
        block = self._one_hot.get((table, value))
        if block is not None:
            return block
        entries = self.states if table == "states" else list(self.phases.items())
        pairs = [(each, 1.0 if name == value else 0.0) for name, each in entries]
        if table == "phases" and value not in self.phases:
            pairs.append((self.phase("trainwatch_rank_phase", value), 1.0))
        if len(self._one_hot) >= MAX_LABELLED:
            self._one_hot.clear()
        block = self._one_hot[(table, value)] = Block(pairs)
        return block

    def phase(self, metric: str, name: str) -> Series:
        return self.labelled(metric, _PHASE_LABELS.get(name) or (("phase", name),))

    def info_series(self, backend: Any, device: Any) -> Series:
        if self.info is None or self.info_of != (backend, device):
            self.info_of = (backend, device)
            self.info = self.labelled("trainwatch_rank_info", tuple(label_values(
                {"backend": backend or "", "device": device or ""}).items()))
        return self.info


def _numbers(rows: Rows, table: _Table, values: dict[str, Any]) -> None:
    """The table's fields that are numbers in ``values`` (``_num``, without a call each)."""
    pairs = rows.pairs
    for field, series in zip(*table):
        value = values.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            pairs.append((series, float(value)))


def _ours(status: dict[str, Any], names: set[str], boot: str, several: bool) -> bool:
    """Whether a rank's process runs on this node (``Ranks._local``)."""
    node = status.get("node")
    if not node:
        return not several
    if node in names:
        return True
    return not several and bool(boot) and status.get("boot") == boot


def _on_our_clock(s: dict[str, Any], now: float, mono: float) -> dict[str, Any]:
    """The status with its wall-clock times moved onto this agent's wall clock when the rank's
    disagrees (a rank 5 minutes behind would look 5 minutes stale, or its process younger
    than the rank). Same machine and boot only: then the rank's ``heartbeat_mono`` is on
    our monotonic clock, and its wall clock's offset from ours is exact."""
    hb_at, hb_mono = _num(s.get("heartbeat_at")), _num(s.get("heartbeat_mono"))
    if hb_at is None or hb_mono is None or not s.get("boot") or s.get("boot") != boot_id():
        return s
    ahead = (hb_at - hb_mono) - (now - mono)
    if abs(ahead) <= CLOCKS_AGREE_SECONDS:
        return s
    moved = dict(s, clock_ahead_seconds=ahead)
    for field in ("heartbeat_at", "last_progress_at", "phase_since", "started_at"):
        value = _num(s.get(field))
        if value is not None:
            moved[field] = value - ahead
    return moved


def _rank_rows(series: _RankSeries, raw: dict[str, Any], s: dict[str, Any], state: str,
               phase: str | None, ages: dict[str, float | None],
               publish: dict[str, Any] | None, proc: dict[str, Any]) -> Rows:
    """One rank's series, from what a collection took (built when a scrape reads them).
    Those of the status as parsed (``raw``: loss, throughput, counters), of the process,
    its state and phase are blocks kept while they stand; the beat's and the ages are
    made each time. No metric is in both, so a family's lines keep the ranks' order."""
    out = Rows()
    add, one = out.add, series.one
    metrics = value if isinstance(value := s.get("metrics"), dict) else {}
    counters = value if isinstance(value := s.get("counters"), dict) else {}
    blocks = out.blocks
    blocks.append(series.rows_of("status", (raw.get("metrics"), raw.get("counters"),
                                            raw.get("eval"), raw.get("backend"),
                                            raw.get("device"), raw.get("restart_count"),
                                            raw.get("last_nonfinite_loss_at"),
                                            raw.get("last_reduction_mismatch_at")),
                                 lambda rows: _status_rows(series, raw, rows)))
    blocks.append(series.one_hot("states", state))
    _numbers(out, series.beat_fields, s)
    add(one("trainwatch_rank_heartbeat_age_seconds"), ages["heartbeat"])
    add(one("trainwatch_rank_progress_age_seconds"), ages["progress"])
    add(one("trainwatch_rank_phase_age_seconds"), ages["phase"])
    if publish is not None:
        add(one("trainwatch_rank_publish_failing"), publish["failing"])
    if phase:
        blocks.append(series.one_hot("phases", phase))
    _numbers(out, series.beat_step_fields, metrics)
    _numbers(out, series.beat_counter_fields, counters)
    blocks.append(series.rows_of("process", (proc,),
                                 lambda rows: _process_rows(series, proc, rows)))
    return out


def _status_rows(series: _RankSeries, raw: dict[str, Any], out: Rows) -> None:
    """The rank's series of its status as parsed (what a beat does not replace)."""
    metrics = value if isinstance(value := raw.get("metrics"), dict) else {}
    out.add(series.info_series(raw.get("backend"), raw.get("device")), 1)
    _numbers(out, series.status_fields, raw)
    _numbers(out, series.step_fields, metrics)
    phases = metrics.get(PHASE_SECONDS_FIELD)
    if isinstance(phases, dict):
        for name, seconds in phases.items():
            name = str(name)
            out.add(series.phase(PHASE_TIME_METRIC, name),  # made for the phases timed
                    _num(seconds))
    _numbers(out, series.eval_fields,
             value if isinstance(value := raw.get("eval"), dict) else {})
    _numbers(out, series.counter_fields,
             value if isinstance(value := raw.get("counters"), dict) else {})


def _process_rows(series: _RankSeries, proc: dict[str, Any], out: Rows) -> None:
    add, one = out.add, series.one
    status = proc["status"]
    add(one("trainwatch_rank_up"), status not in ("gone", "zombie", "unknown")
        if status != "unknown" else None)
    out.pairs.extend((each, 1.0 if name == status else 0.0) for name, each in series.processes)
    add(one("trainwatch_process_cpu_seconds_total"), proc.get("cpu_seconds"))
    add(one("trainwatch_process_resident_memory_bytes"), proc.get("rss_bytes"))
    add(one("trainwatch_process_threads"), proc.get("threads"))
    add(one("trainwatch_process_cpu_contention_ratio"), proc.get("cpu_contention_ratio"))


@register("ranks", interval=1.0, timeout=5.0,
          options={"max_skipped_shown": 10, "process_every": 5.0, "status_every": 5.0})
class RanksCollector(Collector):
    def __init__(self, ctx, options):
        super().__init__(ctx, options)
        self.procs = ProcessTracker(ctx.config.proc_root)
        self.pids = HostPids(ctx.config.proc_root)  # ranks in a PID namespace of their own
        self._skip_seen: dict[str, set[tuple[str, int, int]]] = {}
        self._skip_total: dict[str, dict[str, int]] = {}  # run dir -> reason code -> count
        self._skip_recent: dict[str, deque] = {}
        self._seen: dict[tuple, _Seen] = {}
        self._looked: set[tuple] = set()
        self._series: dict[tuple, _RankSeries] = {}  # dropped with the rank
        self._series_used: set[tuple] = set()
        self._files: dict[str, RankFiles] = {}  # run dir -> its rank files, as last read
        self._last_run: float | None = None  # monotonic
        self._judge_after = 0.0               # monotonic: no verdicts before (re-observing)

    def collect(self) -> Result:
        result = Result()
        now, mono = time.time(), time.monotonic()
        self._notice_pause(mono)
        self.procs.begin()
        self.pids.begin()
        live: set[int] = set()
        self._looked = set()
        self._series_used = set()
        jobs = []
        runs = self.ctx.run_dirs()
        result.add("trainwatch_collector_run_dirs", len(runs), node=self.ctx.node)
        for run in runs:
            job = self._job(run, now, mono, result, live)
            if job is not None:
                jobs.append(job)
        for key in set(self._files) - {str(run.root) for run in runs}:
            del self._files[key]
        self.procs.end(live)
        self.pids.end()
        for seen in set(self._seen) - self._looked:  # ranks gone: forget what we saw
            del self._seen[seen]
        for label_key in set(self._series) - self._series_used:
            del self._series[label_key]
        result.data = {"time": now, "observed_mono": mono, "judge_after_mono": self._judge_after,
                       "jobs": jobs}
        return result

    # -- the agent's own time -------------------------------------------------------
    def _notice_pause(self, mono: float) -> None:
        """A long gap since the last run means this agent was paused (SIGSTOP, a VM
        pause, an overloaded node) or hung: what it remembers is old. Findings wait until
        it has looked again for a heartbeat's worth of time before judging anyone."""
        interval = float(self.ctx.config.collector("ranks")["interval"])
        last, self._last_run = self._last_run, mono
        if last is not None and mono - last > max(5.0, 3 * interval):
            stale = float(self.ctx.config.stall["heartbeat_stale_seconds"])
            self._judge_after = mono + stale + interval
            log.warning("agent was not running for %.1f s (paused?): re-observing the ranks "
                        "for %.1f s before judging stalls", mono - last, stale + interval)

    def _age(self, key: tuple, value: float | None, now: float, mono: float,
             tolerance: float = 0.0) -> float | None:
        """How old ``value`` (a rank's wall-clock timestamp) is, from observations.

        A new value is as old as the wall clock says, but never older than our previous
        look (it was written since): a clock jump or an agent pause cannot age it. A value
        seen before keeps ageing on the monotonic clock from when it was new.
        """
        if value is None:
            return None
        self._looked.add(key)
        seen = self._seen.get(key)
        if seen is None or abs(seen.value - value) > tolerance:
            age = max(0.0, now - value)
            if seen is not None:
                age = min(age, mono - seen.looked)
            self._seen[key] = _Seen(value, mono - age, mono)
            return age
        seen.looked = mono
        return mono - seen.anchor

    def _looks_old(self, s: dict[str, Any], metrics: dict[str, Any], state: str,
                   heartbeat_age: float | None, progress_age: float | None) -> bool:
        """Is anything about this rank late, so its process must be looked at now?

        A rank whose heartbeat and step are on time is alive and running: its process
        facts may be a few seconds old (``process_every``). A heartbeat two beats late, a
        step late by twice the last step time, or a rank that is not running is looked at
        in this very collection, well before the stall rule could call it stalled
        (``heartbeat_stale_seconds``; at least ``floor_seconds`` without a step).
        """
        if state != "running" or heartbeat_age is None:
            return True
        opts = self.ctx.config.stall
        beat = _num(s.get("heartbeat_interval")) or 1.0
        step = _num(metrics.get("step_time_seconds")) or 0.0
        if heartbeat_age > min(2 * beat, float(opts["heartbeat_stale_seconds"]) / 2):
            return True
        budget = max(float(opts["floor_seconds"]), float(opts["k"]) * step)
        return progress_age is not None and progress_age > min(max(2 * beat, 2 * step),
                                                                budget / 2)

    # ------------------------------------------------------------------------------
    def _job(self, run, now: float, mono: float, result: Result,
             live: set[int]) -> dict[str, Any] | None:
        key = str(run.root)
        files = self._files.get(key)
        if files is None:
            files = self._files[key] = RankFiles(float(self.options["status_every"]))
        statuses, beats = files.read(run, mono)
        info, info_skipped = self._run_info(run)
        if info_skipped is not None:
            statuses.skipped.append(info_skipped)
        # Unseen is not absent: what the agent may not read makes its health degraded.
        unreadable = [s.path for s in statuses.skipped if s.code == "permission_denied"]
        self._count_skipped(key, statuses.skipped)
        records = statuses.records  # typed and named after their rank (RunDir.statuses)
        # The run's one name (RunDir.run_name): run.json's, else what its ranks call it.
        job_name = str(info.get("job") or (records[0].get("job") if records else None)
                       or run.root.resolve().name)
        local = self._local(records, info)
        # Each local rank carries the job's timing summary: no other node's file is needed.
        timing = job_window({r["rank"]: r.get("timing") for r in local})
        skipped_by_reason = self._skip_total.get(key, {})
        # Every reason from 0, so increase() sees the first skip (a counter born at 1 shows none).
        for reason in SKIP_REASONS:
            result.add("trainwatch_collector_status_files_skipped_total",
                       skipped_by_reason.get(reason, 0), run=job_name, node=self.ctx.node,
                       reason=reason)
        result.add("trainwatch_collector_run_files_unreadable", len(unreadable), run=job_name,
                   node=self.ctx.node)
        ranks = []
        env: dict[int, dict[str, str]] = {}
        for status in sorted(local, key=lambda r: r["rank"]):
            rank = self._rank(key, status, beats.get(status["rank"]), now, mono, job_name,
                              result)
            ranks.append(rank)
            if isinstance(rank["pid"], int):  # the host's pid
                live.add(rank["pid"])
                env[rank["rank"]] = self.procs.env(rank["pid"])
        self._checkpoint(local, info, now, job_name, result)
        view = jobview.observe(
            result, run_key=key, job=job_name, node=self.ctx.node, info=info, records=records,
            beats=beats, age=lambda who, at: self._age(who, at, now, mono),
            stale_seconds=float(self.ctx.config.stall["heartbeat_stale_seconds"]))
        backends = sorted({r["backend"] for r in ranks if r.get("backend")})
        return {"job": job_name, "run_dir": key,
                "backend": backends[0] if len(backends) == 1 else (backends or None),
                "world_size": info.get("world_size") or next(
                    (r.get("world_size") for r in records), None),
                "status_files_skipped_total": sum(skipped_by_reason.values()),
                "status_files_skipped_by_reason": dict(sorted(skipped_by_reason.items())),
                "skipped": list(self._skip_recent.get(key, ())),
                "unreadable": unreadable,
                "timing": timing, "ranks": ranks, "env": env, "view": view,
                "checkpoint_dir": str(run.recorded_checkpoint_folders(info)[0])}

    def _run_info(self, run) -> tuple[dict[str, Any], Skipped | None]:
        """run.json, or {} and why not: permission denied is reported, never logged per run."""
        try:
            return read_record(run.run_file, RUN_FORMAT, root=run.root), None
        except SkippedFile as exc:
            return {}, Skipped(str(run.run_file), exc.detail, code=exc.reason)
        except FormatError:  # missing: a run that has not written it yet
            return {}, None

    def _checkpoint(self, local: list[dict[str, Any]], info: dict[str, Any], now: float,
                    job: str, result: Result) -> None:
        """Job-level checkpoint series from the ``checkpoint`` facts the checkpoint library
        publishes in each rank's status (absent: the job does not use it).

        Age: since the newest verified checkpoint any rank knows of, else (on rank 0's node)
        since the run started; only while a rank runs (a finished job needs none newer).
        Saves, failures, non-finite skips: the most any rank counted (rank 0 holds the save
        facts; a failed save is usually seen by every rank; every rank runs the guard).
        """
        facts = [r["checkpoint"] for r in local if isinstance(r.get("checkpoint"), dict)]
        if not facts:
            return
        labels = {"run": job, "node": self.ctx.node}
        for field, metric in _CHECKPOINT_COUNTERS.items():
            values = [_num(f.get(field)) for f in facts]
            result.add(metric, max((v for v in values if v is not None), default=None),
                       **labels)
        if not any(r.get("state", "running") == "running" for r in local):
            return
        # ``time`` is the newest verified save (or the resumed one); a later failure
        # (ok false) leaves it as it was. Rank 0 holds the save facts: a node without it
        # and without a known save has no age to report (CheckpointTooOld takes the min).
        saved = [_num(f.get("time")) for f in facts]
        since = max((t for t in saved if t is not None), default=None)
        if since is None and not any(r["rank"] == 0 for r in local):
            return
        if since is None:
            starts = [_num(r.get("started_at")) for r in local] + [_num(info.get("created_at"))]
            since = min((t for t in starts if t is not None), default=None)
        if since is not None:
            result.add("trainwatch_checkpoint_age_seconds", max(0.0, now - since), **labels)

    def _local(self, records: list[dict[str, Any]], info: dict[str, Any]) -> list[dict[str, Any]]:
        """Ranks of this node, by what each rank publishes: its node name and boot.

        A run dir on a shared filesystem holds every node's ranks, and another node's pid
        means nothing here (reported as dead, it could restart a healthy job). A rank
        naming this node is ours. A rank naming another is ours only from this very
        machine and boot, in a one-node job: the trainer's container has a hostname of its
        own. Only a status that names no node falls back to the job's shape: all ours in a
        one-node job (run.json's ``nnodes``, or the statuses naming one node), none in a
        job of several.
        """
        names = {self.ctx.node, socket.gethostname()}
        nnodes = info.get("nnodes")
        several = (isinstance(nnodes, int) and not isinstance(nnodes, bool) and nnodes > 1) \
            or len({r.get("node") for r in records}) > 1
        here = boot_id()
        return [r for r in records if _ours(r, names, here, several)]

    def _count_skipped(self, key: str, skipped) -> None:
        seen = self._skip_seen.setdefault(key, set())
        recent = self._skip_recent.setdefault(key, deque(maxlen=int(self.options["max_skipped_shown"])))
        totals = self._skip_total.setdefault(key, {})
        for item in skipped:
            try:
                st = os.lstat(item.path)  # the entry itself: never follow a hostile link
                version = (item.path, st.st_mtime_ns, st.st_size)
            except OSError:
                version = (item.path, 0, 0)
            if version in seen:
                continue
            seen.add(version)
            totals[item.code] = totals.get(item.code, 0) + 1
            recent.append({"path": item.path, "reason": item.reason, "code": item.code})
        if len(seen) > 10000:  # bounded memory for a directory that keeps producing junk
            seen.clear()

    def _rank(self, run_key: str, s: dict[str, Any], beat: dict[str, Any] | None, now: float,
              mono: float, job: str, result: Result) -> dict[str, Any]:
        label_key = (job, s["rank"], s.get("local_rank", ""))
        self._series_used.add(label_key)
        series = self._series.get(label_key)
        if series is None:
            series = self._series[label_key] = _RankSeries(label_values(
                {"run": job, "node": self.ctx.node, "rank": s["rank"],
                 "local_rank": s.get("local_rank", "")}))
        raw = s
        s, publish = merge_beat(s, beat)
        s = _on_our_clock(s, now, mono)
        metrics = value if isinstance(value := s.get("metrics"), dict) else {}
        state = value if isinstance(value := s.get("state"), str) else "running"
        phase = value if isinstance(value := s.get("phase"), str) else None
        heartbeat_at, progress_at = _num(s.get("heartbeat_at")), _num(s.get("last_progress_at"))
        phase_since = _num(s.get("phase_since"))
        who = (run_key, s["rank"], s.get("pid"))
        heartbeat_age = self._age(who + ("heartbeat",), heartbeat_at, now, mono)
        progress_age = self._age(who + ("progress",), progress_at or _num(s.get("started_at")),
                                 now, mono)
        # A phase's start is re-derived from the rank's clock offset on every write, so it
        # wobbles by microseconds: the same phase (name) within half a second is the same.
        phase_age = self._age(who + ("phase", phase), phase_since, now, mono, tolerance=0.5)
        late = self._looks_old(s, metrics, state, heartbeat_age, progress_age)
        pid, missing = self.pids.host_pid(s.get("pid"), s.get("pid_namespace"),
                                          s.get("process_created_at"))
        proc = {"status": missing} if pid is None else self.procs.inspect(
            pid, s.get("started_at"), created_at=s.get("process_created_at"),
            reuse_for=0.0 if late else float(self.options["process_every"]))
        ages = {"heartbeat": heartbeat_age, "phase": phase_age,
                "progress": progress_age if progress_at is not None else None}
        result.defer(lambda: _rank_rows(series, raw, s, state, phase, ages, publish, proc))
        return {
            "rank": s["rank"], "local_rank": s.get("local_rank"), "node": s.get("node"),
            # The host's pid (None: not found); the one the rank published, when in a
            # PID namespace of its own, is ``pid_in_namespace``.
            "pid": pid, "pid_in_namespace": s.get("pid") if pid != s.get("pid") else None,
            "state": state, "step": s.get("step"), "phase": phase,
            "phase_since": phase_since, "heartbeat_at": heartbeat_at,
            "last_progress_at": progress_at, "started_at": _num(s.get("started_at")),
            # Ages as observed by this agent (see _age), at result.data["observed_mono"].
            "heartbeat_age": heartbeat_age, "progress_age": progress_age, "phase_age": phase_age,
            "phase_budgets": declared_budgets(s.get("phase_budgets")), "publish": publish,
            "restart_count": s.get("restart_count"), "backend": s.get("backend"),
            "device": s.get("device"), "world_size": s.get("world_size"),
            "metrics": {k: metrics.get(k) for k in (
                "step", "loss", "step_time_seconds", "data_wait_seconds", "tokens_per_second",
                "samples_per_second", "memory_bytes")},
            "process": proc,
            "replicas": digests(s.get("replicas")),  # parameter digests (collector replicas)
            # {group: (enqueued, completed)} from this process's beat: who waits in which
            # collective (the stall incident's culprit), or None
            "collectives": read_field(beat.get("collectives")) if publish is not None
            and beat is not None else None,
        }
