"""The end of ``trainwatch run``: what happened, in a few lines, and what to run next.

Read from the run directory after everything stopped (the same journal, metrics and
checkpoints ``trainwatch report`` reads), so it holds for a finished, failed or
interrupted run, with or without the live view.
"""

from __future__ import annotations

from collections import Counter

import importlib.util
import json
import logging
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainwatch.control.outcome import RunOutcome
from trainwatch.invocation import program
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import SkippedFile, read_run_file_tail

log = logging.getLogger(__name__)

LOSS_TAIL_BYTES = 64 * 1024  # a few hundred steps' records; a log may be gigabytes
ALREADY_COMPLETE_LINE = "Already complete — nothing to do (use a new --run-dir to train again)"


@dataclass
class Summary:
    run_dir: Path
    outcome: RunOutcome
    steps_done: int | None = None
    steps_target: int | None = None
    final_loss: float | None = None
    nonfinite_since: int | None = None   # the step from which the loss stayed NaN/Inf
    goodput: float | None = None
    incidents: list[str] = field(default_factory=list)
    checkpoints: int = 0
    newest_checkpoint: tuple[int | None, str | None] | None = None  # (step, reason saved)
    newest_checkpoint_note: str | None = None                        # e.g. "DCP, declared by the job"
    problems: list[str] = field(default_factory=list)               # what could not be read

    def next_commands(self) -> list[tuple[str, str]]:
        rd, tw = shlex.quote(str(self.run_dir)), program()
        cmds = [(f"{tw} report {rd}", "where the time went, incidents, cost")]
        if importlib.util.find_spec("plotly") is not None:  # the [html] extra
            cmds.append((f"{tw} report {rd} --html report.html", "the same as charts, one page"))
        if self.outcome.ended_early:
            cmds.insert(0, (f"{tw} diagnose {rd}", "why it stopped, with the evidence"))
        cmds.append((f"{tw} dashboards export --out DIR",
                     "Grafana dashboards (deploy/compose/ runs Grafana with them)"))
        return cmds


def summarize(run: RunDir, outcome: RunOutcome, target_steps: int | None = None) -> Summary:
    """A summary of the run as its directory tells it; what cannot be read is listed, not
    raised (a summary must never turn a run's exit into a traceback)."""
    s = Summary(run.root, outcome, steps_target=target_steps)
    try:
        _from_report(s, run)
    except Exception as exc:  # the summary is best effort, the run is over
        log.debug("report for the summary failed", exc_info=True)
        s.problems.append(f"report: {exc}")
    s.final_loss, s.nonfinite_since = final_loss(run)
    _checkpoints(s, run)
    return s


def final_loss(run: RunDir) -> tuple[float | None, int | None]:
    """The run's last loss, and the step from which it stayed NaN/Inf when it did: the one
    reading of "how did training end" that the summary shows and the exit code follows."""
    finished = run.events("finished")
    loss = _number(finished[-1].get("loss")) if finished else None
    return (loss, None) if loss is not None else _last_loss(run)


def ended_nonfinite(run: RunDir) -> str | None:
    """``a NaN loss since step N`` when training ended with a non-finite loss, else None
    (also when the run directory cannot tell: the run's exit must not become a traceback)."""
    try:
        loss, since = final_loss(run)
    except Exception:
        log.debug("the final loss could not be read", exc_info=True)
        return None
    if loss is None or math.isfinite(loss):
        return None
    return "a " + _nonfinite_text(loss, since, what=" loss")


def _from_report(s: Summary, run: RunDir) -> None:
    from trainwatch.report import cost, goodput, render, timeline

    tl = timeline.read_timeline(run)
    data = render.report(tl, goodput.account(tl), cost.load_settings(None))
    s.goodput = data.get("goodput_ratio")
    steps = data.get("steps") or {}
    s.steps_done = steps.get("completed")  # the count diagnose and checkpoints show
    s.steps_target = s.steps_target or steps.get("target")
    s.incidents = [str(i.get("cause")) for i in data.get("incidents") or []]


def _last_loss(run: RunDir) -> tuple[float | None, int | None]:
    """The reference trainer journals its loss; any loop's ranks log it every step: the
    newest loss at the end of the lowest rank's metrics log, and when it is NaN/Inf the
    step from which it stayed so (a run that ended in NaN must not read as its last
    finite loss)."""
    for event in reversed(run.events("step_milestone")):
        loss = _number(event.get("loss"))
        if loss is not None:
            return loss, None
    for rank in run.ranks_with_metrics()[:1]:
        try:
            tail = read_run_file_tail(run.metrics_file(rank), run.root, max_bytes=LOSS_TAIL_BYTES)
        except (OSError, SkippedFile):
            return None, None
        last, since = None, None
        for line in reversed(tail.splitlines()[1:] if len(tail) == LOSS_TAIL_BYTES
                             else tail.splitlines()):
            try:
                record = json.loads(line)
                loss = _number(record.get("loss"))
            except (ValueError, AttributeError):
                continue
            if loss is None:
                continue
            if math.isfinite(loss):
                return (loss, None) if last is None else (last, since)
            last = loss if last is None else last
            step = record.get("step")
            since = step if isinstance(step, int) else since
        return last, since
    return None, None


def unsaved_end(run: RunDir) -> str | None:
    """Why the job's training is on no disk when its newest save failed (a full disk) at a
    step after its newest saved one: it may have trained on and exited 0, but nothing after
    that save was kept, and the failure's own reason (a guess at the disk only when none was
    recorded). None when a newer save succeeded (a failure it recovered from; a
    mirror copy that failed, which names no step), or the journal cannot tell."""
    try:
        events = run.events("checkpoint_saved", "checkpoint_failed")
    except Exception:
        log.debug("the checkpoint events could not be read", exc_info=True)
        return None
    steps = {name: [e for e in events if e.get("event") == name and type(e.get("step")) is int]
             for name in ("checkpoint_saved", "checkpoint_failed")}
    failed = max(reversed(steps["checkpoint_failed"]), key=lambda e: e["step"],  # the last
                 default=None)
    saved = max((e["step"] for e in steps["checkpoint_saved"]), default=None)
    if failed is None or (saved is not None and saved >= failed["step"]):
        return None
    error = str(failed.get("error") or "").strip()
    return (f"its checkpoint save of step {failed['step']} failed: "
            + (error[:300] if error else "no reason recorded (is the disk full?)")
            + "; the newest saved is " + (f"step {saved}" if saved is not None else "none"))


def _checkpoints(s: Summary, run: RunDir) -> None:
    """Complete checkpoints wherever the run put them (run.json), and the DCP checkpoints
    its job declared (docs/checkpoints.md, "Declared DCP checkpoints")."""
    try:
        from trainwatch.checkpoint_format.catalog import LISTED_FIRST
        from trainwatch.checkpoint_format.declared import run_checkpoints
    except ImportError:
        return
    entries = [e for e in run_checkpoints(run) if e.state in LISTED_FIRST]
    s.checkpoints = len(entries)
    if entries:
        newest = max(entries, key=lambda e: e.step if e.step is not None else -1)
        s.newest_checkpoint = (newest.step, (newest.manifest or {}).get("reason"))
        if newest.manifest is None:  # not trainwatch's: a DCP checkpoint
            s.newest_checkpoint_note = newest.kind.upper() + (", declared by the job"
                                                              if newest.declared else "")


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


# --------------------------------------------------------------------------- text

def render(s: Summary, console: Console) -> None:
    """The summary table. What the run says (paths, incident causes quoting a job's error
    such as gloo's ``[/__w/.../pair.cc:553]``) is Text, never read as rich markup."""
    console.print(Text.assemble((f"trainwatch run {s.outcome.word}:", "bold"),
                                f" {s.run_dir}"), highlight=False)
    table = Table(show_header=False, box=box.ROUNDED)
    table.add_column("what", style="bold")
    table.add_column("value")

    def row(what: str, value: str) -> None:
        table.add_row(what, Text(value))

    if s.steps_done is not None or s.steps_target is not None:
        row("steps", f"{s.steps_done if s.steps_done is not None else '?'}"
            + (f" of {s.steps_target}" if s.steps_target else "") + " completed")
    row("final loss", _loss_text(s))
    row("goodput", f"{100 * s.goodput:.1f} %" if s.goodput is not None else "-")
    row("incidents", incidents_text(s.incidents) if s.incidents else "none")
    row("checkpoints", _checkpoint_text(s))
    for problem in s.problems:
        row("could not read", problem)
    console.print(table)
    console.print("next:")
    width = max(len(cmd) for cmd, _ in s.next_commands())
    for cmd, what in s.next_commands():
        console.print(Text(f"  {cmd.ljust(width)}   # {what}"), highlight=False,
                      soft_wrap=True)


def incidents_text(causes: list[str]) -> str:
    """``3: rank 1 killed by SIGKILL (2 times); …``: every incident counted, the same
    cause said once with how often, in the order they first happened."""
    counts = Counter(causes)
    said = sorted(counts, key=causes.index)
    return f"{len(causes)}: " + "; ".join(c if counts[c] == 1 else f"{c} ({counts[c]} times)"
                                          for c in said)


def _loss_text(s: Summary) -> str:
    if s.final_loss is None:
        return "-"
    if math.isfinite(s.final_loss):
        return f"{s.final_loss:.4f}"
    return (f"{_nonfinite_text(s.final_loss, s.nonfinite_since)}: the model diverged or was "
            "poisoned, nothing rolled it back (trainwatch diagnose)")


def _nonfinite_text(loss: float, since: int | None, what: str = "") -> str:
    """``NaN since step N`` (``what`` goes after the value: ``NaN loss since step N``)."""
    return (f"{'NaN' if math.isnan(loss) else loss}{what}"
            + (f" since step {since}" if since is not None else ""))


def _checkpoint_text(s: Summary) -> str:
    if not s.checkpoints:
        return "none"
    step, reason = s.newest_checkpoint or (None, None)
    text = f"{s.checkpoints}, newest at step {step}"
    if s.newest_checkpoint_note:
        text += f" ({s.newest_checkpoint_note})"
    elif reason == "stop":
        text += " (saved on stop: the same command resumes from it)"
    elif s.outcome.ended_early:
        text += " (the same command resumes from it)"
    return text
