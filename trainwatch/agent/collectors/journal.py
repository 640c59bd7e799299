"""Journal: what each watched run's journal says happened, as counters Grafana can plot.

Alerts fired (``alert_firing``), actions taken or skipped (``action_taken`` /
``action_skipped``), restarts (torchrun's ``restarted``, the controller's ``job_started``
after its first attempt), the newest checkpoint save's write and blocking time
(``checkpoint_saved``, mirror copies left out), and whether the run's supervisor stopped it
(``controller_stopped`` after the last start), or a person closed it (``run_closed``,
``trainwatch close``): ranks SIGKILLed after the stop's grace period, or gone with a
rebooted node, keep a ``running`` status, and such a run is over, not down.

The journal is tailed, not re-read: the byte offset per file is remembered and at most
``max_bytes_per_run`` are read per run and collection (a long journal is caught up over
several runs). A last line without its newline is left for the next read, so a line
being appended is counted once, when whole. A file that shrank, was replaced (another
inode) or whose first bytes changed is read again from its start, adding to the totals:
they never go down while the agent runs. A new agent (or a reload) counts from the
journal's first line, and a run's series appear only once its journal was read to the
end: to Prometheus an agent restart then shows the same totals again, not a counter
climbing from 0 (which rate() and increase() would take for a burst of events).

The journal is the run's record (report, diagnose and the next supervisor read it), and
trainwatch only ever appends to it: a journal found replaced, truncated or rewritten, or
gone, while the run goes on (not after its supervisor stopped it, nor with its whole run
directory) lost what it said, and one the agent may not read (permission denied, not a
regular file) hides what it says. Both are exported
(``trainwatch_collector_journal_replaced_total``, ``trainwatch_collector_journal_unreadable``),
said in /status (a health reason, a replacement for ``REPLACED_SHOWN_SECONDS``) and warned
of (TrainwatchJournalUnreliable).

Torn, alien (not an object, unknown record version, no event name) and overlong lines are
skipped, counted (trainwatch_collector_journal_lines_skipped_total) and the last few
listed in /status. Labels stay bounded: alert names outside the rules set and action
names outside the known actions are kept up to ``max_extra_names`` each per run, then
become ``other``; so does a severity outside critical/warning/info.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from trainwatch.agent.registry import Collector, Result, register
from trainwatch.contract.alerts import ACTIONS, SEVERITIES, alert_catalog
from trainwatch.contract.layout import CLOSED_EVENT
from trainwatch.rundir.safe_read import SkippedFile, open_run_file
from trainwatch.rundir.jsonl import parse_jsonl_pieces

RESTART_KINDS = ("torchrun", "controller")
# After a supervisor stopped a run, or a person closed it (``trainwatch close``: its job is
# gone, e.g. the node rebooted), any of START_EVENTS makes it live again.
STOP_EVENTS = frozenset({"controller_stopped", CLOSED_EVENT})
START_EVENTS = frozenset({"controller_started", "job_started", "launcher_started", "run_started",
                          "rank_started", "restarted"})
OTHER = "other"
NO_ACTION = "none"  # action_skipped without an action request (e.g. a malformed delivery)
MIN_READ_BYTES = 1024
REPLACED_SHOWN_SECONDS = 30 * 60  # /status names a replaced journal this long
_HEAD_BYTES = 256   # a file's first bytes, compared on every read to notice a rewrite
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class _Save(TypedDict):
    """The last checkpoint save seen: when, and how long it took (None when not reported)."""

    time: float
    write_seconds: float | None
    blocking_seconds: float | None


@dataclass
class _Tail:
    """How far one run's journal has been read, and what it said so far."""

    file_id: tuple[int, int] | None = None
    head: bytes = b""
    offset: int = 0
    line: int = 0                   # lines consumed in the current file (for /status)
    in_long_line: bool = False      # inside a line longer than the read cap: drop its rest
    caught_up: bool = False         # read to the end at least once since the agent started
    reopened: int = 0               # times the file was found truncated or replaced
    replaced: int = 0               # ...of them while the run went on (its record lost)
    replaced_at: float | None = None
    error: str | None = None
    alerts: Counter = field(default_factory=Counter)     # (alertname, severity) -> n
    taken: Counter = field(default_factory=Counter)      # action -> n
    skipped_actions: Counter = field(default_factory=Counter)
    restarts: Counter = field(default_factory=Counter)   # kind -> n
    lines_skipped: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=10))
    extra: dict[str, set[str]] = field(default_factory=dict)  # label -> unknown names kept
    last_save: _Save | None = None
    supervisor_stopped: bool = False  # the last start was followed by one of STOP_EVENTS

    def start_over(self, file_id: tuple[int, int] | None, root: Path | None = None) -> None:
        """A new file (rotated, truncated, rewritten): read it from the start, keep totals.
        ``root``: the run directory, which must still be there for the loss to count."""
        if self.file_id is not None:
            self.reopened += 1
            if not self.supervisor_stopped and root is not None and root.is_dir():
                self.replaced += 1
                self.replaced_at = time.time()
        self.file_id, self.head, self.offset, self.line = file_id, b"", 0, 0
        self.in_long_line = False


@register("journal", interval=5.0, timeout=10.0, first_delay=2.0, options={
    "max_bytes_per_run": 4 * 1024 * 1024,  # journal bytes read per run and collection
    "max_extra_names": 20,                 # alert/action names outside the known ones, per run
    "max_skipped_shown": 10,
})
class JournalCollector(Collector):
    def __init__(self, ctx, options):
        super().__init__(ctx, options)
        self.tails: dict[str, _Tail] = {}
        self.rule_alerts = alert_catalog()
        self.known_names = {"alertname": {name for name, _ in self.rule_alerts},
                            "action": set(ACTIONS) | {NO_ACTION}}
        self.cap = max(MIN_READ_BYTES, int(options["max_bytes_per_run"]))

    def collect(self) -> Result:
        result = Result()
        ranks = self.ctx.store.data("ranks") or {}
        jobs = {j["run_dir"]: j["job"] for j in ranks.get("jobs", [])}
        summaries = {}
        watched = set()
        for run in self.ctx.run_dirs():
            key = str(run.root)
            watched.add(key)
            tail = self.tails.get(key)
            if tail is None:
                tail = self.tails[key] = _Tail(
                    recent=deque(maxlen=int(self.options["max_skipped_shown"])))
            self._read(run.journal_file, tail, run.root)
            job = jobs.get(key) or run.run_name()
            # Unseen is not empty: said from the first look, caught up or not.
            result.add("trainwatch_collector_journal_unreadable", tail.error is not None,
                       run=str(job), node=self.ctx.node)
            if tail.caught_up:
                self._export(tail, str(job), result)
            summaries[key] = {"job": job, "path": str(run.journal_file),
                              "offset": tail.offset, "caught_up": tail.caught_up,
                              "reopened_total": tail.reopened,
                              "replaced_total": tail.replaced,
                              "replaced_at": tail.replaced_at,
                              "lines_skipped_total": tail.lines_skipped,
                              "skipped": list(tail.recent), "error": tail.error,
                              "supervisor_stopped": tail.supervisor_stopped}
        for key in set(self.tails) - watched:  # run dir no longer watched
            del self.tails[key]
        result.data = summaries
        return result

    # -- reading -----------------------------------------------------------------------
    def _read(self, path: Path, tail: _Tail, root: Path) -> None:
        """Consume the whole lines after ``tail.offset``, at most ``self.cap`` bytes."""
        try:
            fd, _ = open_run_file(path, root)  # regular files only: a FIFO never blocks us
            with os.fdopen(fd, "rb") as fh:
                fd = fh.fileno()
                st = os.fstat(fd)
                file_id = (st.st_dev, st.st_ino)
                if (file_id != tail.file_id or st.st_size < tail.offset
                        or (tail.head and os.pread(fd, len(tail.head), 0) != tail.head)):
                    tail.start_over(file_id, root)
                fh.seek(tail.offset)
                chunk = fh.read(self.cap)
                self._consume(path, chunk, tail)
                if len(tail.head) < min(_HEAD_BYTES, tail.offset):
                    tail.head = os.pread(fd, min(_HEAD_BYTES, tail.offset), 0)
        except FileNotFoundError:  # no journal yet, or removed: the next file starts over
            tail.start_over(None, root)
            tail.caught_up, tail.error = True, None
            return
        except SkippedFile as exc:
            tail.error = exc.detail
            return
        except OSError as exc:
            tail.error = f"unreadable ({exc.strerror or exc})"
            return
        tail.error = None
        if len(chunk) < self.cap:  # reached the end (a torn last line waits for its newline)
            tail.caught_up = True

    def _consume(self, path: Path, chunk: bytes, tail: _Tail) -> None:
        end = chunk.rfind(b"\n")
        if end < 0:
            if tail.in_long_line or len(chunk) >= self.cap:
                if not tail.in_long_line:
                    tail.line += 1
                    self._skip(path, tail, f"line longer than {self.cap} bytes")
                tail.in_long_line = True
                tail.offset += len(chunk)
            return
        lines = chunk[:end].split(b"\n")
        tail.offset += end + 1
        if tail.in_long_line:  # the end of a line already skipped as too long
            lines = lines[1:]
            tail.in_long_line = False
        for line in lines:
            tail.line += 1
            for record, reason in parse_jsonl_pieces(line):
                if record is not None and not isinstance(record.get("event"), str):
                    reason = "no event name"
                if reason is not None:
                    self._skip(path, tail, reason)
                elif record is not None:
                    self._count(record, tail)

    def _skip(self, path: Path, tail: _Tail, reason: str) -> None:
        tail.lines_skipped += 1
        tail.recent.append({"path": str(path), "line": tail.line, "reason": reason})

    # -- counting ----------------------------------------------------------------------
    def _count(self, record: dict[str, Any], tail: _Tail) -> None:
        event = record["event"]
        if event in STOP_EVENTS or event in START_EVENTS:
            tail.supervisor_stopped = event in STOP_EVENTS
        if event == "alert_firing":
            severity = record.get("severity")
            tail.alerts[(self._name(tail, "alertname", record.get("alert")),
                         severity if severity in SEVERITIES else OTHER)] += 1
        elif event in ("action_taken", "action_skipped"):
            action = record.get("action")
            counter = tail.taken if event == "action_taken" else tail.skipped_actions
            counter[self._name(tail, "action", NO_ACTION if action is None else action)] += 1
        elif event == "restarted":
            tail.restarts["torchrun"] += 1
        elif event == "job_started":
            attempt = record.get("attempt")
            if isinstance(attempt, int) and not isinstance(attempt, bool) and attempt > 1:
                tail.restarts["controller"] += 1
        elif event == "checkpoint_saved" and "copy" not in record:
            when = _num(record.get("time"))
            if when is not None and (tail.last_save is None or when >= tail.last_save["time"]):
                tail.last_save = {"time": when,
                                  "write_seconds": _num(record.get("write_seconds")),
                                  "blocking_seconds": _num(record.get("blocking_seconds"))}

    def _name(self, tail: _Tail, label: str, value: Any) -> str:
        """``value`` if known, or one of the first ``max_extra_names`` others, else 'other'."""
        if isinstance(value, str) and value in self.known_names[label]:
            return value
        if not isinstance(value, str) or not _NAME.match(value):
            return OTHER
        kept = tail.extra.setdefault(label, set())
        if value in kept or len(kept) < int(self.options["max_extra_names"]):
            kept.add(value)
            return value
        return OTHER

    def _export(self, tail: _Tail, job: str, result: Result) -> None:
        """Every counter of the run, the rules' alerts and the known actions at 0 too: a
        series that appears only at its first event hides that event from increase()."""
        labels = {"run": job, "node": self.ctx.node}
        for name, severity in sorted(set(self.rule_alerts) | set(tail.alerts)):
            result.add("trainwatch_alert_fired_total", tail.alerts[(name, severity)], **labels,
                       alertname=name, severity=severity)
        for metric, counter in (("trainwatch_action_taken_total", tail.taken),
                                ("trainwatch_action_skipped_total", tail.skipped_actions)):
            for action in sorted(set(ACTIONS) | set(counter)):
                result.add(metric, counter[action], **labels, action=action)
        for kind in RESTART_KINDS:
            result.add("trainwatch_train_restarts_total", tail.restarts[kind], **labels,
                       kind=kind)
        result.add("trainwatch_collector_journal_lines_skipped_total", tail.lines_skipped,
                   **labels)
        result.add("trainwatch_collector_journal_replaced_total", tail.replaced, **labels)
        result.add("trainwatch_run_supervisor_stopped", tail.supervisor_stopped, **labels)
        if tail.last_save is not None:
            result.add("trainwatch_checkpoint_last_save_duration_seconds",
                       tail.last_save["write_seconds"], **labels)
            result.add("trainwatch_checkpoint_last_blocking_seconds",
                       tail.last_save["blocking_seconds"], **labels)
