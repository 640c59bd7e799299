"""What the job wrote to its log in one launch: why it failed, or the input it refused.

The job's log is kept across launches (``logs/job.log``), so a launch's part starts at the
log's size when it started; only its end is read (``JOB_LOG_TAIL_BYTES``), by the safe
reader, never the whole log of a job that printed gigabytes. Under a supervisor the
output's tail in memory (``JobOutput``) is read instead: the log is best effort, and a
full disk must not cost the job's last words.
"""

from __future__ import annotations

import re
from pathlib import Path

from trainwatch.contract.layout import JOB_LOG
from trainwatch.control.job_output import JobOutput
from trainwatch.errors import ConfigError, FormatError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import read_run_file_tail

# The end of the job's log a refusal or a failed launch quotes: its last lines.
JOB_LOG_TAIL_BYTES = 64 * 1024

# A line that says why a launch failed (a missing script, an import error, a bad option),
# not the launcher's failure table (its "error_file:" field) that follows it.
_CONFIG_ERROR_LINE = f"{ConfigError.__module__}.{ConfigError.__qualname__}: "  # a traceback's end
_WHY_LINE = re.compile(r"can't open file|No such file|not found|\b\w*Error\b:?|error:", re.I)


class LaunchLog:
    """The job's log from ``offset`` on: this launch's part of it (from ``output``'s tail
    after ``mark`` when given: what the supervisor's own copy holds)."""

    def __init__(self, run: RunDir, offset: int, output: JobOutput | None = None,
                 mark: int = 0):
        self.run, self.offset, self.output, self.mark = run, offset, output, mark

    @classmethod
    def from_now(cls, run: RunDir, output: JobOutput | None = None) -> "LaunchLog":
        """The part a launch started now will write."""
        mark = output.position if output is not None else 0
        try:
            return cls(run, (run.logs_dir / JOB_LOG).stat().st_size, output, mark)
        except OSError:
            return cls(run, 0, output, mark)

    def text(self) -> str | None:
        if self.output is not None:
            return self.output.since(self.mark)[-JOB_LOG_TAIL_BYTES:].decode(errors="replace")
        return launch_text(self.run, self.offset)

    def first_error(self) -> str | None:
        """The first line that says why the launch failed, else None."""
        text = self.text() or ""
        return next((ln.strip()[:300] for ln in text.splitlines()
                     if _WHY_LINE.search(ln) and "error_file" not in ln
                     and not ln.lstrip().startswith(("File ", "Traceback"))), None)

    def refused(self) -> str | None:
        """What trainwatch's ConfigError said, if the log ends a traceback with one."""
        text = self.text() or ""
        return next((ln.split(_CONFIG_ERROR_LINE, 1)[1].strip()[:300]
                     for ln in text.splitlines() if _CONFIG_ERROR_LINE in ln), None)

    def last_lines(self, n: int = 5) -> str:
        if self.output is not None:
            return _quote(self.text() or "", self.run.logs_dir / JOB_LOG, n)
        return new_lines(self.run, self.offset, n)


def launch_text(run: RunDir, offset: int) -> str | None:
    """The end of what the job wrote to its log from ``offset`` on, at most
    JOB_LOG_TAIL_BYTES of it (None: it cannot be read)."""
    try:
        return read_run_file_tail(run.logs_dir / JOB_LOG, run.root, max_bytes=JOB_LOG_TAIL_BYTES,
                                  start=offset).decode(errors="replace")
    except (OSError, FormatError):
        return None


def new_lines(run: RunDir, offset: int, n: int = 5) -> str:
    """The last ``n`` lines of the log from ``offset`` on, indented (or why there are none)."""
    path = run.logs_dir / JOB_LOG
    text = launch_text(run, offset)
    if text is None:
        return f"no {path}"
    return _quote(text, path, n)


def _quote(text: str, path: Path, n: int) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return f"nothing in {path}"
    return "\n  " + "\n  ".join(lines[-n:])
