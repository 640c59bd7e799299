"""Read a run directory into a timeline of attempts: what ran when, and how each attempt ended.

An *attempt* is one generation of rank processes: every restart (torchrun's, the
controller's, or a new ``trainwatch train``) starts a new one, and its ranks journal
``rank_started``. Step timing comes from rank 0's metrics log (under DDP every rank's
step takes as long as the slowest rank's); the other ranks are only counted, to
cross-check the world size. Nothing here guesses: what the run directory does not say
stays ``None`` and a warning says why.

The metrics log is streamed: each line is parsed and dropped, and a step keeps five
numbers in columns (``StepLog``, report/steplog.py) that go to a temporary file a block
at a time, so memory does not grow with the run's length. ``StepExec`` objects are made
on demand.
"""

from __future__ import annotations

import bisect
import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence, cast

import numpy as np

from trainwatch.rundir.attempts import generations, rank_of
from trainwatch.contract.layout import JOB_LOG, TORCHRUN_LOG
from trainwatch.errors import ConfigError, FormatError
from trainwatch.report.clocks import by_source, clock_shifts, writer_shift
from trainwatch.report.journal_events import Events, Journal
from trainwatch.report.not_running import death_time, not_running, supervisor_deaths
from trainwatch.report import steplog
from trainwatch.report.steplog import StepLog, step_numbers
from trainwatch.report.startup_deaths import StartupDeath, job_at
from trainwatch.report.vanished import vanished
from trainwatch.rundir.safe_read import Skipped
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.jsonl import iter_jsonl
from trainwatch.rundir.torchrun_log import FAILED_WORKER, failure_times

# Events that say an attempt's processes are gone (or going): its end marker.
TERMINAL_EVENTS = ("failed", "job_stopped", "job_exited", "launcher_exited")
# Events that bound the run's span; alert and controller bookkeeping does not (an alert
# may resolve minutes after the job exited, when no accelerator is held any more).
ENGINE_LIFECYCLE = ("job_started", "job_stopped", "job_exited")


@dataclass
class StepExec:
    """One execution of a training step by rank 0 (a step may run in several attempts)."""

    step: int
    start: float
    end: float
    data_wait: float
    tokens: float | None
    attempt: int | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


def exec_of(log: StepLog, i: int) -> StepExec:
    """Execution ``i`` of the log as an object."""
    row = log.row(i)
    tokens = float(row["tokens"])
    return StepExec(int(row["step"]), float(row["start"]), float(row["end"]),
                    float(row["wait"]), None if tokens != tokens else tokens, log.attempt_of(i))


class StepRange(Sequence):
    """Steps ``lo``..``hi`` of a StepLog as a read-only sequence of StepExec (made on demand)."""

    def __init__(self, log: StepLog, lo: int, hi: int):
        self.log, self.lo, self.hi = log, lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = self.hi - self.lo
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return exec_of(self.log, self.lo + i)

    def __iter__(self) -> Iterator[StepExec]:
        return (exec_of(self.log, i) for i in range(self.lo, self.hi))

    def step_numbers(self) -> Iterator[int]:
        """The step numbers in order, read a block at a time."""
        return step_numbers(self.log, self.lo, self.hi)


@dataclass
class Attempt:
    index: int
    started_at: float                      # first rank_started of this generation
    restart_count: int | None              # torchrun's TORCHELASTIC_RESTART_COUNT
    restarted_by: str | None               # None for the first (trainwatch/rundir/attempts.py)
    ranks: dict[int, int | None] = field(default_factory=dict)  # rank -> pid
    # journal events in its window (report/journal_events.py; a list where made by hand)
    events: Sequence[dict[str, Any]] = field(default_factory=list)
    execs: StepRange = field(default_factory=lambda: StepRange(StepLog(), 0, 0))  # its steps
    # its evaluation records in file order, step and time (of a step's several records the
    # last counts): two numbers each, however many the run has
    eval_steps: array = field(default_factory=lambda: array("q"))
    eval_times: array = field(default_factory=lambda: array("d"))
    # start, end, start, end... of each evaluation whose record says how long it took
    # (``seconds``): placed by itself, before the first step too (a loop that evaluates first)
    eval_spans: array = field(default_factory=lambda: array("d"))
    resumed_from: int | None = None        # the step this attempt started at
    resume_source: str | None = None       # which evidence said so
    resumed_with: str | None = None        # "memory snapshot" or "checkpoint" (state_from)
    ended_at: float | None = None          # end marker (see end_marker)
    outcome: str = "running"               # finished | stopped | interrupted | ended | running
    exits: list[dict[str, Any]] = field(default_factory=list)   # torchrun's failed workers
    failure_seen_at: float | None = None   # when torchrun logged the first of them
    vanished: list[dict[str, Any]] = field(default_factory=list)  # gone, status says running
    world_size: int | None = None          # its own: a resume may change it (_world_size)

    def named(self, *names: str) -> list[dict[str, Any]]:
        return list(self.each(*names))

    def each(self, *names: str) -> Iterator[dict[str, Any]]:
        """Its events called one of ``names``, one at a time (routine ones made as read)."""
        return _each(self.events, *names)


@dataclass
class Timeline:
    run_dir: Path
    info: dict[str, Any]
    job: str
    world_size: int | None
    start: float
    end: float
    attempts: list[Attempt]
    events: Sequence[dict[str, Any]]     # report/journal_events.py
    not_running: list[tuple[float, float]]
    state: str                             # finished | ended | running
    skipped_journal: list[Skipped]
    skipped_metrics: list[Skipped]
    warnings: list[str]
    steps: StepLog = field(default_factory=StepLog)
    # supervisors that died while no rank of theirs ran (report/startup_deaths.py)
    startup_deaths: list[StartupDeath] = field(default_factory=list)

    @property
    def execs(self) -> StepRange:
        """Every step execution, in end-time order (each attempt's are contiguous)."""
        return StepRange(self.steps, 0, len(self.steps))

    def config(self, section: str, key: str) -> int | None:
        """An integer from run.json's trainer config (e.g. train.steps), or None."""
        config = self.info.get("config")
        part = config.get(section) if isinstance(config, dict) else None
        value = part.get(key) if isinstance(part, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None


# --------------------------------------------------------------------------- reading

def check_run_dir(run: RunDir) -> RunDir:
    """The run directory, or a ConfigError (exit 2) saying why it is not one."""
    if not run.exists():
        raise ConfigError("no such run directory", file=str(run.root))
    if not (run.run_file.exists() or run.journal_file.exists() or run.metrics_dir.is_dir()):
        raise ConfigError("not a trainwatch run directory (no run.json, journal.jsonl or "
                          "metrics/)", file=str(run.root))
    return run


def number(value: Any) -> float | None:
    """A finite JSON number as float, else None (JSON readers accept NaN and Infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _events(run: RunDir) -> tuple[Events, list[Skipped], dict[str, float]]:
    """The journal's events in time order, on one clock per machine (report/clocks.py), and
    the seconds each source's times were moved by. Streamed: routine events are kept as
    a few numbers as they are read (report/journal_events.py)."""
    path = run.journal_file
    journal = Journal()
    read = array("q")  # in file order
    skipped: list[Skipped] = []
    not_events: list[Skipped] = []  # after the lines skipped as they were read
    for _, record in iter_jsonl(path, skipped, run.root):
        if not isinstance(record.get("event"), str) or number(record.get("time")) is None:
            not_events.append(Skipped(str(path), "not a journal event (no event name or time)"))
            continue
        record["time"] = float(record["time"])
        read.append(journal.add(record))
    skipped += not_events
    in_file_order = Events(journal, read)
    shift = clock_shifts(in_file_order)
    if shift:
        for ref in read:
            seconds = writer_shift(journal[ref], shift)
            if seconds is not None:
                journal.move(ref, seconds)
    # stable: same-time events keep their file order
    times = np.frombuffer(in_file_order.times(), dtype=np.float64)
    order = np.argsort(times, kind="stable")
    refs = array("q")
    refs.frombytes(np.frombuffer(read, dtype=np.int64)[order].tobytes())
    return Events(journal, refs), skipped, by_source(shift)


def _rank0_metrics(run: RunDir, moved: float = 0.0
                   ) -> tuple[StepLog, tuple[array, array, array], list[Skipped]]:
    """Stream rank 0's metrics log into a StepLog; evaluations as columns of step, time
    and seconds (NaN: not said). ``moved``: seconds to add to rank 0's times (its wall
    clock disagreed with its machine's)."""
    log, evals = StepLog(), (array("q"), array("d"), array("d"))
    skipped: list[Skipped] = []
    where = str(run.metrics_file(0))
    columns = tuple(column.append for column in log.tail)
    pending, block = log.tail[0], steplog.BLOCK
    for lineno, record in iter_jsonl(run.metrics_file(0), skipped, run.root):
        if _plain_step(record, moved, columns):
            if len(pending) >= block:
                log.maybe_spill()
            continue
        kind, step, when = record.get("kind"), record.get("step"), number(record.get("time"))
        if when is not None:
            when += moved
        if kind not in ("step", "eval"):
            continue  # other kinds are the loop's own records, not ours to judge
        if not isinstance(step, int) or isinstance(step, bool) or when is None:
            skipped.append(Skipped(where, f"{kind} record without an integer step and a time",
                                   lineno))
            continue
        if kind == "eval":
            seconds = number(record.get("seconds"))
            if not -_INT64 <= step < _INT64:
                skipped.append(Skipped(where, "step number out of range", lineno))
                continue
            evals[0].append(step)
            evals[1].append(when)
            evals[2].append(seconds if seconds is not None and seconds > 0 else math.nan)
            continue
        seconds = number(record.get("step_time_seconds"))
        if seconds is None or seconds < 0:
            skipped.append(Skipped(where, "step record without step_time_seconds", lineno))
            continue
        wait = number(record.get("data_wait_seconds")) or 0.0
        try:
            log.append(step, when - seconds, when, min(max(wait, 0.0), seconds),
                       number(record.get("tokens")))
        except OverflowError:
            skipped.append(Skipped(where, "step number out of range", lineno))
    log.sort()
    return log, evals, skipped


def _plain_step(record: dict[str, Any], moved: float, columns: tuple) -> bool:
    """Append a step record the telemetry wrote (finite floats, an int step and tokens in
    range) straight to the columns, as ``_rank0_metrics`` would; False for anything else,
    which it then reads field by field. One call instead of a dozen per step of the log."""
    get = record.get
    step, when, seconds, wait = get("step"), get("time"), get("step_time_seconds"), get(
        "data_wait_seconds")
    if not (get("kind") == "step" and type(step) is int and type(when) is float
            and type(seconds) is float and type(wait) is float and seconds >= 0.0
            and -math.inf < when + seconds + wait < math.inf  # all finite
            and -_INT64 <= step < _INT64):
        return False
    tokens = get("tokens")
    if type(tokens) is int and -_INT64 <= tokens < _INT64:
        tokens = float(tokens)
    elif tokens is not None and not (type(tokens) is float and tokens - tokens == 0.0):
        return False  # not a finite number: number() decides
    when += moved
    add_step, add_start, add_end, add_wait, add_tokens = columns
    add_step(step)
    add_start(when - seconds)
    add_end(when)
    add_wait(wait if 0.0 <= wait <= seconds else min(max(wait, 0.0), seconds))
    add_tokens(math.nan if tokens is None else tokens)
    return True


_INT64 = 1 << 63


def _torchrun_exits(run: RunDir) -> list[dict[str, Any]]:
    """Workers torchrun reported as failed (exit code, local rank, pid); [] without a log."""
    found: dict[tuple[int, int, int], dict[str, Any]] = {}
    for name in (TORCHRUN_LOG, JOB_LOG):
        try:
            text = run.log_text(name)
        except (OSError, FormatError):
            continue
        seen = failure_times(text)
        for code, local, pid in FAILED_WORKER.findall(text):
            key = (int(code), int(local), int(pid))
            found.setdefault(key, {"exitcode": key[0], "local_rank": key[1], "pid": key[2],
                                   "seen_at": seen.get(key[2])})
    return list(found.values())


# --------------------------------------------------------------------------- attempts

def _group_attempts(events: Sequence[dict[str, Any]]) -> list[Attempt]:
    """One attempt per generation of rank processes (trainwatch/rundir/attempts.py). Only
    its starts and the controller's are read: the others are not made into dicts."""
    return [Attempt(i, g.started_at, g.restart_count, g.restarted_by, ranks=g.ranks)
            for i, g in enumerate(generations(list(_each(events, "rank_started",
                                                         "job_started"))))]


def _window(attempts: list[Attempt], starts: list[float], t: float) -> Attempt | None:
    """The attempt running at time ``t`` (the latest one started at or before it)."""
    i = bisect.bisect_right(starts, t)
    return attempts[i - 1] if i else None


def _happened(event: dict[str, Any]) -> float:
    """When what an event records happened: a lost node is journaled after it has been
    silent a while (control/node_watch.py), a dead supervisor when the next one starts
    (its last heartbeat is when it died): each belongs to the attempt it ended."""
    if event["event"] == "supervisor_died":
        died = death_time(event)
        return event["time"] if died is None else died
    silent = event.get("silent_seconds") if event["event"] == "node_lost" else None
    return event["time"] - silent if isinstance(silent, (int, float)) \
        and not isinstance(silent, bool) and silent > 0 else event["time"]


def _startup_deaths(events: Sequence[dict[str, Any]], attempts: list[Attempt],
                    starts: list[float]) -> list[StartupDeath]:
    """The supervisor deaths no attempt's end was: before the first attempt, or after the
    attempt it fell in had ended (taken out of that attempt's events: not its cause)."""
    lone = []
    for e in _each(events, "supervisor_died"):
        died = _happened(e)
        attempt = _window(attempts, starts, died)
        where = "before" if attempt is None else job_at(attempt.events, died, TERMINAL_EVENTS)
        if attempt is not None and (where == "running" or e.get("node") in {
                x.get("lost_node") for x in attempt.named("node_lost")}):
            continue  # the attempt's own end (or its lost node's)
        if attempt is not None:
            attempt.events = (attempt.events.without(e) if isinstance(attempt.events, Events)
                              else [x for x in attempt.events if x is not e])
        after = attempt.index if attempt is not None and where == "after" else None
        lone.append(StartupDeath(e, died, after))
    return lone


def _each(events: Sequence[dict[str, Any]], *names: str) -> Iterator[dict[str, Any]]:
    """The events called one of ``names``, in order (routine ones not made unless asked)."""
    if isinstance(events, Events):
        return events.each(names)
    return (e for e in events if e["event"] in names)


def _resume_point(attempt: Attempt) -> None:
    for e in attempt.named("checkpoint_resumed"):
        if isinstance(e.get("step"), int) and rank_of(e) in (0, None):
            attempt.resumed_from, attempt.resume_source = e["step"], "checkpoint_resumed"
            attempt.resumed_with = e.get("state_from") if isinstance(
                e.get("state_from"), str) else "checkpoint"
            return
    for e in attempt.named("run_started", "restarted"):
        if isinstance(e.get("start_step"), int):
            attempt.resumed_from, attempt.resume_source = e["start_step"], e["event"]
            return
    if attempt.execs:
        attempt.resumed_from, attempt.resume_source = attempt.execs[0].step, "first_step"


def _end_marker(attempt: Attempt, next_start: float | None,
                deaths: dict[int, float]) -> float | None:
    """First sign that the attempt's processes were gone, after its last completed step:
    an end event, or the death of the supervisor that ran it (``supervisor_deaths``)."""
    after = attempt.execs[-1].end if attempt.execs else attempt.started_at
    ends = [e["time"] for e in attempt.named(*TERMINAL_EVENTS)] + [
        deaths[id(e)] for e in attempt.named("supervisor_died") if id(e) in deaths]
    return min((t for t in ends if t >= after), default=next_start)


def _outcome(attempt: Attempt, is_last: bool, statuses: list[dict[str, Any]]) -> str:
    # An action that started the job again (its action_taken names the new pid) threw the
    # attempt's work away even if its ranks had finished (a short run's NaN rollback that
    # came while torchrun was still on its way out): that is an incident, not an end.
    restarted = not is_last and any(e.get("pid") is not None
                                    for e in attempt.named("action_taken"))
    if attempt.named("finished") and not restarted:
        return "finished"
    if any(e.get("reason") == "stop" for e in attempt.named("checkpoint_saved")):
        return "stopped"  # SIGTERM honoured: saved where it stopped, nothing to redo
    if not is_last:
        return "interrupted"
    if attempt.named(*TERMINAL_EVENTS, "supervisor_died"):
        return "ended"
    # Ended when no rank says running, or every one that does is gone (``vanished``).
    running = sum(s.get("state") == "running" for s in statuses)
    return "ended" if statuses and len(attempt.vanished) == running else "running"


# --------------------------------------------------------------------------- the span

def _in_span(e: dict[str, Any]) -> bool:
    return e["event"] in ENGINE_LIFECYCLE or rank_of(e) is not None \
        or e.get("source") == "launcher"


# --------------------------------------------------------------------------- assembly

def read_timeline(run: RunDir) -> Timeline:
    """Everything the report needs from one run directory (ConfigError if it is not one)."""
    check_run_dir(run)
    warnings: list[str] = []
    info = run.run_info() or {}
    if not info:
        warnings.append(f"{run.run_file}: missing or unreadable; world size from the journal")
    events, skipped_journal, moved = _events(run)
    log, evals, skipped_metrics = _rank0_metrics(run, moved.get("rank0", 0.0))
    for source, seconds in sorted(moved.items()):
        warnings.append(f"{source}'s wall clock is {abs(seconds):.1f} s "
                        f"{'behind' if seconds > 0 else 'ahead of'} its machine's: its times "
                        "were read on the machine's clock")
    if log.spill_error is not None:
        warnings.append(f"rank 0's steps held in memory: no temporary file ({log.spill_error})")
    execs = StepRange(log, 0, len(log))
    if not events and not execs:
        raise ConfigError("nothing to report: no journal events and no rank 0 metrics",
                          file=str(run.root))

    if not execs:
        warnings.append(f"{run.metrics_file(0)}: no step records; step time cannot be measured")
    attempts = _group_attempts(events)
    if not attempts:
        warnings.append("no rank_started events: the run is read as a single attempt")
        first = min([e["time"] for e in events] + ([log.column_min("start")] if log else []))
        attempts = [Attempt(0, first, None, None)]
    starts = [a.started_at for a in attempts]
    journal = events.journal
    for attempt in attempts:
        attempt.events = Events(journal)
    for ref in events.refs:  # a routine event happened when it was journaled
        when = journal.time(ref) if ref < 0 else _happened(journal.dicts[ref])
        if (owner := _window(attempts, starts, when)) is not None:
            cast(Events, owner.events).refs.append(ref)
    lone = _startup_deaths(events, attempts, starts)
    # Steps are in end-time order, so each attempt's are one contiguous range: those that
    # ended before its successor started (the first attempt also takes earlier ones).
    bounds = [0] + [bisect.bisect_left(log.end, a.started_at) for a in attempts[1:]] + [len(log)]
    log.attempt_starts = bounds[:-1]
    for attempt, lo, hi in zip(attempts, bounds, bounds[1:]):
        attempt.execs = StepRange(log, lo, hi)
    for step, when, took in zip(*evals):
        if (owner := _window(attempts, starts, when)) is not None:
            owner.eval_steps.append(step)
            owner.eval_times.append(when)
            if took == took:  # not NaN: the record said how long it took
                owner.eval_spans.extend((when - took, when))
    exits = _torchrun_exits(run)
    statuses = run.statuses().records
    deaths = supervisor_deaths(events, log.end)
    for i, attempt in enumerate(attempts):
        nxt = attempts[i + 1].started_at if i + 1 < len(attempts) else None
        _resume_point(attempt)
        attempt.ended_at = _end_marker(attempt, nxt, deaths)
        if nxt is None:  # the statuses are the newest attempt's ranks
            attempt.vanished = vanished(statuses)
        attempt.outcome = _outcome(attempt, nxt is None, statuses)
        pids = {pid: rank for rank, pid in attempt.ranks.items() if pid is not None}
        attempt.exits = [{**x, "rank": pids[x["pid"]]} for x in exits if x["pid"] in pids]
        # To the second: the failure was seen before the next one. One before the attempt
        # began is another clock (a time zone), not evidence.
        seen = [x["seen_at"] + 1 for x in attempt.exits if x["exitcode"] != 0
                and x["seen_at"] is not None and x["seen_at"] + 1 >= attempt.started_at]
        attempt.failure_seen_at = min(seen, default=None)
        if any(x["rank"] == 0 and x["exitcode"] < 0 for x in attempt.exits):
            warnings.append(f"attempt {i}: rank 0 was killed by a signal; steps it completed "
                            "in its last heartbeat interval may be missing from its metrics "
                            "log (recomputed steps may be undercounted)")

    span = events.times(_in_span)
    firsts = ([min(span)] if span else []) + ([log.column_min("start")] if log else [])
    start = min(firsts) if firsts else min(events.times())
    last = (([max(span)] if span else []) + ([log.end[-1]] if log else [])
            + ([max(evals[1])] if evals[1] else []))
    end = max(last) if last else max(events.times())
    last_attempt = attempts[-1]
    if last_attempt.ended_at is None:
        last_attempt.ended_at = end
    state = {"finished": "finished", "running": "running"}.get(last_attempt.outcome, "ended")
    world_size = _world_size(info, attempts, run, warnings)
    return Timeline(run.root, info, str(info.get("job") or run.root.resolve().name), world_size,
                    start, end, attempts, events, not_running(events, start, end, deaths, log.end),
                    state,
                    skipped_journal, skipped_metrics, warnings, log, lone)


def _world_size(info: dict[str, Any], attempts: list[Attempt],
                run: RunDir, warnings: list[str]) -> int | None:
    """Each attempt's world size (what its rank 0 said at the start, else the ranks that
    journaled rank_started, else run.json's), and the run's: the newest attempt's, which
    run.json (written at each launch) should repeat. A resume at another world size
    changes it between attempts; that is not a warning."""
    declared = info.get("world_size") if isinstance(info.get("world_size"), int) else None
    for attempt in attempts:
        said = [e["world_size"] for e in attempt.named("run_started", "restarted")
                if isinstance(e.get("world_size"), int) and not isinstance(e["world_size"], bool)]
        attempt.world_size = said[-1] if said else (len(attempt.ranks) or declared)
        if said and len(attempt.ranks) != said[-1]:
            warnings.append(f"attempt {attempt.index}: {len(attempt.ranks)} of {said[-1]} "
                            "ranks journaled rank_started")
    known = [a.world_size for a in attempts if a.world_size is not None]
    newest = known[-1] if known else None
    world = newest if newest is not None else declared
    if world is None:
        warnings.append("world size unknown (no run.json, no run_started event)")
        return None
    if declared is not None and newest is not None and declared != newest:
        warnings.append(f"run.json says world size {declared}, rank 0 of the newest attempt "
                        f"reported {newest}")
    logs = run.ranks_with_metrics()
    if logs and len(logs) != max(known or [world]):
        warnings.append(f"{len(logs)} rank metrics logs for a world size of "
                        f"{max(known or [world])}")
    return world
