"""Automatic actions for firing alerts: idempotent, rate-limited, dry-run-able, journaled.

Both the embedded engine and the Alertmanager webhook receiver hand firing alerts
to ``ActionRunner.handle``.  Before anything acts:

* the delivery key (alert fingerprint + startsAt) is recorded in a persisted ledger
  first, so a duplicated or retried delivery never acts twice, even across restarts;
* ``control/hold-actions`` in the run directory, or a matching silence, holds it;
* restarts an alert asks for are rate-limited (``action_min_interval_seconds`` since the
  last restart of any kind); a rollback only by an earlier rollback, as another restart
  may have resumed past the bad step. A refusal for the rate limit is not final: it is
  asked again when the window ends (``Outcome.retry_after``). A job that exited by itself
  is restarted at once (``restart_job``): nothing running is killed, and waiting would
  only idle the allocation; the no-progress guard bounds such crash loops;
* the no-progress guard stops restarting after ``restart_guard_max_restarts``
  restarts without forward progress and raises TrainingRestartLoop.

Every decision is journaled as ``action_taken`` or ``action_skipped`` with the reason
and the evidence.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainwatch.control.bad_step import first_bad_step
from trainwatch.control.confirm import Confirmation, confirm_stall
from trainwatch.control.controller import JobController
from trainwatch.control.gasp_request import ask_survivors
from trainwatch.control.repairs import RepairBoard
from trainwatch.control.replica_rollback import Divergence, find_divergence
from trainwatch.control.restart_round import failure_under_way
from trainwatch.contract.alerts import ACTS_BEFORE
from trainwatch.contract.env import JOB_ENV
from trainwatch.contract.layout import (ACTIONS_LEDGER_FILE, CONTROL_CHECKPOINT, CONTROL_DIR,
                                        CONTROL_HOLD_ACTIONS, file_safe)
from trainwatch.contract.metrics import RUN_LABEL
from trainwatch.errors import FormatError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.atomic import atomic_write_json
from trainwatch.rundir.safe_read import read_run_file
from trainwatch.host.suspects import write_suspect

log = logging.getLogger(__name__)

RESTARTING = ("stall_restart", "restart", "rollback_skip", "straggler", "replica_rollback")
# A multi-node job repairs these on every node at once, decided by its leader
# (control/repairs.py): the ranks are killed, the launchers (and the rendezvous) live on.
JOB_WIDE = ("stall_restart", "straggler")
ROLLBACKS = ("rollback_skip", "replica_rollback")  # rate-limited only by an earlier rollback
LEDGER_FORMAT = "trainwatch.actions"


@dataclass
class ActionRequest:
    """A firing alert that asks for an action (from the engine or a webhook)."""

    alertname: str
    action: str
    labels: dict[str, str]
    fingerprint: str
    starts_at: str
    source: str  # "engine" | "webhook"
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.fingerprint}@{self.starts_at}"


@dataclass
class Outcome:
    taken: bool
    reason: str
    details: dict[str, Any] = field(default_factory=dict)
    # False: the delivery may be asked again (a stall the evidence did not confirm, a
    # restart the rate limit held back), so it is not kept in the ledger as handled.
    final: bool = True
    # Seconds after which asking again can get another answer (the rate limit's window
    # ends); None: whenever the caller re-asks (``Policy.recheck_seconds``).
    retry_after: float | None = None


@dataclass
class Policy:
    min_interval_seconds: float = 300.0
    guard_max_restarts: int = 3
    skip_window_steps: int = 0
    dry_run: bool = False
    # Before a stall action kills anything, look at the ranks ourselves (control/confirm.py)
    # for at least / at most this long.
    confirm_min_seconds: float = 2.0
    confirm_max_seconds: float = 30.0
    # A stall the evidence did not confirm is asked again this often while its alert fires.
    recheck_seconds: float = 60.0
    # TrainingLossSpike's factor: after a rollback, a spike logged since counts as a new
    # bad step only at this many times the mean of the steps before it.
    spike_factor: float = 3.0
    # Optional scheduler adapter for stragglers: a command template run after the
    # checkpoint, e.g. "scontrol requeue {slurm_job_id}" or "kubectl cordon {node}".
    straggler_command: str | None = None

    @classmethod
    def from_thresholds(cls, thresholds: dict[str, Any], **kw: Any) -> "Policy":
        return cls(min_interval_seconds=float(thresholds["action_min_interval_seconds"]),
                   guard_max_restarts=int(thresholds["restart_guard_max_restarts"]),
                   skip_window_steps=int(thresholds["skip_window_steps"]),
                   confirm_min_seconds=float(thresholds["stall_confirm_min_seconds"]),
                   confirm_max_seconds=float(thresholds["stall_confirm_max_seconds"]),
                   recheck_seconds=float(thresholds["stall_recheck_seconds"]),
                   spike_factor=float(thresholds["loss_spike_factor"]),
                   **kw)


class ActionRunner:
    def __init__(self, run: RunDir | str | Path, controller: JobController | None,
                 policy: Policy, *, job: str | None = None, silences=None,
                 on_guard: Callable[[str, bool], None] | None = None,
                 clock: Callable[[], float] = time.time, board: RepairBoard | None = None):
        # a path: a caller outside control/ (a test, a script) that has no RunDir at hand
        self.run = (run if isinstance(run, RunDir) else RunDir(run)).create()
        self.controller = controller
        self.policy = policy
        self._job = job
        self.silences = silences
        self.on_guard = on_guard  # (job, tripped): the guard tripped or was cleared
        self.clock = clock
        self.ledger_path = self.run.actions_ledger_file
        # A multi-node job (``board``): the leader decides the job's repairs and keeps the
        # job's ledger; a follower keeps its own, for its own launcher's restarts.
        self.board = board
        if board is not None and not board.nodes.leader:
            self.ledger_path = self.run.alerts_dir / (
                f"{Path(ACTIONS_LEDGER_FILE).stem}.{file_safe(board.nodes.node)}.json")
        self.lock = threading.Lock()

    @property
    def job(self) -> str:
        """The run this runner acts for, read each time: the job may write run.json's name
        (RunDir.run_name) after the runner started."""
        return self._job or self.run.run_name(os.environ.get(JOB_ENV))

    # ------------------------------------------------------------------ ledger
    def _ledger(self) -> dict[str, Any]:
        try:
            doc = json.loads(read_run_file(self.ledger_path))
            if isinstance(doc, dict) and doc.get("format") == LEDGER_FORMAT:
                return doc
            log.warning("%s is not an actions ledger; starting a new one", self.ledger_path)
        except FileNotFoundError:
            pass
        except (FormatError, ValueError, RecursionError) as exc:
            log.warning("actions ledger unreadable (%s); starting a new one", exc)
        return {"format": LEDGER_FORMAT, "version": 1, "deliveries": {}, "last_restart_at": None,
                "restarts_without_progress": 0, "step_at_last_restart": None,
                "guard_tripped": False}

    def _save(self, ledger: dict[str, Any]) -> None:
        self.ledger_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.ledger_path, ledger)

    @property
    def guard_tripped(self) -> bool:
        return bool(self._ledger().get("guard_tripped"))

    # ------------------------------------------------------------------ entry point
    def handle(self, req: ActionRequest, proposed: dict[str, Any] | None = None) -> Outcome:
        """``proposed``: a follower node's proposal the leader decides (its confirmation
        stands in for one here: the ranks it looked at run on that node)."""
        with self.lock:  # the leader's own alerts and proposals: one decision at a time
            if proposed is not None and self.board is not None \
                    and proposed.get("seen") != self.board.newest():
                return self._skip(req, f"already repaired: request {self.board.newest()} was "
                                  f"made after node {proposed.get('node')} looked (it knew of "
                                  f"request {proposed.get('seen')})",
                                  extra={"proposed_by": proposed.get("node")})
            ledger = self._ledger()
            if req.key in ledger["deliveries"]:
                first = ledger["deliveries"][req.key]
                return self._skip(req, "duplicate delivery: already handled at "
                                  f"{first['at']:.3f} ({first['outcome']})", record=False)
            # Record the delivery before acting: a crash mid-action must not act twice.
            ledger["deliveries"][req.key] = {"at": self.clock(), "alertname": req.alertname,
                                             "outcome": "in progress"}
            self._save(ledger)
            outcome = self._decide_and_act(req, ledger, proposed)
            if outcome.final:
                ledger["deliveries"][req.key]["outcome"] = (
                    "taken" if outcome.taken else f"skipped: {outcome.reason}")
            else:
                del ledger["deliveries"][req.key]
            self._save(ledger)
            return outcome

    def decide_proposal(self, doc: dict[str, Any]) -> Outcome:
        """The leader's decision on a follower's proposal (``control/repairs.py``): one the
        follower made before the newest request is about an incident already repaired."""
        labels = doc.get("labels")
        req = ActionRequest(alertname=str(doc.get("alertname")), action=str(doc.get("action")),
                            labels={str(k): str(v) for k, v in labels.items()}
                            if isinstance(labels, dict) else {},
                            fingerprint=str(doc.get("fingerprint")),
                            starts_at=str(doc.get("starts_at")),
                            source=f"node {doc.get('node')}")
        assert self.board is not None, "proposals come to a multi-node job's leader"
        return self.handle(req, proposed=doc)

    def _decide_and_act(self, req: ActionRequest, ledger: dict[str, Any],
                        proposed: dict[str, Any] | None = None) -> Outcome:
        run = req.labels.get(RUN_LABEL)
        if run is not None and run != self.job:
            return self._skip(req, f"alert is for run {run!r}, this controller runs {self.job!r}")
        if self.run.hold_actions_file.exists():
            return self._skip(req, f"held: {CONTROL_DIR}/{CONTROL_HOLD_ACTIONS} exists")
        if self.silences is not None and self.silences.matching(req.labels, self.clock()):
            return self._skip(req, "silenced")
        if req.action == "checkpoint_now":
            return self._checkpoint_now(req)
        if req.action not in RESTARTING:
            return self._skip(req, f"unknown action {req.action!r}")
        if self.controller is None:
            return self._skip(req, "no job controller attached (report only)")
        if self.board is not None and req.action in ROLLBACKS:
            return self._skip(req, "a rollback is not yet carried out across the nodes of a "
                              "multi-node job: a person decides (the alert pages)")
        if req.action == "restart" and self.controller.alive():
            return self._skip(req, "the launcher is still running: torchrun handles rank "
                              "failures within its own --max-restarts")
        if req.action == "straggler" and not self.policy.straggler_command:
            request = self._touch("checkpoint")
            return self._taken(req, "report only: asked for a checkpoint; no scheduler "
                               "adapter configured to move the job", {"requested": str(request)})
        # A rollback is the one remedy for a bad step; any other restart resumed from the
        # newest checkpoint, maybe past that step, so only an earlier rollback holds it back.
        rollback = req.action in ROLLBACKS
        last = ledger.get("last_rollback_at" if rollback else "last_restart_at")
        now = self.clock()
        if last is not None and now - last < self.policy.min_interval_seconds:
            what = "rolled back" if rollback else "restarted"
            wait = self.policy.min_interval_seconds - (now - last)
            outcome = self._skip(req, f"rate limited: the job was {what} {now - last:.0f}s ago "
                                 f"(minimum {self.policy.min_interval_seconds:.0f}s); asked "
                                 f"again in {wait:.0f}s", extra={"retry_after": wait})
            outcome.final, outcome.retry_after = False, wait
            return outcome
        if req.action == "rollback_skip" and first_bad_step(
                self.run, self._last_action_time("rollback_skip"),
                spike_factor=self.policy.spike_factor) is None:
            # The alert is one signal: Prometheus's window spans restarts, so a launch that
            # began again from earlier state reads as a spike. Act only on a bad step a rank
            # logged itself (control/bad_step.py), since the last rollback: the loss alerts
            # fire for minutes after their step and are asked again meanwhile.
            outcome = self._skip(req, "not confirmed: no rank logged a non-finite loss, or "
                                 f"one {self.policy.spike_factor:g}x the mean of its steps "
                                 "before it in the same launch, since the last rollback")
            outcome.final = False  # a later delivery looks again
            return outcome
        confirmation = None
        if req.action == "stall_restart" and proposed is not None:
            found = proposed.get("confirmation")
            confirmation = Confirmation(True, f"confirmed on node {proposed.get('node')}", 0.0,
                                        {"node": proposed.get("node"),
                                         "there": found if isinstance(found, dict) else None})
        elif req.action == "stall_restart":
            # One signal (the agent's reading of the status files) never kills a job.
            # Before the page (TrainingStallSuspected), a busy rank is left to the page.
            confirmation = confirm_stall(self.run, self.controller.rank_processes(),
                                         min_seconds=self.policy.confirm_min_seconds,
                                         max_seconds=self.policy.confirm_max_seconds,
                                         busy_refutes=req.alertname in ACTS_BEFORE)
            if not confirmation.confirmed:
                outcome = self._skip(req, f"stall not confirmed: {confirmation.reason}",
                                     extra={"confirmation": confirmation.journal()})
                outcome.final = False
                return outcome
        if req.action == "stall_restart" and confirmation is not None:
            # A rank died and torchrun is restarting the workers: its repair, not a second.
            looks = confirmation.evidence.get("last") if proposed is None else None
            torchrun = failure_under_way(self.run, launcher_alive=self.controller.alive(),
                                         looks=looks)
            if torchrun is not None:
                outcome = self._skip(req, torchrun,
                                     extra={"confirmation": confirmation.journal()})
                outcome.final = False  # torchrun that never restarts them: asked again
                return outcome
        if req.action == "replica_rollback":
            # The alert is the agent's reading; the ranks' logged digests must say it too.
            divergence = find_divergence(self.run, self._last_action_time("replica_rollback"))
            if divergence.digests < 2:
                outcome = self._skip(req, "divergence not confirmed by the logged digests "
                                     f"({divergence.digests} odd digest(s) in a row)",
                                     extra={"divergence": divergence.journal()})
                outcome.final = False  # a later delivery looks again
                return outcome
        if (self.board is not None and not self.board.nodes.leader
                and req.action in JOB_WIDE and self.controller.alive()):
            return self._propose(req, confirmation)
        return self._restart(self.controller, req.action, req, ledger, confirmation)

    def _propose(self, req: ActionRequest, confirmation: Confirmation | None) -> Outcome:
        """A follower does not repair the job: it hands its confirmed finding to the
        leader, which decides once for every node (``repair_proposed`` in the journal)."""
        assert self.board is not None, "only a multi-node job's follower proposes"
        if self.policy.dry_run:
            return self._skip(req, f"dry run: would propose {req.action} to the job's leader")
        path = self.board.propose({
            "action": req.action, "alertname": req.alertname, "labels": req.labels,
            "fingerprint": req.fingerprint, "starts_at": req.starts_at,
            "confirmation": confirmation.journal() if confirmation is not None else None})
        return Outcome(False, f"proposed to the job's leader ({path.name})",
                       {"proposal": str(path)})

    # ------------------------------------------------------------------ restarts
    def restart_job(self, action: str, req: ActionRequest | None = None, *,
                    only_if_exited: bool = False) -> Outcome:
        """Restart through the no-progress guard (the supervisor's path for a job that exited).

        ``only_if_exited``: do nothing if the job runs again by now (an alert's action got
        there first), so one failure never restarts the job twice.
        """
        controller = self.controller
        if controller is None:
            return Outcome(False, "no job controller attached (report only)")
        with self.lock:
            if only_if_exited and controller.alive():
                return Outcome(False, "the job was already restarted")
            ledger = self._ledger()
            outcome = self._restart(controller, action, req, ledger)
            self._save(ledger)
            return outcome

    def _restart(self, controller: JobController, action: str, req: ActionRequest | None,
                 ledger: dict[str, Any], confirmation: Confirmation | None = None) -> Outcome:
        step = controller.progress_step()
        previous = ledger.get("step_at_last_restart")
        first_restart = ledger.get("last_restart_at") is None
        progressed = first_restart or (step is not None and (previous is None or step > previous))
        count = 0 if progressed else int(ledger.get("restarts_without_progress", 0))
        if ledger.get("guard_tripped") and progressed and not first_restart:
            # A newer checkpoint than at the last restart: someone fixed the cause and the
            # job trains again, so a new failure deserves a restart, not a page.
            ledger["guard_tripped"] = False
            self.run.append_event("action_guard_cleared", "engine", step=step,
                                  step_at_last_restart=previous)
            log.warning("restart guard cleared: the job progressed to step %s", step)
            if self.on_guard is not None:
                self.on_guard(self.job, False)
        if ledger.get("guard_tripped") or count >= self.policy.guard_max_restarts:
            ledger["guard_tripped"] = True
            self._save(ledger)
            outcome = self._skip(req, f"restart guard: {count} restarts without forward "
                                 f"progress (step {step}); not restarting, paging a human",
                                 action=action, extra={"step": step})
            if self.on_guard is not None:
                self.on_guard(self.job, True)
            return outcome
        details: dict[str, Any] = {"step_before": step, "restarts_without_progress": count}
        if confirmation is not None:
            details["confirmation"] = confirmation.journal()
        if self.policy.dry_run:
            return self._skip(req, f"dry run: would {action} the job", action=action,
                              extra=details)
        if action == "stall_restart":
            details["evidence"] = str(controller.capture_evidence("stall"))
            details["gasp"] = self._ask_gasp(action, req)
        elif action == "straggler":
            details["requested"] = str(self._touch("checkpoint"))
            details["adapter"] = self._run_adapter(req)
        # From here to the new start, nobody else stops, starts or closes the job: a run
        # whose supervisor has ended it is not rolled back or restarted behind it.
        with controller.lock:
            if controller.closed:
                return self._skip(req, f"the run already ended (the job exited and its "
                                  f"supervisor finished): nothing to {action}", action=action)
            return self._restart_now(controller, action, req, ledger, step, count, details)

    def _restart_now(self, controller: JobController, action: str, req: ActionRequest | None,
                     ledger: dict[str, Any], step: int | None, count: int,
                     details: dict[str, Any]) -> Outcome:
        if action == "rollback_skip":
            # Stop first, so no checkpoint is written after the bad one is chosen.
            controller.stop(f"{action} ({req.alertname if req else 'exit'})", hard=True)
            details.update(self._prepare_rollback(controller))
        elif action == "replica_rollback":
            controller.stop(f"{action} ({req.alertname if req else 'exit'})", hard=True)
            details.update(self._prepare_replica_rollback(controller,
                                                          req.alertname if req else None))
        ledger["step_at_last_restart"] = step
        ledger["restarts_without_progress"] = count + 1
        ledger["last_restart_at"] = self.clock()
        if action in ROLLBACKS:
            ledger["last_rollback_at"] = ledger["last_restart_at"]
        self._save(ledger)
        if self.board is not None and action in JOB_WIDE and controller.alive():
            return self._repair_every_node(controller, action, req, details)
        # Hung or diverged jobs are killed (no checkpoint can or should be written).
        hard = action in ("stall_restart", *ROLLBACKS)
        details["pid"] = controller.restart(
            action + (f" ({req.alertname})" if req else ""), hard=hard)
        resume, kind = controller.resume_point()
        details["resume_from"] = {"step": resume, "kind": kind}
        return self._taken(req, f"{action}: {_resume_phrase(resume, kind)}", details,
                           action=action)

    def _repair_every_node(self, controller: JobController, action: str,
                           req: ActionRequest | None, details: dict[str, Any]) -> Outcome:
        """The leader's repair of a multi-node job: one numbered request, which every node
        (this one too) carries out on its own ranks; no launcher stops, so the rendezvous
        store stays up and every torchrun restarts its workers in one re-rendezvous."""
        assert self.board is not None, "a multi-node job's repair"
        resume, kind = controller.resume_point()
        details["resume_from"] = {"step": resume, "kind": kind}
        request = self.board.request({
            "action": action, "reason": f"{action} ({req.alertname})" if req else action,
            "alertname": req.alertname if req else None,
            "proposed_by": req.source[len("node "):] if req and req.source.startswith("node ")
            else None})
        details["request"] = request["number"]
        return self._taken(req, f"{action}: asked every node to kill its ranks (repair "
                           f"request {request['number']}); torchrun restarts them and "
                           + _resume_phrase(resume, kind).replace("restarted the job; ", ""),
                           details, action=action)

    def _ask_gasp(self, action: str, req: ActionRequest | None) -> dict[str, Any] | None:
        """The survivors' step before the kill (control/gasp_request.py); a failure to ask
        costs the gasp, never the restart."""
        try:
            return ask_survivors(self.run, f"{action} ({req.alertname})" if req else action)
        except Exception as exc:
            log.warning("could not ask the ranks for a dying gasp: %s", exc)
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _prepare_rollback(self, controller: JobController) -> dict[str, Any]:
        """Find the bad step; hide checkpoints taken at or after it; ask to skip the window."""
        # the step the confirmation found (handle), or one as bad: never the "largest"
        # ratio of a flat loss, which any step has
        bad = first_bad_step(self.run, self._last_action_time("rollback_skip"),
                             spike_factor=self.policy.spike_factor)
        details: dict[str, Any] = {"bad_step": bad}
        if bad is None:
            details["note"] = "no non-finite or spiking step found in the metrics log"
            return details
        moved = []
        for step, path in controller.checkpoints():  # checkpoint.dir and mirror_dir
            if step >= bad:
                target = self._quarantine_folder(path.parent) / path.name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(path), target)
                moved.append({"step": step, "moved_from": str(path), "moved_to": str(target)})
        resume = max((s for s, _ in controller.checkpoints() if s < bad), default=None)
        skip_to = bad + self.policy.skip_window_steps
        request = {"from_step": (resume + 1) if resume is not None else 0, "to_step": skip_to,
                   "reason": f"non-finite or spiking loss at step {bad}"}
        atomic_write_json(self.run.skip_steps_file, request)
        details.update({"resume_step": resume, "quarantined": moved, "skip": request})
        return details

    def _prepare_replica_rollback(self, controller: JobController,
                                  alert: str | None) -> dict[str, Any]:
        """Hide the checkpoints saved after the newest step whose digests agreed, so the job
        resumes from weights every replica held; name the suspects for preflight."""
        divergence = find_divergence(self.run, self._last_action_time("replica_rollback"))
        clean = divergence.clean_checkpoint_step
        moved = [self._quarantine(step, path) for step, path in controller.checkpoints()
                 if clean is None or step > clean]
        statuses = {s.get("rank"): s.get("node") for s in self.run.statuses().records}
        suspects = [{"rank": r, "node": statuses.get(r)} for r in divergence.suspects]
        return {"divergence": divergence.journal(), "clean_checkpoint_step": clean,
                "quarantined": moved, "suspects": suspects,
                "marked": self._mark_suspects(divergence, suspects, clean, alert),
                "preflight": "`trainwatch preflight --run-dir RUN_DIR` fails a marked node "
                             "until its record is removed (docs/sdc.md)"}

    def _mark_suspects(self, divergence: Divergence, suspects: list[dict[str, Any]],
                       clean: int | None, alert: str | None) -> list[str]:
        """A record per suspected node in RUN_DIR/suspects/ for preflight. Only a rank named
        alone by a majority: a tie suspects every replica and marks none."""
        if not divergence.majority:
            return []
        by_node: dict[str, list[int]] = {}
        for s in suspects:
            if isinstance(s["node"], str):
                by_node.setdefault(s["node"], []).append(s["rank"])
        evidence = {**divergence.journal(), "clean_checkpoint_step": clean}
        return [str(write_suspect(self.run.suspects_dir, node, {
            "ranks": ranks, "run": self.job, "run_dir": str(self.run.root.resolve()),
            "time": self.clock(), "alert": alert, "evidence": evidence}))
            for node, ranks in sorted(by_node.items())]

    def _quarantine(self, step: int, path: Path) -> dict[str, Any]:
        target = self._quarantine_folder(path.parent) / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), target)
        return {"step": step, "moved_from": str(path), "moved_to": str(target)}

    def _last_action_time(self, action: str) -> float:
        times = [e.get("time") for e in self.run.events("action_taken")
                 if e.get("action") == action]
        return max((t for t in times if isinstance(t, (int, float))), default=float("-inf"))

    def _quarantine_folder(self, folder: Path) -> Path:
        """RUN_DIR/checkpoints -> diagnostics/quarantine-<time>/; any other checkpoint folder
        (``checkpoint.dir``/``mirror_dir``, maybe another disk) -> its own
        ``quarantine-<time>/``: a rename on the same mount, and not a step directory, so
        neither resume nor retention ever looks inside."""
        name = f"quarantine-{int(self.clock())}"
        if folder.resolve() == self.run.checkpoint_dir.resolve():
            return self.run.diagnostics_dir / name
        return folder / name

    def _run_adapter(self, req: ActionRequest | None) -> dict[str, Any]:
        template = self.policy.straggler_command
        assert template, "a straggler without an adapter is answered before any restart"
        labels = dict(req.labels) if req else {}
        cmd = template.format_map(_Default(labels))
        res = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=60)
        return {"command": cmd, "returncode": res.returncode,
                "output": (res.stdout + res.stderr)[-2000:]}

    # ------------------------------------------------------------------ small actions
    def _checkpoint_now(self, req: ActionRequest) -> Outcome:
        if self.policy.dry_run:
            return self._skip(req, f"dry run: would touch {CONTROL_DIR}/{CONTROL_CHECKPOINT}")
        return self._taken(req, "asked every rank for a checkpoint",
                           {"requested": str(self._touch(CONTROL_CHECKPOINT))})

    def _touch(self, name: str) -> Path:
        path = self.run.control_file(name)
        path.touch()  # a new mtime is the request; ranks poll it from their telemetry thread
        return path

    # ------------------------------------------------------------------ journal
    def _taken(self, req, reason, details, action=None) -> Outcome:
        self.run.append_event("action_taken", "engine", action=action or req.action,
                              reason=reason, **_req_fields(req), **details)
        log.warning("action taken: %s", reason)
        return Outcome(True, reason, details)

    def _skip(self, req, reason, *, record=True, action=None, extra=None) -> Outcome:
        self.run.append_event("action_skipped", "engine",
                              action=action or (req.action if req else None), reason=reason,
                              **_req_fields(req), **(extra or {}))
        log.info("action skipped: %s", reason)
        return Outcome(False, reason, extra or {})


def _resume_phrase(step: int | None, kind: str) -> str:
    """What the journal may claim about where the restarted job continues: only what the
    run directory shows (the job verifies a trainwatch checkpoint when it resumes)."""
    if kind == "checkpoint":
        return (f"restarted the job; it resumes from its newest complete checkpoint, step "
                f"{step} (verified by the job as it loads, else the newest that verifies)")
    if kind == "declared":
        return (f"restarted the job; its newest declared checkpoint is step {step} "
                "(the job's own files: trainwatch did not verify them)")
    return "restarted the job; no checkpoint found: it starts from the beginning"


class _Default(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _req_fields(req: ActionRequest | None) -> dict[str, Any]:
    if req is None:
        return {"alert": None}
    return {"alert": req.alertname, "fingerprint": req.fingerprint, "starts_at": req.starts_at,
            "delivery": req.source, "labels": req.labels}
