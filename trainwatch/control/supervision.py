"""One supervised run: the job, its lock, its actions and what watches it, wired once.

``trainwatch run`` and ``trainwatch alerts receive`` both build a ``Supervision``: the
run's lock (one supervisor per run directory; per node of a multi-node job, whose nodes
carry out their leader's repairs, ``control/repairs.py``), the job controller, the action runner with
the run's silences and the supervisor; then the embedded engine with its notifiers and
agent (``attach_engine``) or the webhook receiver (``attach_receiver``). ``supervise`` starts
the job and what watches it, waits, stops everything in order whatever a step raises, and
says how the run ended (``RunOutcome``). What differs between the two commands is data:
their ``Role``.
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import click

from trainwatch.alerts.engine import Engine, Notifier
from trainwatch.alerts.evaluate import History
from trainwatch.alerts.loop import EngineLoop
from trainwatch.alerts.notify import AlertmanagerNotifier, JournalNotifier, WebhookNotifier
from trainwatch.alerts.promql import parse_duration
from trainwatch.alerts.rules import RuleSet
from trainwatch.alerts.scrape import Scraper
from trainwatch.alerts.silences import Silences
from trainwatch.contract.ports import LOOPBACK
from trainwatch.control.actions import ActionRunner, Policy
from trainwatch.control.command import TelemetryWatch, supervised_job
from trainwatch.control.controller import JobController
from trainwatch.control.dispatch import connect_actions
from trainwatch.control.embedded_agent import start_agent, wait_for_agent
from trainwatch.control.job_nodes import JobNodes
from trainwatch.control.launch_log import LaunchLog
from trainwatch.control.outcome import FINISHED, STOPPED, Ending, RunOutcome
from trainwatch.control.receiver import Receiver
from trainwatch.control.node_watch import NodeWatch
from trainwatch.control.repairs import NodeRepairs, RepairBoard
from trainwatch.control.run_summary import ended_nonfinite, unsaved_end
from trainwatch.control.stopped_elsewhere import STOPPING_EVENT, wait_stopped_elsewhere
from trainwatch.control.supervise import Supervisor
from trainwatch.control.supervisor_pager import supervisor_rules
from trainwatch.errors import EXIT_PROBLEM, EXIT_USAGE
from trainwatch.process.proctree import stop
from trainwatch.process.stopsignals import stop_on_sigterm, stopping
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import RunLock, hold
from trainwatch.rundir.supervisor_beat import SupervisorBeat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Role:
    """Who supervises, and how the run's start and end are told."""

    name: str              # the lock's holder; run.json's supervisor of a user's own command
    start_reason: str      # the job's first start, as the journal says it
    stop_reason: str       # the job's close when the supervision ends...
    interrupt_reason: str  # ...and when a stop signal ended it
    # trainwatch run's exit is CI's verdict on the training: a finished end is settled
    # against the run directory (NaN weights, unsaved training, a launch that refused its
    # input) and what could not be recorded is said. A receiver serves until stopped: its
    # outcome is the supervisor's.
    settles: bool


RUN = Role("trainwatch run", start_reason="trainwatch run", stop_reason="controller stopped",
           interrupt_reason="interrupted", settles=True)
RECEIVE = Role("trainwatch alerts receive", start_reason="start", stop_reason="receiver stopped",
               interrupt_reason="receiver stopped", settles=False)


@dataclass(frozen=True)
class Job:
    """What a supervision runs: ``command``, the user's own (``own``: checked, with the job's
    environment and run.json, ``control/command.py``) or trainwatch's trainer."""

    command: list[str]
    own: bool


class Supervision:
    """Built after every check: it takes the run's lock (when it runs a job), which
    ``supervise`` releases at its very end."""

    def __init__(self, run: RunDir, role: Role, job: Job | None, policy: Policy,
                 nodes: JobNodes | None = None):
        self.run, self.role, self.nodes = run, role, nodes
        # Acting as the job's supervisor: the run's one supervisor, or one node's of a
        # multi-node job (trainwatch.rundir.runlock).
        node = nodes.node if nodes is not None else None
        self.lock: RunLock | None = hold(run, role.name, node) if job is not None else None
        # What the node agent watches it by: a frozen or dead supervisor cannot page itself.
        self.beat = SupervisorBeat(
            run, self.lock.holder,
            path=run.node_supervisor_beat_file(node) if node is not None else None,
        ) if self.lock is not None else None
        self.controller: JobController | None = None
        if job is not None:
            self.controller = (supervised_job(run, job.command, role.name) if job.own
                               else JobController(run, job.command))
            self.controller.node_only = nodes is not None
        self.silences = Silences(run.silences_file)
        # A multi-node job: its leader decides the repairs, every node carries them out.
        board = RepairBoard(run, nodes) if nodes is not None else None
        self.runner = ActionRunner(run, self.controller, policy, silences=self.silences,
                                   board=board)
        self.supervisor = (Supervisor(self.controller, self.runner, stopped_elsewhere=(
            partial(wait_stopped_elsewhere, run, nodes.node) if nodes is not None else None))
                           if self.controller is not None else None)
        self.repairs = (NodeRepairs(board, self.runner, self.controller,
                                    watch=NodeWatch(run, nodes, self.controller.journal)
                                    if nodes is not None and nodes.leader else None)
                        if board is not None and self.controller is not None else None)
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None
        self.agent: subprocess.Popen | None = None
        self.agent_target: str | None = None
        self.receiver: Receiver | None = None
        self.watch: TelemetryWatch | None = None
        self.launch = LaunchLog(run, 0)
        self.started_at: float | None = None  # when the journal's controller_started was
        self.interrupted = False
        self.outcome: RunOutcome | None = None

    # ------------------------------------------------------------------ wiring
    def attach_engine(self, ruleset: RuleSet, *, webhooks: tuple[str, ...] = (),
                      alertmanager: str | None = None, agent_port: int,
                      agent_config: str | None,
                      rules_files: tuple[str | None, str | None] = (None, None)) -> None:
        """The embedded engine on the agent's /metrics, the agent started on the run
        directory: alerts go to the journal, ``webhooks`` and ``alertmanager``, firing ones
        with an action to the runner. The alerts about this supervisor are the agent's to
        send (``rules_files``: the rules and thresholds files it loads): frozen or dead, this
        process sends nothing (control/supervisor_pager.py)."""
        ruleset = supervisor_rules(ruleset)
        history = History()
        notifiers: list[Notifier] = [JournalNotifier(self.run)]
        notifiers += [WebhookNotifier(url) for url in webhooks]
        if alertmanager:
            notifiers.append(AlertmanagerNotifier(alertmanager))
        self.engine = Engine(ruleset, history, silences=self.silences, notifiers=notifiers)
        self.agent = start_agent(self.run, agent_port, agent_config, rules=rules_files,
                                 webhooks=webhooks, alertmanager=alertmanager)
        self.agent_target = f"{LOOPBACK}:{agent_port}"
        self.loop = EngineLoop(self.engine, Scraper(history, [self.agent_target]),
                               parse_duration(ruleset.thresholds["evaluation_interval"]))
        connect_actions(self.engine, self.runner, self.loop)

    def attach_receiver(self, ruleset: RuleSet, token: str, host: str, port: int) -> Receiver:
        """Alertmanager's webhook, served from now on: its firing alerts go to the runner."""
        self.receiver = Receiver(ruleset, self.runner, token, host, port).start()
        return self.receiver

    def watch_telemetry(self, say: Callable[[str], None], grace: float) -> None:
        """Say so when the job runs ``grace`` seconds with no rank publishing telemetry."""
        assert self.controller is not None, "only a supervised job is watched"
        self.watch = TelemetryWatch(self.controller, say, grace=grace)

    # ------------------------------------------------------------------ the run
    def supervise(self, wait: Callable[[], None], *, journal: dict[str, Any] | None = None,
                  started_line: str | None = None,
                  stopping_line: str | None = None) -> RunOutcome:
        """Start the job and what watches it, ``wait`` (until the supervision ends or a stop
        signal comes), stop everything, and say how the run ended. ``journal``: the fields
        of ``controller_started``, journaled now, and ``controller_stopped`` at the end;
        ``started_line`` is said once the job started, ``stopping_line`` on a stop signal."""
        if journal is not None:
            assert self.controller is not None, "a supervision journals its job's start"
            self.controller.journal("controller_started", **journal)
            self.started_at = time.time()
        self.launch = LaunchLog.from_now(
            self.run, self.controller.output if self.controller is not None else None)
        stop_on_sigterm()  # stops everything as cleanly as Ctrl-C does
        try:
            if self.beat is not None:
                self.beat.start()
            self._start(started_line)
            wait()
        except KeyboardInterrupt:
            stopping()  # a second Ctrl-C cannot cut short what follows
            self.interrupted = True
            if self.controller is not None and self.started_at is not None:
                # Before the job is signalled: the other nodes, whose jobs end as this
                # one's ranks leave, read it as a stop on request (stopped_elsewhere.py).
                self.controller.journal(STOPPING_EVENT, reason=self.role.interrupt_reason)
            if stopping_line:
                click.echo(stopping_line, err=True)
        finally:
            stopping()
            self._shut_down()
            self.outcome = outcome = self._settle()
            self._journal_end(outcome)
            if self.beat is not None:
                self.beat.stop()
            if self.lock is not None:
                self.lock.release()
        return outcome

    def ended(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the supervision to end by itself (a receiver with no
        job ends only on a stop signal)."""
        if self.supervisor is None:
            time.sleep(timeout)
            return False
        return self.supervisor.finished.wait(timeout)

    def _start(self, started_line: str | None) -> None:
        if self.controller is not None:
            self.controller.start(self.role.start_reason)
        if started_line:
            click.echo(started_line)
        if self.agent is not None and self.agent_target is not None:
            wait_for_agent(self.agent, self.agent_target)
        if self.loop is not None:
            self.loop.start()
        if self.supervisor is not None:
            self.supervisor.start()
        if self.repairs is not None:
            self.repairs.start()
        if self.watch is not None:
            self.watch.start()

    def _shut_down(self) -> None:
        """Every step of the shutdown, whatever one raises (a full disk under the journal):
        everything the run started stops; what failed is listed with what was not recorded."""
        controller, loop, agent = self.controller, self.loop, self.agent
        reason = self.role.interrupt_reason if self.interrupted else self.role.stop_reason
        steps: list[tuple[str, Callable[[], object]]] = []
        if self.watch is not None:
            steps.append(("the telemetry watch", self.watch.stop))
        if self.receiver is not None:
            steps.append(("the receiver", self.receiver.stop))
        if self.repairs is not None:
            steps.append(("the node's repairs", self.repairs.stop))
        if self.supervisor is not None:
            steps.append(("the supervisor", self.supervisor.stop))
        if loop is not None:
            # a last evaluation, so what ended the run (e.g. the guard) is announced
            steps += [("the engine", loop.stop), ("the last evaluation", loop.tick)]
        if controller is not None:
            steps.append(("the job", lambda: controller.close(reason)))
        if agent is not None:
            steps.append(("the agent", lambda: stop(agent)))
        failed = self.controller.unrecorded if self.controller is not None else []
        for what, step in steps:
            try:
                step()
            except Exception as exc:  # the steps after it must still run
                failed.append(f"stopping {what}: {exc}")
                if not self.role.settles:  # nobody lists them: the log says it
                    log.warning("stopping %s failed: %s", what, exc)

    def _settle(self) -> RunOutcome:
        """How the run ended: the supervisor's verdict, a stop signal, and (``Role.settles``)
        what the run directory says of a finished end."""
        verdict = self.supervisor.outcome if self.supervisor is not None else None
        if not self.role.settles:
            return verdict or STOPPED
        if verdict is not None and verdict.ending is Ending.LAUNCH_FAILED:
            # A job that died of trainwatch's own ConfigError before any rank published (a
            # framework callback's misspelt keyword) rejected its input, as a rank that says so.
            refused = self.launch.refused()
            if refused:
                return RunOutcome(Ending.REJECTED_INPUT, EXIT_USAGE, refused)
        if self.interrupted:
            return STOPPED
        if verdict is not None and verdict.ending is not Ending.FINISHED:
            return verdict
        # Finished with NaN weights, or with its training on no disk (the last save failed),
        # is not finished: CI must not pass it (exit 1, said why).
        nonfinite = ended_nonfinite(self.run)
        if nonfinite:
            return RunOutcome(Ending.NONFINITE, EXIT_PROBLEM, nonfinite)
        unsaved = unsaved_end(self.run)
        if unsaved:
            return RunOutcome(Ending.UNSAVED, EXIT_PROBLEM, unsaved)
        return FINISHED

    def _journal_end(self, outcome: RunOutcome) -> None:
        controller = self.controller
        if controller is None:
            return
        if self.started_at is not None:
            controller.journal("controller_stopped", exit_code=outcome.code,
                               interrupted=self.interrupted,
                               seconds=round(time.time() - self.started_at, 3),
                               actions=len(self.run.events("action_taken")),
                               output_dropped_bytes=controller.output.dropped_bytes)
        if self.role.settles and controller.unrecorded:
            click.echo(f"{self.role.name}: could not record (is the disk full?): "
                       + "; ".join(controller.unrecorded[-10:]), err=True)
        output = controller.output
        if output.dropped_bytes:
            click.echo(f"{self.role.name}: {output.dropped_bytes} bytes of the job's output are "
                       f"missing from {output.log.path} ({output.error}): dropped so the job "
                       "could go on", err=True)
            if outcome.ended_early and (words := controller.last_words()):
                click.echo(f"{self.role.name}: the job's last words (kept in memory):\n  "
                           + "\n  ".join(words.splitlines()), err=True)
