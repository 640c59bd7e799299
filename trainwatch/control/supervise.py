"""Watching the job process: a job that exits by itself is finished or restarted.

torchrun restarts failed ranks within ``--max-restarts``; when the launcher gives
up (exits non-zero) the supervisor restarts the job from its newest verified
checkpoint through the ActionRunner, so the no-progress guard also stops crash
loops.  A clean exit (0) means training finished; exit code 2 (bad input) is not
restarted either, nor is a job a rank of which reported it died on bad input (torchrun
exits 1 for it; the rank's status says ``failure.kind: bad_input``; the run ends with
exit 2; a running job is stopped as soon as a rank reports it, before torchrun's own
``--max-restarts`` start it again), nor a job whose every rank reported ``finished`` before
it exited non-zero (a crash in interpreter teardown, after training ended), nor one that failed
before any rank of its start published a status or beat file (a launch failure: a missing
script, a bad launcher option; a restart would fail the same way), nor a multi-node job's
node whose job ended as another node was stopped on request (control/stopped_elsewhere.py:
it ends as stopped).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from trainwatch.control.actions import ActionRunner
from trainwatch.control.controller import JobController
from trainwatch.control.outcome import FINISHED, Ending, RunOutcome
from trainwatch.control.stopped_elsewhere import stopped_words
from trainwatch.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE

log = logging.getLogger(__name__)

# At most this share of the supervisor's time goes to reading the ranks' statuses while
# the job runs: every poll at a few ranks, less often at thousands in a shared run directory.
INPUT_CHECK_SHARE = 0.02

# A job's exit codes that end its supervision whatever its ranks say: training done, or
# its input refused (neither is restarted).
FINAL_EXIT_CODES = (EXIT_OK, EXIT_USAGE)


class Supervisor:
    def __init__(self, controller: JobController, runner: ActionRunner,
                 poll_seconds: float = 1.0,
                 stopped_elsewhere: Callable[[int], str | None] | None = None):
        self.controller = controller
        self.runner = runner
        self.poll_seconds = poll_seconds
        # A multi-node job's node: why its job (this pid) ended for another node's stop on
        # request, if it did (control/stopped_elsewhere.py); such a job is not restarted.
        self.stopped_elsewhere = stopped_elsewhere
        self.finished = threading.Event()  # the supervision is over: ``outcome`` says how
        self.outcome: RunOutcome | None = None
        self._handled_pid: int | None = None
        self._next_input_check = 0.0  # monotonic
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def exit_code(self) -> int | None:
        """The job's code as its supervision ended (None while it runs)."""
        return None if self.outcome is None else self.outcome.code

    @property
    def launch_failed(self) -> bool:
        return self.outcome is not None and self.outcome.ending is Ending.LAUNCH_FAILED

    def start(self) -> "Supervisor":
        self._thread = threading.Thread(target=self._loop, name="tw-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _end(self, outcome: RunOutcome) -> None:
        self.outcome = outcome
        self.finished.set()

    def check(self) -> None:
        """One look at the job; called from the loop (and from tests)."""
        elsewhere = self._elsewhere()
        with self.controller.lock:  # read only: never hold it while the runner acts
            code = self.controller.returncode()
            if self.controller.stopping or self.controller.proc is None:
                return
            pid = self.controller.proc.pid
            if code is None:
                # torchrun's own --max-restarts would start a rank that rejected its input
                # again until they are spent: stop the job as soon as a rank says so.
                running_rejected = self._running_rejected_input()
                if running_rejected is None:
                    return
            elif pid == self._handled_pid or self._unlooked(pid, code, elsewhere):
                return
            self._handled_pid = pid
            if code is not None:
                verdict = self._exit_verdict(pid, code, elsewhere[1] if elsewhere else None)
        if code is None:
            log.warning("a rank of the running job died on bad input (%s): stopping the job "
                        "(a restart, torchrun's or ours, cannot fix it)", running_rejected)
            self.controller.stop(f"bad input: {running_rejected}")
            self._end(RunOutcome(Ending.REJECTED_INPUT, EXIT_USAGE, running_rejected))
            return
        if verdict is not None:  # finished, bad input, a failed launch: a restart cannot fix them
            with self.controller.lock:
                if self.controller.proc is not None and self.controller.proc.pid != pid:
                    return  # an action started the job again meanwhile: it runs on
                # The run is over: an alert's action that comes now (a short run's NaN
                # rollback) finds the controller closed and takes nothing.
                self.controller.close("the job ended")
            self._end(verdict)
            return
        try:
            restart = self.runner.restart_job("restart", None, only_if_exited=True)
        except OSError as exc:
            # The restart records itself first (the restart guard's ledger): one that cannot
            # (a full disk) is not taken, or a crash loop would never trip the guard.
            log.error("the job exited with %s and could not be restarted", code)
            self._end(RunOutcome(Ending.NOT_RESTARTED, code, (
                f"could not restart the job: {exc.strerror or exc} "
                f"({exc.filename or 'the run directory'}); free space there "
                "and run the same command again")))
            return
        if not restart.taken and not self.controller.alive():
            self._end(RunOutcome(Ending.NOT_RESTARTED, code))

    def _elsewhere(self) -> tuple[int, str | None] | None:
        """A multi-node job's failed job (its pid) and the other node whose stop on request
        ended it (None: none did), looked for before the lock is taken (it may wait a moment
        for that node's record); None when there was no failed job to look at."""
        proc = self.controller.proc
        if self.stopped_elsewhere is None or proc is None or self.controller.stopping:
            return None
        code = proc.poll()
        if code is None or code in FINAL_EXIT_CODES or proc.pid == self._handled_pid:
            return None
        return proc.pid, self.stopped_elsewhere(proc.pid)

    def _unlooked(self, pid: int, code: int, elsewhere: tuple[int, str | None] | None) -> bool:
        """The job failed after ``_elsewhere`` looked: it is looked at next time."""
        return (self.stopped_elsewhere is not None and code not in FINAL_EXIT_CODES
                and (elsewhere is None or elsewhere[0] != pid))

    def _exit_verdict(self, pid: int, code: int, elsewhere: str | None = None
                      ) -> RunOutcome | None:
        """The job's exit by itself, journaled (under the controller's lock), and how it ends
        the supervision; None: a crash a restart may fix. ``elsewhere``: the other node of a
        multi-node job whose stop on request ended it (the run ends as stopped)."""
        if code in FINAL_EXIT_CODES:
            self.controller.journal_exit(pid, code)
            return (FINISHED if code == EXIT_OK
                    else RunOutcome(Ending.REJECTED_INPUT, EXIT_USAGE))
        # A job whose every rank said "finished" is not restarted for its exit code.
        if self.controller.ranks_finished():
            self.controller.journal_exit(pid, code, ranks_finished=True)
            log.warning("the job exited with %s after every rank reported finished "
                        "(a crash on the way out): not restarted", code)
            return FINISHED
        rejected = self.controller.rejected_input()
        if rejected:
            self.controller.journal_exit(pid, code, bad_input=rejected)
            log.warning("the job exited with %s after %s: bad input, not restarted", code,
                        rejected)
            return RunOutcome(Ending.REJECTED_INPUT, EXIT_USAGE, rejected)
        if not self.controller.ranks_reported():
            self.controller.journal_exit(pid, code, launch_failed=True)
            log.warning("the job exited with %s before any rank published its status: a "
                        "launch failure, not restarted", code)
            return RunOutcome(Ending.LAUNCH_FAILED, code)
        if elsewhere is not None:
            self.controller.journal_exit(pid, code, stopped_elsewhere=elsewhere)
            log.warning("%s", stopped_words(elsewhere))
            return RunOutcome(Ending.STOPPED, EXIT_INTERRUPTED, stopped_words(elsewhere))
        self.controller.journal_exit(pid, code)
        return None

    def _running_rejected_input(self) -> str | None:
        """A running job's rank that died on bad input, looked for at most
        ``INPUT_CHECK_SHARE`` of the time: each look reads every status of the run."""
        began = time.monotonic()
        if began < self._next_input_check:
            return None
        rejected = self.controller.rejected_input()
        spent = time.monotonic() - began
        self._next_input_check = began + max(self.poll_seconds, spent / INPUT_CHECK_SHARE)
        return rejected

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_seconds) and not self.finished.is_set():
            try:
                self.check()
            except Exception:  # supervision must keep going
                log.exception("supervisor check failed")
