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
script, a bad launcher option; a restart would fail the same way).
"""

from __future__ import annotations

import logging
import threading
import time

from trainwatch.errors import EXIT_USAGE
from trainwatch.control.actions import ActionRunner
from trainwatch.control.controller import JobController

log = logging.getLogger(__name__)

# At most this share of the supervisor's time goes to reading the ranks' statuses while
# the job runs: every poll at a few ranks, less often at thousands in a shared run directory.
INPUT_CHECK_SHARE = 0.02


class Supervisor:
    def __init__(self, controller: JobController, runner: ActionRunner,
                 poll_seconds: float = 1.0):
        self.controller = controller
        self.runner = runner
        self.poll_seconds = poll_seconds
        self.finished = threading.Event()  # training ended (cleanly, or the guard gave up)
        self.exit_code: int | None = None
        self.launch_failed = False  # it ended because the job failed before any rank ran
        self.rejected_input: str | None = None  # a rank's words when it died on bad input
        self.not_restarted: str | None = None   # why a crashed job could not be restarted
        self._handled_pid: int | None = None
        self._next_input_check = 0.0  # monotonic
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Supervisor":
        self._thread = threading.Thread(target=self._loop, name="tw-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def check(self) -> None:
        """One look at the job; called from the loop (and from tests)."""
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
            elif pid == self._handled_pid:
                return
            self._handled_pid = pid
            if code is not None:
                # A job whose every rank said "finished" is not restarted for its exit code.
                finished = code not in (0, 2) and self.controller.ranks_finished()
                rejected = (self.controller.rejected_input()
                            if code not in (0, 2) and not finished else None)
                launch_failed = code not in (0, 2) and not finished and not rejected and \
                    not self.controller.ranks_reported()
                self.controller.journal_exit(pid, code,
                                             **({"ranks_finished": True} if finished else {}),
                                             **({"launch_failed": True} if launch_failed
                                                else {}),
                                             **({"bad_input": rejected} if rejected else {}))
        if code is None:
            log.warning("a rank of the running job died on bad input (%s): stopping the job "
                        "(a restart, torchrun's or ours, cannot fix it)", running_rejected)
            self.controller.stop(f"bad input: {running_rejected}")
            self.rejected_input, self.exit_code = running_rejected, EXIT_USAGE
            self.finished.set()
            return
        if finished:
            log.warning("the job exited with %s after every rank reported finished "
                        "(a crash on the way out): not restarted", code)
        if launch_failed:
            log.warning("the job exited with %s before any rank published its status: a "
                        "launch failure, not restarted", code)
            self.launch_failed = True
        if rejected:
            log.warning("the job exited with %s after %s: bad input, not restarted", code,
                        rejected)
            self.rejected_input, code = rejected, EXIT_USAGE
        # finished, bad input or a failed launch: a restart cannot fix these
        if finished or launch_failed or code in (0, EXIT_USAGE):
            with self.controller.lock:
                if self.controller.proc is not None and self.controller.proc.pid != pid:
                    return  # an action started the job again meanwhile: it runs on
                # The run is over: an alert's action that comes now (a short run's NaN
                # rollback) finds the controller closed and takes nothing.
                self.controller.close("the job ended")
            self.exit_code = 0 if finished else code
            self.finished.set()
            return
        try:
            outcome = self.runner.restart_job("restart", None, only_if_exited=True)
        except OSError as exc:
            # The restart records itself first (the restart guard's ledger): one that cannot
            # (a full disk) is not taken, or a crash loop would never trip the guard.
            self.not_restarted = (f"could not restart the job: {exc.strerror or exc} "
                                  f"({exc.filename or 'the run directory'}); free space there "
                                  "and run the same command again")
            log.error("the job exited with %s and could not be restarted", code)
            self.exit_code = code
            self.finished.set()
            return
        if not outcome.taken and not self.controller.alive():
            self.exit_code = code
            self.finished.set()

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
