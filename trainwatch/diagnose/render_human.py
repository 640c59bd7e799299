"""The on-call engineer's view: ranks at a glance, then findings, most urgent first."""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from trainwatch.rundir import attempts
from trainwatch.diagnose.model import Evidence, Finding, step_label
from trainwatch.redact import redact_text

_STYLE = {"critical": "bold red", "warning": "yellow", "info": "green"}


def render(ev: Evidence, findings: list[Finding], console: Console) -> None:
    job = (ev.run or {}).get("job") or next((v.get("job") for v in ev.ranks.values()), "?")
    console.print(Text(redact_text(f"trainwatch diagnose: {ev.run_dir} (job {job}, "
                                   f"{len(ev.ranks)} rank(s), seen from {ev.host})"),
                       style="bold"))
    console.print(Text(redact_text(context_line(ev)), style="dim"))
    if ev.ranks:
        console.print(rank_table(ev, findings))
    if ev.former_ranks:
        sizes = sorted(set(ev.former_ranks.values()))
        console.print(Text(f"rank(s) {sorted(ev.former_ranks)} ran in an earlier attempt at "
                           f"world size {', '.join(map(str, sizes))}; the newest attempt has "
                           f"{len(ev.ranks)} rank(s) (resumed at a smaller world size): not "
                           "listed", style="dim"))
    for i, finding in enumerate(findings, 1):
        console.print(finding_panel(i, finding))
    if ev.unseen:
        console.print(Text("Could not see:", style="bold"))
        for line in ev.unseen:
            console.print(Text(redact_text(f"  - {line}")))
    if ev.skipped:
        console.print(Text(f"Skipped {len(ev.skipped)} unreadable file(s)/line(s):", style="bold"))
        for line in ev.skipped[:10]:
            console.print(Text(redact_text(f"  - {line}")))


def context_line(ev: Evidence) -> str:
    """Attempts and restarts, the newest checkpoint and firing alerts: what on-call asks first."""
    newest = (ev.checkpoints or {}).get("newest")
    if newest:
        age = newest.get("age_seconds")
        ckpt = f"step {newest.get('step')}" + (f", {age:.0f} s old" if age is not None else "")
    else:
        ckpt = "unknown"
    alerts = sorted({str(r.get("alert") or r.get("alertname"))
                     for r in ev.journal.get("firing_alerts", [])})
    restarts = ev.journal.get("restarts")
    return (f"{attempts.describe(restarts) if restarts else 'attempts unknown'} · "
            f"newest checkpoint: {ckpt} · "
            f"alerts firing (journal): {', '.join(alerts) or 'none'}")


MAX_TABLE_RANKS = 32
WRAPPING_COLUMNS = ("node", "process", "step", "phase")


def shown_ranks(ev: Evidence, findings: list[Finding]) -> list[int]:
    """Every rank of a small job; of a large one, the ranks the findings name, then the first
    few others (the table is for reading, --json has them all)."""
    if len(ev.ranks) <= MAX_TABLE_RANKS:
        return sorted(ev.ranks)
    named = sorted({r for f in findings for r in f.ranks if r in ev.ranks and f.severity != "info"})
    rest = [r for r in sorted(ev.ranks) if r not in named]
    return sorted(named[:MAX_TABLE_RANKS] + rest[:max(0, MAX_TABLE_RANKS // 2 - len(named))])


def rank_table(ev: Evidence, findings: list[Finding]) -> Table:
    table = Table(title="Ranks", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0))
    for column in ("rank", "node", "pid", "process", "state", "step", "phase", "for",
                   "beat", "progress"):
        # In 80 columns (a pipe, a small terminal) the text cells wrap, so that rank, pid,
        # state and the ages, which a reader acts on, stay whole.
        wraps = column in WRAPPING_COLUMNS
        table.add_column(column, no_wrap=not wraps, overflow="fold" if wraps else "ellipsis",
                         max_width=14 if column in ("node", "phase") else None)
    shown = shown_ranks(ev, findings)
    if len(shown) < len(ev.ranks):
        table.caption = (f"{len(shown)} of {len(ev.ranks)} ranks: those the findings name, then "
                         "the first others (--json lists every rank)")
    for rank in shown:
        v = ev.ranks[rank]
        table.add_row(str(rank), str(v.get("node")), str(v.get("pid")),
                      str((v.get("process") or {}).get("status")), str(v.get("state")),
                      step_label(v), str(v.get("phase")), _age(v.get("phase_age")),
                      _age(v.get("heartbeat_age")), _age(v.get("progress_age")))
    return table


def finding_panel(index: int, f: Finding) -> Panel:
    lines: list[Text] = [Text(redact_text(f.title), style="bold")]
    who = []
    if f.ranks:
        who.append(f"rank(s) {', '.join(map(str, f.ranks))}")
    if f.nodes:
        who.append(f"node(s) {', '.join(f.nodes)}")
    if who:
        # A node's event says where it happened; it blames no rank.
        label = "ranks" if f.severity == "info" else "where" if f.category == "node" \
            else "culprit"
        lines.append(Text(f"{label}: " + "; ".join(who), style="bold"))
    lines += [Text(redact_text(f"  • {e}")) for e in f.evidence]
    if f.stack:
        lines.append(Text("stack (innermost last):", style="bold"))
        lines += [Text(redact_text(f"    {s}"), style="dim") for s in f.stack]
    if f.runbook:
        lines.append(Text(f"runbook: trainwatch runbook {f.runbook}", style="cyan"))
    if f.next_command:
        lines.append(Text(redact_text(f"next: {f.next_command}"), style="cyan"))
    title = Text(f"{index}. {f.severity} · {f.category} · confidence {f.confidence}",
                 style=_STYLE[f.severity])
    return Panel(Group(*lines), title=title, title_align="left", border_style=_STYLE[f.severity])


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"
