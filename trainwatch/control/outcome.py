"""How a supervised run ended, and the one mapping from that to an exit code and words.

The supervisor says how the job's end went (``Supervisor.outcome``); ``trainwatch run``
settles it against the run directory (``Supervision``); the command reports it through
what is here: the exit status, the summary's first word, and the line that says why. CI
reads the exit status, so every ending has exactly one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from trainwatch.control.launch_log import LaunchLog
from trainwatch.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, ConfigError
from trainwatch.rundir.run_dir import RunDir


class Ending(enum.Enum):
    FINISHED = "finished"                  # training ended (exit 0, or every rank finished)
    ALREADY_COMPLETE = "already complete"  # its checkpoint is at the target: nothing ran
    STOPPED = "stopped on request"         # Ctrl-C or SIGTERM stopped the supervision
    REJECTED_INPUT = "rejected input"      # exit 2 or a rank's bad_input: not restarted
    LAUNCH_FAILED = "launch failed"        # it failed before any rank published
    NOT_RESTARTED = "not restarted"        # it failed and no restart was taken (the guard)
    NONFINITE = "ended non-finite"         # finished with a NaN/Inf loss
    UNSAVED = "ended unsaved"              # finished, but its newest save failed


@dataclass(frozen=True)
class RunOutcome:
    """An ending, the code the journal's ``controller_stopped`` records (the job's own exit
    code when it failed, else the run's), and why, in words, where something says it."""

    ending: Ending
    code: int = EXIT_OK
    why: str | None = None

    @property
    def exit_code(self) -> int:
        """``trainwatch run``'s exit status: 0 finished, 2 bad input, 130 stopped, 1 any other
        failure (a job that itself died of SIGINT, 130, passes that on as a shell would)."""
        if self.ending in (Ending.FINISHED, Ending.ALREADY_COMPLETE):
            return EXIT_OK
        if self.ending is Ending.STOPPED:
            return EXIT_INTERRUPTED
        if self.ending is Ending.REJECTED_INPUT:
            return EXIT_USAGE
        return EXIT_INTERRUPTED if self.code == EXIT_INTERRUPTED else EXIT_PROBLEM

    @property
    def receiver_exit_code(self) -> int:
        """``alerts receive``'s exit status: a server, so a stop is its normal end (0); a job
        it supervised that ended other than finished is a problem (1), bad input included."""
        return EXIT_OK if self.ending in (Ending.FINISHED, Ending.STOPPED) else EXIT_PROBLEM

    @property
    def word(self) -> str:
        """The summary's first word: ``trainwatch run finished|failed|interrupted|...``."""
        if self.ending in (Ending.FINISHED, Ending.ALREADY_COMPLETE):
            return self.ending.value
        return "interrupted" if self.ending is Ending.STOPPED else "failed"

    @property
    def ended_early(self) -> bool:
        """Training stopped before its end: ``diagnose`` comes first among the next steps,
        and the newest checkpoint is where the same command resumes."""
        return self.ending not in (Ending.FINISHED, Ending.ALREADY_COMPLETE)

    def refusal(self, launch: LaunchLog) -> ConfigError:
        """The error a rejected input ends the run with (exit 2): the rank's words, else the
        end of the launch's log."""
        return ConfigError("the training job rejected its input (exit 2): "
                           + (self.why or launch.last_lines()))

    def message(self, run: RunDir, launch: LaunchLog) -> str | None:
        """The line after the summary that says why the run did not simply finish."""
        if self.ending is Ending.NONFINITE:
            return (f"trainwatch run: training ended with {self.why}: the model diverged or "
                    "was poisoned and nothing rolled it back (a rollback acts only while the "
                    f"job runs); see {run.journal_file}")
        if self.ending is Ending.UNSAVED:
            return (f"trainwatch run: the job ended, but {self.why}: what it trained since is "
                    f"not saved; see {run.journal_file}")
        if self.ending is Ending.LAUNCH_FAILED:
            first = launch.first_error()
            return ("trainwatch run: the job failed before any rank started (not restarted: "
                    "it would fail the same way)" + (f": {first}" if first else "")
                    + "; the end of its log:" + launch.last_lines(n=20))
        if self.ending is Ending.STOPPED and self.why:  # another node's stop ended the job
            return f"trainwatch run: {self.why}"
        if self.ending is Ending.NOT_RESTARTED and self.code != EXIT_INTERRUPTED:
            skipped = run.events("action_skipped")
            why = (f": {self.why}" if self.why
                   else f": {skipped[-1].get('reason')}" if skipped else "")
            return (f"trainwatch run: the job failed and was not restarted{why}; see "
                    f"{run.journal_file} and {run.logs_dir}/")
        return None


FINISHED = RunOutcome(Ending.FINISHED)
ALREADY_COMPLETE = RunOutcome(Ending.ALREADY_COMPLETE)
STOPPED = RunOutcome(Ending.STOPPED, EXIT_INTERRUPTED)
