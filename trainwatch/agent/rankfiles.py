"""A run directory's rank files as the agent reads them every second: each rank's small
beat file every time, its status file only when the beat cannot stand in for it.

The beat (``trainwatch/rundir/beat.py``) is written right after the status and carries all a
stall verdict needs: heartbeat, step, when the step last advanced, step time, phase and
its budget, state. The status adds what is exported for scrapes every 15 s (loss,
throughput, counters) and checkpoint facts: a few seconds old is new enough for those.
Parsing every rank's status every second was the largest part of the agent's CPU at 64
ranks, so a rank whose timing windows are far apart (steps of a second or more) has its
status parsed every few seconds instead.

A status is read again at once when its beat says it may have changed in a way the beat
does not carry: no usable beat, a beat of another process (a restart) or in another
state, a beat that has not moved since the last look (the status may then be the newer
of the two), or a beat naming a newer timing window or parameter digest; otherwise
every ``refresh`` seconds.

A new timing window needs only one status per collection: the beat carries the rank's
own part of it (``window``), and the job summary is the same on every rank (all-reduced),
so it is taken from a status of that window read for another local rank of the same
start (``restart_count``). With fast steps (a window every second) that is one status
parsed a second instead of one per rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from trainwatch.agent.compact_record import compact
from trainwatch.rundir.beat import beat_name, read_beat, window_timing
from trainwatch.contract.layout import RANK_PREFIX
from trainwatch.errors import FormatError
from trainwatch.rundir.safe_read import ReadResult, RunFolder, Skipped, SkippedFile
from trainwatch.rundir.run_dir import RunDir


@dataclass(slots=True)
class _Held:
    record: dict[str, Any]
    read_at: float  # monotonic
    beat_at: Any    # the beat's heartbeat at the last look
    version: Any = None  # the file's (inode, size, mtime, ctime) when it was parsed


class RankFiles:
    """Reads one run directory's status and beat files, keeping each status it parsed."""

    def __init__(self, refresh: float):
        self.refresh = refresh
        self._held: dict[str, _Held] = {}

    def read(self, run: RunDir, mono: float) -> tuple[ReadResult, dict[int, dict[str, Any] | None]]:
        """The statuses (as ``RunDir.statuses``) and each listed rank's beat (None: none)."""
        result, beats = ReadResult(), dict[int, dict[str, Any] | None]()
        held: dict[str, _Held] = {}
        folder = run.status_folder(result.skipped)
        if folder is None:
            self._held = held
            return result, beats
        looked: list[tuple[str, dict[str, Any] | None, _Held, bool]] = []
        summaries: dict[tuple[Any, ...], Any] = {}  # (window step, start, node) -> job summary
        with folder:
            for path in run.status_files(folder):
                rank = _rank_of(path)
                beat = None if rank is None else read_beat(
                    os.path.join(folder.path, beat_name(rank)), run.root, folder)
                kept = self._held.get(path)
                window_due = False
                if beat is None or kept is None or self._stale(kept, beat, mono):
                    kept = self._parse(run, path, folder, mono, result, kept)
                    if kept is None:
                        continue
                else:
                    window_due = _new_window(kept.record.get("timing"), beat)
                if not window_due:
                    _offer_summary(kept.record, summaries)
                looked.append((path, beat, kept, window_due))
            for path, beat, found, window_due in looked:  # in listing order
                kept = self._next_window(run, path, folder, mono, result, found, beat,
                                         summaries) if window_due and beat else found
                if kept is None:
                    continue
                kept.beat_at = beat.get("heartbeat_at") if beat is not None else None
                held[path] = kept
                result.records.append(kept.record)
                beats[kept.record["rank"]] = beat
        self._held = held  # ranks whose files are gone are forgotten
        return result, beats

    def _parse(self, run: RunDir, path: str, folder: RunFolder, mono: float,
               result: ReadResult, kept: _Held | None = None) -> _Held | None:
        """The status parsed, or the one ``kept`` when the file is the very one it was
        parsed from (a stalled job's beats stop: every status had been parsed again every
        second, the same bytes each time)."""
        version = folder.version(os.path.basename(path))  # before: a write after it is seen
        if kept is not None and version is not None and version == kept.version:
            return _Held(kept.record, mono, kept.beat_at, version)
        try:
            return _Held(compact(run.read_status(path, folder)), mono, None, version)
        except SkippedFile as exc:
            result.skipped.append(Skipped(path, exc.detail, code=exc.reason))
        except FormatError:  # vanished between the listing and the read
            pass
        return None

    def _next_window(self, run: RunDir, path: str, folder: RunFolder, mono: float,
                     result: ReadResult, kept: _Held, beat: dict[str, Any],
                     summaries: dict[tuple[Any, ...], Any]) -> _Held | None:
        """The kept status with the beat's new window, its job summary from another local
        rank's status of that window; the status itself when none was read."""
        key = _summary_key(beat.get("timing_step"), kept.record)
        timing = window_timing(beat, summaries[key]) if key in summaries else None
        if timing is not None:
            return _Held(dict(kept.record, timing=timing), kept.read_at, kept.beat_at, None)
        fresh = self._parse(run, path, folder, mono, result)
        if fresh is not None:
            _offer_summary(fresh.record, summaries)
        return fresh

    def _stale(self, kept: _Held, beat: dict[str, Any], mono: float) -> bool:
        """Must the status be read, whatever other ranks' statuses hold?"""
        if mono - kept.read_at >= self.refresh:
            return True
        record = kept.record
        return (beat.get("pid") != record.get("pid") or beat.get("rank") != record["rank"]
                or beat.get("state") != record.get("state")
                or beat.get("heartbeat_at") == kept.beat_at
                or _new_digest(record.get("replicas"), beat))


def _summary_key(step: Any, record: dict[str, Any]) -> tuple[Any, ...] | None:
    """Which ranks' windows share a job summary: one window step, one start of the job
    (a resumed run repeats steps), one node (its ranks ask for the same middle width)."""
    start, node = record.get("restart_count"), record.get("node")
    if not (isinstance(step, int) and (start is None or isinstance(start, int))
            and (node is None or isinstance(node, str))):
        return None
    return step, start, node


def _offer_summary(record: dict[str, Any], summaries: dict[tuple[Any, ...], Any]) -> None:
    """Offer the status's job summary for its window; a status holding an equal copy of
    the one offered already holds that one instead (at 256 local ranks each summary is
    a list of 256 numbers, and every parsed status had kept its own)."""
    timing = record.get("timing")
    if isinstance(timing, dict) and "job" in timing:
        key = _summary_key(timing.get("step"), record)
        if key is None:
            return
        offered = summaries.setdefault(key, timing["job"])
        if offered is not timing["job"] and offered == timing["job"]:
            timing["job"] = offered


def _new_window(timing: Any, beat: dict[str, Any]) -> bool:
    """Does the status carry a timing window the kept one does not? Straggler verdicts
    count in windows (flagged within a few of them), so none may be missed. The beat names
    the newest window's step (``timing_step``); a beat without it (an older writer) is
    taken to have one once the rank steps past the end of the next window."""
    kept = timing.get("step") if isinstance(timing, dict) else None
    if "timing_step" in beat:
        return beat["timing_step"] != kept
    step, size = beat.get("step"), timing.get("window_steps") if isinstance(timing, dict) else None
    return isinstance(kept, int) and isinstance(size, int) and isinstance(step, int) \
        and step >= kept + size


def _new_digest(replicas: Any, beat: dict[str, Any]) -> bool:
    """Does the status carry a parameter digest the kept one does not (the beat names the
    newest digest's step, ``replica_step``)? Replica verdicts compare every digest."""
    step = beat.get("replica_step")
    if step is None:
        return False
    newest = replicas[-1] if isinstance(replicas, list) and replicas else None
    return not isinstance(newest, dict) or newest.get("step") != step


def _rank_of(path: str) -> int | None:
    """The rank in a status file's name (``rank-00012.json``); None for another name."""
    number = os.path.basename(path)[len(RANK_PREFIX):-len(".json")]
    return int(number) if number.isdigit() else None
