"""A multi-node job's repairs: the leader decides once, every node acts on its own ranks.

A frozen or hung rank stalls the whole job, and every node's engine may see it (the
culprit's node names it, the others see their ranks wait), so each node's supervisor
could want to repair it. Decisions travel through the shared run directory instead,
under ``RUN_DIR/control/repairs/``:

* ``proposal-<node>-<ns>.json``: a follower's stall, confirmed on its own node (its ranks'
  processes are only there), for the leader; the leader reads and removes it. It carries
  the newest request the node knew of, so a proposal about an incident already repaired
  is dropped, not repaired twice.
* ``request-NNNNN.json``: the leader's decision, numbered from 1, written once (created
  exclusively: a hard link of a finished temporary file) and journaled as
  ``repair_requested``. Only the leader (node rank 0) writes them; its own alerts and the
  followers' proposals go through its action runner (rate limit, no-progress guard).
* ``applied-NNNNN-<node>.json``: ``node`` acted on that request (created exclusively:
  exactly once per node, also across a restarted supervisor), journaled as
  ``repair_applied`` with the node's name.

The repair keeps the rendezvous reachable: each node SIGKILLs its own rank processes
(SIGKILL also ends a SIGSTOPped one), never its launcher. Every node's torchrun sees its
workers fail, or a node waiting in the rendezvous, and restarts them in one
re-rendezvous against the store node 0's torchrun still hosts; the ranks resume from the
newest verified checkpoint as after any torchrun restart. A launcher that exits anyway is
its own node's supervisor's to start again, with the same rendezvous options
(``control/supervise.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from trainwatch.contract.layout import (FORMAT_VERSION, REPAIR_APPLIED_PREFIX, REPAIR_FORMAT,
                                        REPAIR_PROPOSAL_PREFIX, REPAIR_REQUEST_PREFIX,
                                        file_safe)
from trainwatch.control.job_nodes import JobNodes
from trainwatch.errors import FormatError
from trainwatch.rundir.atomic import atomic_write_json, write_once_json
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import read_record

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25
MAX_DOC_BYTES = 256 << 10


class RepairBoard:
    """The shared ``control/repairs/`` folder as one node sees it."""

    def __init__(self, run: RunDir, nodes: JobNodes):
        self.run, self.nodes = run, nodes
        self.folder = run.repairs_dir

    # ------------------------------------------------------------------ reading
    def _names(self, prefix: str) -> list[str]:
        try:
            with os.scandir(self.folder) as entries:
                return sorted(e.name for e in entries if e.name.startswith(prefix)
                              and e.name.endswith(".json") and e.is_file(follow_symlinks=False))
        except FileNotFoundError:
            return []

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            return read_record(self.folder / name, REPAIR_FORMAT, root=self.run.root,
                               max_bytes=MAX_DOC_BYTES)
        except (OSError, FormatError) as exc:
            log.warning("repair file %s skipped: %s", name, exc)
            return None

    def requests(self) -> list[dict[str, Any]]:
        """The leader's requests, oldest first (a torn or alien file is skipped)."""
        found = []
        for name in self._names(REPAIR_REQUEST_PREFIX):
            number = _number(name[len(REPAIR_REQUEST_PREFIX):-len(".json")])
            doc = self._read(name) if number is not None else None
            if doc is not None and doc.get("number") == number:
                found.append(doc)
        return found

    def newest(self) -> int:
        """The number of the newest request (0: none yet)."""
        numbers = [_number(n[len(REPAIR_REQUEST_PREFIX):-len(".json")])
                   for n in self._names(REPAIR_REQUEST_PREFIX)]
        return max((n for n in numbers if n is not None), default=0)

    def proposals(self) -> list[tuple[Path, dict[str, Any] | None]]:
        return [(self.folder / name, self._read(name))
                for name in self._names(REPAIR_PROPOSAL_PREFIX)]

    def applied(self, number: int) -> bool:
        return (self.folder / _applied_name(number, self.nodes.node)).exists()

    # ------------------------------------------------------------------ writing
    def propose(self, fields: dict[str, Any]) -> Path:
        """A follower's confirmed stall, for the leader (journaled as ``repair_proposed``)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / (f"{REPAIR_PROPOSAL_PREFIX}{file_safe(self.nodes.node)}-"
                              f"{time.time_ns()}.json")
        doc = self._doc("proposal", seen=self.newest(), **fields)
        atomic_write_json(path, doc)
        self.run.append_event("repair_proposed", "engine", **self.nodes.journal(),
                              seen=doc["seen"], proposal=path.name,
                              action=fields.get("action"), alert=fields.get("alertname"))
        return path

    def request(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The leader's decision: the next numbered request, created exactly once."""
        assert self.nodes.leader, "only the leader requests repairs"
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            number = self.newest() + 1
            doc = self._doc("request", number=number, **fields)
            if write_once_json(self.folder / f"{REPAIR_REQUEST_PREFIX}{number:05d}.json", doc):
                break
        self.run.append_event("repair_requested", "engine", **self.nodes.journal(),
                              number=number, action=fields.get("action"),
                              reason=fields.get("reason"), proposed_by=fields.get("proposed_by"))
        return doc

    def mark_applied(self, number: int, fields: dict[str, Any]) -> bool:
        """Record that this node acted on request ``number``; False: it already had."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return write_once_json(self.folder / _applied_name(number, self.nodes.node),
                            self._doc("applied", number=number, **fields))

    def _doc(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"format": REPAIR_FORMAT, "version": FORMAT_VERSION, "kind": kind,
                "time": time.time(), **self.nodes.journal(), **fields}


class NodeRepairs:
    """The thread of a multi-node job's supervisor: on the leader it decides the
    followers' proposals; on every node it carries out each new request once, on its own
    ranks. Requests older than this supervisor are history, not orders."""

    def __init__(self, board: RepairBoard, runner: Any, controller: Any,
                 poll_seconds: float = POLL_SECONDS, watch: Any = None):
        self.board, self.runner, self.controller = board, runner, controller
        self.watch = watch  # the leader's NodeWatch (control/node_watch.py): lost nodes
        self.poll_seconds = poll_seconds
        self.baseline = board.newest()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "NodeRepairs":
        self._thread = threading.Thread(target=self._loop, name="tw-node-repairs", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def check(self) -> None:
        """One look: lost nodes and proposals (the leader), then apply new requests."""
        if self.watch is not None:
            self.watch.check()
        if self.board.nodes.leader:
            for path, doc in self.board.proposals():
                try:
                    if doc is not None:
                        self.runner.decide_proposal(doc)
                finally:
                    _remove(path)  # decided (or unreadable): never decided twice
        for request in self.board.requests():
            number = request["number"]
            if number > self.baseline and not self.board.applied(number):
                self.apply(request)

    def apply(self, request: dict[str, Any]) -> None:
        """Kill this node's ranks of the job that started before the request (torchrun
        starts new ones), record it once, journal it."""
        number = request["number"]
        at = request.get("time")
        before = float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) \
            else time.time()
        killed = self.controller.kill_ranks(before=before)
        launcher = self.controller.alive()
        if self.board.mark_applied(number, {"killed": killed, "launcher_running": launcher}):
            self.controller.journal("repair_applied", **self.board.nodes.journal(),
                                    number=number, action=request.get("action"),
                                    killed=killed, launcher_running=launcher)
            log.warning("repair %d: killed this node's ranks %s; torchrun restarts them",
                        number, killed)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.check()
            except Exception:  # supervision must keep going
                log.exception("repair check failed")


def _number(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _applied_name(number: int, node: str) -> str:
    return f"{REPAIR_APPLIED_PREFIX}{number:05d}-{file_safe(node)}.json"


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
