"""What ``trainwatch run`` shows while the job runs: a live view, or progress lines.

The live view has a start-up state (nothing to show for the seconds torchrun and the
first step take), a progress bar with an ETA, columns that keep their width as numbers
grow, and a "no alerts" row, so an empty table never reads as "broken". Without the live
view (``--no-live``, logs, CI) a progress line is printed every ``every`` seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich import box
from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from trainwatch.alerts.engine import Engine
from trainwatch.rundir.run_dir import RunDir

# (header, width): fixed, so the table does not jump as values appear and grow.
RANK_COLUMNS = (("rank", 5), ("state", 12), ("step", 9), ("phase", 18), ("loss", 9),
                ("throughput", 18))


@dataclass
class Progress:
    """Steps done out of the target and an ETA from the rate since the first step seen."""

    target: int | None
    _first: tuple[float, int] | None = None
    step: int | None = None
    loss: float | None = None
    throughput: str | None = None
    ranks: list[dict] = field(default_factory=list)

    def update(self, run: RunDir, now: float | None = None,
               since: float | None = None) -> "Progress":
        """Read the ranks' statuses; ``since``: when the job's current start began, so the
        statuses an earlier start left (a restart's dead ranks) are not its progress."""
        now = time.time() if now is None else now
        self.ranks = run.statuses().records
        current = _newest_world([s for s in self.ranks if since is None or not _older(s, since)])
        done = [_done(s) for s in current]
        steps = [s for s in done if s is not None]
        if steps:
            step = self.step = min(steps)  # the job is as far as its slowest rank
            if self._first is None or step < self._first[1]:
                self._first = (now, step)  # first sight, or a restart went back
        elif len(current) < len(self.ranks):
            self.step = self.loss = self.throughput = None  # restarted: nothing new yet
        metrics = [s.get("metrics") or {} for s in current if s.get("rank") == 0]
        if metrics:
            self.loss = _number(metrics[0].get("loss"))
            self.throughput = _throughput(metrics[0])
        return self

    def eta_seconds(self, now: float | None = None) -> float | None:
        now = time.time() if now is None else now
        if self._first is None or self.step is None or not self.target:
            return None
        t0, s0 = self._first
        if self.step <= s0 or now <= t0:
            return None
        return max(0.0, (self.target - self.step) * (now - t0) / (self.step - s0))

    def line(self) -> str:
        """One progress line for logs: ``step 120/300 (40 %) · loss 2.31 · ETA 35 s``."""
        if self.step is None:
            return "starting: waiting for the first training step"
        parts = [f"step {self.step}" + (f"/{self.target} ({100 * self.step / self.target:.0f} %)"
                                        if self.target else "")]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.throughput is not None:
            parts.append(self.throughput)
        eta = self.eta_seconds()
        if eta is not None:
            parts.append(f"ETA {duration(eta)}")
        return " · ".join(parts)


def _throughput(metrics: dict) -> str | None:
    """Tokens per second, else samples per second: a job records either (docs/own-trainer.md)."""
    for key, unit in (("tokens_per_second", "tokens/s"), ("samples_per_second", "samples/s")):
        rate = _number(metrics.get(key))
        if rate is not None:
            return f"{rate:,.0f} {unit}"
    return None


def _older(status: dict, since: float) -> bool:
    started = status.get("started_at")
    return isinstance(started, (int, float)) and started < since


def _newest_world(statuses: list[dict]) -> list[dict]:
    """The statuses of the world the newest rank belongs to: when a job goes on with fewer
    ranks (a lost node, torchrun ``--nnodes MIN:MAX``), the lost ranks' last statuses stay
    behind, above the new world size, and are not the job's progress."""
    started = [s for s in statuses if isinstance(s.get("started_at"), (int, float))]
    newest = max(started, key=lambda s: s["started_at"], default=None)
    world = newest.get("world_size") if newest is not None else None
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        return statuses
    return [s for s in statuses if not isinstance(s.get("rank"), int) or s["rank"] < world]


def _done(status: dict) -> int | None:
    """Steps a rank has completed: the step of its last metrics record, plus one."""
    m = status.get("metrics") or {}
    step = m.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return step + 1
    return None


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds} s"


def live_view(run: RunDir, engine: Engine, progress: Progress, started: float,
              agent_url: str | None) -> Group:
    """Progress, the ranks, firing alerts and the last actions, in one renderable."""
    elapsed = duration(time.time() - started)
    header = Text(f"trainwatch run · {run.root} · {elapsed}", style="bold")
    header.append(f"   agent {agent_url}" if agent_url else "   agent not running",
                  style="dim")
    parts: list[RenderableType] = [header, _progress(progress), _ranks(progress),
                                   _alerts(engine), _actions(run)]
    return Group(*parts)


def _progress(p: Progress) -> Table:
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(ratio=1)
    grid.add_column(width=44)
    if p.step is None:
        grid.add_row(Text("starting: agent, torchrun and the ranks come up; the first step "
                          "takes a few seconds …", style="yellow"), "")
        return grid
    eta = p.eta_seconds()
    label = (f"step {p.step}" + (f"/{p.target}" if p.target else "")
             + (f" · ETA {duration(eta)}" if eta is not None else ""))
    grid.add_row(ProgressBar(total=p.target or None, completed=p.step), label)
    return grid


def _ranks(p: Progress) -> Table:
    table = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False)
    for header, width in RANK_COLUMNS:
        table.add_column(header, width=width, no_wrap=True,
                         justify="left" if header in ("state", "phase") else "right")
    if not p.ranks:
        table.add_row("-", "starting", "-", "-", "-", "-")
    for s in p.ranks:
        m = s.get("metrics") or {}
        loss = _number(m.get("loss"))
        done = _done(s)
        table.add_row(str(s.get("rank")), str(s.get("state") or "-"),
                      str(done) if done is not None else "-", str(s.get("phase") or "-"),
                      f"{loss:.4f}" if loss is not None else "-",
                      _throughput(m) or "-")
    return table


def _alerts(engine: Engine) -> Table:
    table = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False)
    for header, width in (("alert", 26), ("state", 8), ("severity", 8), ("summary", 50)):
        table.add_column(header, width=width, no_wrap=header != "summary",
                         overflow="ellipsis" if header != "summary" else "fold")
    firing = [a for a in engine.alerts() if a.state != "inactive"]
    for a in firing:
        table.add_row(a.name, a.state, a.rule.severity, a.annotations.get("summary", ""))
    if not firing:
        table.add_row(Text("no alerts", style="green"), "", "", "")
    return table


def _actions(run: RunDir) -> Text:
    actions = Text()
    for e in run.events("action_taken", "action_skipped", "job_started", "job_exited")[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(e.get("time", 0)))
        what = e.get("reason") or f"returncode {e.get('returncode')}"
        actions.append(f"{when} {e['event']}: {what}\n")
    return actions
