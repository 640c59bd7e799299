"""From evidence to ranked findings: who is the culprit, how sure we are, what to do.

Each ``check_*`` function looks at one kind of problem and adds findings; ranks
already explained by an earlier, stronger finding (dead, frozen) are not blamed
again. When nothing is wrong the single finding is ``healthy``.
"""

from __future__ import annotations

import re
import signal
import statistics
import time
from typing import Any

from trainwatch.rundir import attempts
from trainwatch.rundir.torchrun_log import PEER_FAILURE, failure_time
from trainwatch.contract.stall import (default_options, heartbeat_stale, published_budget,
                                      stall_budget)
from trainwatch.contract.states import COLLECTIVE_PHASES
from trainwatch.contract.timing import job_window
from trainwatch.diagnose import (agents, causes, collectives, corruption, journal, prometheus,
                                  workers)
from trainwatch.diagnose.model import Evidence, Finding, step_label
from trainwatch.diagnose.stacks import format_frames, main_stack, main_thread, qualified

STRAGGLER_LATENESS_RATIO = 0.15   # entering collectives this much of a step after the others
STRAGGLER_LATENESS_FLOOR = 0.02   # seconds: below this it is scheduling noise
STRAGGLER_TIMING_RATIO = 1.3      # local time vs the job median
LOW_FREE_RATIO = 0.02
BUSY_CPU_PERCENT = 80.0           # main thread running or runnable, over diagnose's sample
DEFAULT_HEARTBEAT_INTERVAL = 1.0  # trainer telemetry's default, for ranks that do not say

# Where a rank that is not in a collective is, from its stack (first match wins).
_WHERE = (
    ("data loading", re.compile(r"torch/utils/data|__getitem__|__next__|_next_data|dataset",
                                re.I)),
    ("a lock or condition (possible deadlock)", re.compile(
        r"threading\.py:\d+ in (acquire|wait)|\bacquire\b|_wait_for_tstate_lock|Condition\.wait")),
    ("a file lock", re.compile(r"\b(fcntl\.)?(flock|lockf)\b")),
    ("GPU work (device synchronisation)", re.compile(r"torch/cuda|synchronize", re.I)),
    ("file I/O", re.compile(r"serialization\.py|\b(write|fsync|flush|read|open)\b|_save|shutil")),
)
_CAUSE_WHERE = {"deadlock": "a deadlock between its threads", "lock": "a lock",
                "file_lock": "a file lock"}
_PHASE_WHERE = {"data": "data loading", "checkpoint": "file I/O (checkpoint)",
                "eval": "evaluation"}
_IN_COLLECTIVE = re.compile(r"torch/distributed/|c10d")


class Analysis:
    """Shared facts the checks need, computed once."""

    def __init__(self, ev: Evidence, stall_after: float | None):
        self.ev = ev
        # Ranks gone with a "running" status that the supervisor's last act stopped (they
        # did not save on SIGTERM): the stop, not deaths; not running either.
        self.stop = ev.journal.get("stopped")
        self.stopped = {r for r, v in ev.ranks.items()
                        if self.stop and v.get("state") == "running"
                        and self.proc(r) in ("gone", "zombie")
                        and isinstance(v.get("started_at"), (int, float))
                        and v["started_at"] <= self.stop["time"]}
        self.running = {r: v for r, v in ev.ranks.items()
                        if v.get("state") == "running" and r not in self.stopped}
        step_times = [v["recent"]["step_time"] for v in ev.ranks.values()
                      if (v.get("recent") or {}).get("step_time")]
        self.step_time = statistics.median(step_times) if step_times else None
        # The agent's stall rule: its published budget, else the options the run recorded,
        # else the defaults (an explicit --stall-after wins over all). Without a known step
        # time the floor applies: diagnose is asked because something already looks wrong.
        self.stall_options = ev.journal.get("stall_options") or default_options()
        job = (ev.run or {}).get("job") or next(
            (v.get("job") for v in ev.ranks.values() if v.get("job")), None)
        self.stall_after = stall_after or published_budget(ev.agents, job) or stall_budget(
            self.stall_options, self.step_time or 0.0, use_phase=False)
        ages = [v["progress_age"] for v in self.running.values()
                if v.get("progress_age") is not None]
        self.progress_age = min(ages) if ages else None
        self.stalled = bool(self.running) and self.progress_age is not None and \
            self.progress_age > self.stall_after
        self.groups = collectives.analyse(ev.collectives.get("groups", {}))
        ev.collectives["analysis"] = self.groups
        self.crossed = collectives.crossed_waits(self.groups)
        ev.collectives["crossed"] = self.crossed
        self.explained: set[int] = set()

    def proc(self, rank: int) -> str:
        return (self.ev.ranks[rank].get("process") or {}).get("status", "unknown")

    def node(self, rank: int) -> str:
        return str(self.ev.ranks[rank].get("node") or "?")

    def where_line(self, rank: int) -> str:
        v = self.ev.ranks[rank]
        beat = v.get("from_beat")
        source = (f" (from its beat file; its status file says step {beat['status_step']})"
                  if beat and beat.get("status_step") != v.get("step") else "")
        publish = v.get("publish")
        since = (publish or {}).get("failing_since")
        failing = (f"; it could not write its status since {_s(self.ev.collected_at - since)} "
                   f"ago: {publish.get('last_error')}" if publish and since else "")
        return (f"rank {rank} on {self.node(rank)} (pid {v.get('pid')}): step {step_label(v)}"
                f"{source}, phase {v.get('phase')} for {_s(v.get('phase_age'))}, heartbeat "
                f"{_s(v.get('heartbeat_age'))} old, last progress {_s(v.get('progress_age'))} "
                f"ago, process {self.proc(rank)}{failing}")

    def stack(self, rank: int) -> list[dict[str, Any]]:
        return main_stack(self.ev.stacks.get(rank))

    def waiting_lines(self, culprits: list[int]) -> list[str]:
        """Who waits for the culprits, and in which collective."""
        lines = []
        for pg, a in self.groups.items():
            missing = [r for r in a["behind"] if r in culprits]
            if a["waiting"] and (missing or set(culprits) - set(a["ranks"])):
                lines.append(f"process group {pg} ({a['desc']}): rank(s) {a['waiting']} wait in "
                             f"collective #{a['frontier']} {a['frontier_op']}"
                             + (f"; rank(s) {missing} never entered it" if missing else ""))
        if not lines:
            others = [r for r in self.running if r not in culprits
                      and self.proc(r) not in ("gone", "zombie", "stopped")]
            in_coll = [r for r in others if _in_collective(self.stack(r))]
            if in_coll:
                lines.append(f"rank(s) {in_coll} are inside a torch.distributed call "
                             "(their stacks), waiting")
            elif others:
                lines.append(f"rank(s) {others} are alive but made no progress for "
                             f"{_s(self.progress_age)}")
        return lines


def analyse(ev: Evidence, stall_after: float | None = None) -> list[Finding]:
    a = Analysis(ev, stall_after)
    found: list[Finding] = []
    for check in (check_dead, check_frozen, check_desync, check_crossed, check_busy,
                  check_outside_collective,
                  check_blocked_in_kernel, check_unexplained_stall, check_storage_and_checkpoints, check_nonfinite,
                  check_silent_corruption, check_straggler, check_node_evidence):
        found += check(a)
    if not any(f.severity in ("critical", "warning") for f in found):
        found.insert(0, healthy(a))
    abandoned(a, found)
    # Among notes, the verdict on now (healthy, finished) before history (a recovered death).
    found.sort(key=lambda f: (f.sort_key()[0], f.category != "healthy", *f.sort_key()[1:]))
    return found


# --------------------------------------------------------------------------- checks

def check_dead(a: Analysis) -> list[Finding]:
    """Dead ranks now, and deaths of earlier attempts the run recovered from (history).

    torchrun's failure table names the process (pid) that failed: when a later attempt
    replaced that rank's process, the death is the past, not what is wrong now.
    """
    root = a.ev.launcher.get("root_cause")
    past = [root] if root and root.get("rank") in a.ev.ranks and not _current(a.ev, root) \
        else []
    failures = [x for x in a.ev.launcher.get("failures", []) if _current(a.ev, x)]
    return [_recovered(a, x) for x in past] + _dead_now(a, None if past else root, failures)


def _current(ev: Evidence, entry: dict[str, Any]) -> bool:
    """A launcher's failure entry is about the rank's current process, or cannot be told
    apart from it (no pid on one side)."""
    rank = entry.get("rank")
    pid = (ev.ranks.get(rank) or {}).get("pid") if isinstance(rank, int) else None
    return not (isinstance(pid, int) and isinstance(entry.get("pid"), int)
                and pid != entry["pid"])


def _recovered(a: Analysis, entry: dict[str, Any]) -> Finding:
    """An earlier attempt's death, as history: in which attempt, and how the run went on."""
    rank, ev = entry["rank"], a.ev
    tried = ev.journal.get("attempts") or []
    n = next((i for i, g in enumerate(tried) if entry["pid"] in g["pids"].values()), None)
    if n is None:
        title = (f"rank {rank} died in an earlier attempt ({_exit_text(entry['exitcode'])}); "
                 f"recovered: it runs again as pid {ev.ranks[rank].get('pid')}")
    else:
        resumed = tried[n + 1]["resumed_step"] if n + 1 < len(tried) else None
        how = (f"restarted from step {resumed}" if resumed is not None
               else "started again (no checkpoint resumed in the journal)")
        title = (f"rank {rank} died in attempt {n + 1} ({_exit_text(entry['exitcode'])}); "
                 f"recovered: attempt {n + 2} {how}")
    evidence = [f"torchrun named pid {entry['pid']} the root cause (first observed failure): "
                f"{_exit_text(entry['exitcode'])} ({entry['log']})",
                f"now: {a.where_line(rank)}"]
    if (ev.journal.get("restarts") or {}).get("attempts"):
        evidence.append(f"journal: {attempts.describe(ev.journal['restarts'])}")
    return Finding("rank_dead", title, severity="info",
                   confidence="high" if n is not None else "medium", ranks=[rank],
                   nodes=[a.node(rank)], evidence=evidence, runbook="TrainingRankDown",
                   next_command=f"trainwatch report {ev.run_dir}   # the incident and its cost")


def _dead_now(a: Analysis, root: dict[str, Any] | None,
              failures: list[dict[str, Any]]) -> list[Finding]:
    """Dead ranks, and which one failed first — only as far as the evidence can order them.

    torchrun's root cause (its first observed failure) or its failure lines decide when
    present. Without them, last heartbeats order deaths only when they lie further apart
    than the heartbeat interval (and the clock's resolution); closer than that it is a tie,
    said as one, with the other evidence (exit signals, the first error in the logs).
    """
    ev = a.ev
    by_pid = {v.get("pid"): r for r, v in ev.ranks.items()}
    launcher = [(by_pid[x["pid"]], x) for x in ev.launcher.get("failed", []) if x["pid"] in by_pid]
    culprits: dict[int, str] = {}
    doubted = _doubt_root(ev, root) if root and root.get("rank") in ev.ranks else None
    if doubted:
        rank, why = doubted
        culprits[rank] = why
    elif root and root.get("rank") in ev.ranks:
        culprits[root["rank"]] = (f"torchrun names it the root cause (first observed failure): "
                                  f"{_exit_text(root['exitcode'])} ({root['log']})"
                                  + (f"; its error file says: {root['error']}"
                                     if root.get("error") else ""))
    elif launcher:
        culprits = {r: f"the launcher logged its exit: {_exit_text(x['exitcode'])} ({x['log']})"
                    for r, x in launcher}
    gone = [r for r, v in ev.ranks.items()
            if v.get("state") == "running" and a.proc(r) in ("gone", "zombie")]
    dead = [r for r in gone if r not in a.stopped]
    failed = [r for r, v in ev.ranks.items() if v.get("state") == "failed"]
    # A rank whose recorded error is a peer's failure seen from a collective (or that
    # recorded none: its beat says failed, its status could not be written) followed the
    # rank that raised on its own, or died without a word: it is a culprit only when
    # nothing else explains the deaths.
    own = [r for r in failed if (message := _failure_message(ev.ranks[r]))
           and not PEER_FAILURE.search(message)]
    peers = [r for r in failed if r not in own]
    tie: list[int] = []
    if not culprits and dead and not own:
        tie, why = order_by_heartbeat(ev, dead)
        for r in (tie[:1] if len(tie) == 1 else []):
            culprits[r] = why
    for r in own or ([] if culprits or tie else peers):
        message = _failure_message(ev.ranks[r])
        culprits.setdefault(r, "its telemetry recorded state 'failed'"
                            + (f": {message[:200]}" if message else " (an exception)"))
    dead += [r for r in peers if r not in culprits]
    # A run stopped while it hung: the stop ended a hang, which is what to explain.
    hang = hang_before_death(a, gone, root)
    if not culprits and not tie:
        return [hang] if hang else []
    a.explained |= set(culprits) | set(dead)
    findings = [hang] if hang else []
    killed_by_oom: set[int] = set()
    if len(tie) > 1 and not culprits:
        return findings + [_ended_hang(_tie_finding(a, tie, why), hang)]
    for rank, why in sorted(culprits.items()):
        evidence = [a.where_line(rank), why]
        followers = sorted(set(dead) - set(culprits))
        torn_down = [f"rank {x['rank']}: {_exit_text(x['exitcode'])}"
                     for x in failures + ([root] if root and doubted else [])
                     if x.get("rank") != rank]
        if torn_down:
            evidence.append("torchrun then stopped the others: " + ", ".join(torn_down))
        elif followers:
            evidence.append(f"rank(s) {followers} also exited afterwards (stopped by the "
                            "launcher or failed in the collective)")
        evidence += _first_error_lines(ev)
        if (ev.journal.get("restarts") or {}).get("restarts"):
            evidence.append(f"journal: {attempts.describe(ev.journal['restarts'])} so far")
        exitcode = (root["exitcode"] if root and root.get("rank") == rank else
                    next((x["exitcode"] for x in failures
                          if x.get("rank") == rank),
                         next((x["exitcode"] for r, x in launcher if r == rank), None)))
        from_launcher = (root and root.get("rank") == rank) or rank in dict(launcher)
        confident = (from_launcher or rank in failed) and not doubted
        hint = ("dmesg -T | grep -i -E 'killed process|out of memory'" if exitcode == -9
                else f"tail -n 100 {ev.run_dir}/logs/*.log")
        title = f"rank {rank} is dead"
        if exitcode in (-9, None):
            oom_title, oom_lines, oom_sure = _oom(ev.ranks[rank])
            evidence += oom_lines
            if oom_title:
                title = f"rank {rank} was {oom_title}"
                confident = confident and oom_sure
                if oom_sure:
                    killed_by_oom.add(rank)
        findings.append(Finding(
            "rank_dead", title, ranks=[rank], nodes=[a.node(rank)],
            confidence="high" if confident else "medium",
            evidence=evidence, runbook="TrainingRankDown", next_command=hint,
            stack=format_frames(a.stack(rank))))
    # An OOM kill is a cause of its own, even after a slow stretch (allocating): no hang.
    if hang and set(hang.ranks) <= killed_by_oom:
        return [f for f in findings if f is not hang]
    return [f if f is hang or set(f.ranks) & killed_by_oom else _ended_hang(f, hang)
            for f in findings]


def _oom(view: dict[str, Any]) -> tuple[str | None, list[str], bool]:
    """(title, evidence, sure) about an OOM kill of a SIGKILLed rank: the kernel's line for
    its pid decides; without a readable kernel log, its cgroup's OOM kill count suggests."""
    oom = view.get("oom")
    if not oom:
        return None, [], False
    where = (f"cgroup {oom.get('cgroup')}, limit {_bytes(oom.get('limit_bytes'))}"
             if oom.get("cgroup") else "its memory cgroup unknown")
    lines = []
    if oom.get("oom_kills") is not None:
        lines.append(f"memory cgroup {oom.get('cgroup')}: {oom['oom_kills']} OOM kill(s) "
                     f"counted, limit {_bytes(oom.get('limit_bytes'))}")
    kernel = oom.get("kernel")
    if kernel and kernel.get("line"):
        lines.append(f"kernel log: {kernel['line']}")
        if kernel.get("memcg"):
            where = (f"cgroup {kernel['memcg']}, limit {_bytes(oom.get('limit_bytes'))}")
        return f"killed by the OOM killer ({where})", lines, True
    if oom.get("kernel_error"):
        lines.append(f"kernel log not readable: {oom['kernel_error']}")
        if oom.get("oom_kills"):
            return (f"killed by SIGKILL, most likely by the OOM killer ({where})", lines,
                    False)
        return None, lines, False
    lines.append(f"the kernel log has no OOM kill of pid {view.get('pid')}: not the OOM "
                 "killer")
    return None, lines, False


def _bytes(n: int | None) -> str:
    return "none (unlimited)" if n is None else f"{n / 2**30:.2f} GiB"


def hang_before_death(a: Analysis, dead: list[int],
                      root: dict[str, Any] | None) -> Finding | None:
    """Dead ranks whose job had stopped progressing well before they died: the deaths
    ended a hang (a timeout, the launcher, an operator), the hang is what to explain.

    The job's last progress is the newest step any rank completed; its death, the last
    heartbeat of a dead rank, or torchrun's first observed failure (``root``) when that was
    earlier: a rank that outlived a killed peer (finishing a slow batch, deferring SIGTERM
    until its step ends) beats on without a step, which is teardown, not a hang. Where each
    rank was comes from its last status: ranks in a phase outside collectives are the ones
    the others waited for.
    """
    ranks = a.ev.ranks
    ages = [v["progress_age"] for v in ranks.values()
            if isinstance(v.get("progress_age"), (int, float))]
    deaths = [ranks[r]["heartbeat_at"] for r in dead
              if isinstance(ranks[r].get("heartbeat_at"), (int, float))]
    if not ages or not deaths:
        return None
    progress_at = a.ev.collected_at - min(ages)
    died_at, death = max(deaths), "the last heartbeat of a dead rank"
    observed = failure_time((root or {}).get("time"))
    # torchrun's time is its poll's, to the second: the death was before the next second.
    # One before the job's last progress is another clock (a time zone): not evidence.
    if observed is not None and progress_at - a.stall_after <= observed + 1 < died_at:
        died_at, death = observed + 1, "torchrun observed the first failure"
    stalled = died_at - progress_at
    if stalled <= a.stall_after:
        return None
    phases = {r: str(v.get("phase") or "") for r, v in ranks.items() if r in dead}
    outside = sorted(r for r, p in phases.items() if p and p not in COLLECTIVE_PHASES)
    inside = sorted(r for r, p in phases.items() if p in COLLECTIVE_PHASES)
    evidence = [f"the last step any rank completed was {_s(stalled)} before {death} "
                f"(stall budget {_s(a.stall_after)}): the run was already stalled when its "
                "ranks died"]
    evidence += [a.where_line(r) for r in sorted(phases)]
    if outside and inside:
        culprits, confidence = outside, "medium"
        title = (f"the run was stalled for {_s(stalled)} before it died: rank(s) {outside} "
                 "were outside a collective while the others waited in one")
        evidence.append(f"rank(s) {outside} in phase(s) "
                        f"{', '.join(sorted({phases[r] for r in outside}))}; rank(s) {inside} "
                        "in collective phases, waiting for them (from the last statuses: "
                        "no live process to confirm it)")
    else:
        culprits, confidence = sorted(phases), "low"
        title = (f"the run was stalled for {_s(stalled)} before it died; whom it waited for "
                 "cannot be told from the last statuses")
    return Finding("rank_stuck", title, ranks=culprits, confidence=confidence,
                   nodes=sorted({a.node(r) for r in culprits}), evidence=evidence,
                   runbook="TrainingStalled",
                   next_command=f"grep -n -E 'Error|Signal|timeout' {a.ev.run_dir}/logs/*.log "
                                "| head   # then reproduce with diagnose while it hangs")


def _ended_hang(finding: Finding, hang: Finding | None) -> Finding:
    """A death after the run had stalled ended the hang: as its cause, confidence low."""
    if hang is None:
        return finding
    finding.confidence = "low"
    finding.title += " (after the run had already stalled)"
    finding.evidence.append("the run had stalled before this death (see the finding on the "
                            "stall): the death ended a hang, it is not what caused it")
    return finding


def order_by_heartbeat(ev: Evidence, dead: list[int]) -> tuple[list[int], str]:
    """([the rank that stopped first], why) when the gap says so, else (the tied ranks, why).

    Two last heartbeats closer than one heartbeat interval (the ranks write them
    independently, up to one interval apart while both run) or than the clock's resolution
    say nothing about which process died first.
    """
    beats = {r: ev.ranks[r].get("heartbeat_at") for r in dead}
    known = sorted((t, r) for r, t in beats.items() if isinstance(t, (int, float)))
    if not known:
        return sorted(dead), "no heartbeat times to order them by"
    intervals = [ev.ranks[r].get("heartbeat_interval") for r in dead]
    interval = max([i for i in intervals if isinstance(i, (int, float)) and i > 0]
                   or [DEFAULT_HEARTBEAT_INTERVAL])
    resolution = time.get_clock_info("time").resolution
    first_t, first = known[0]
    tied = [r for t, r in known if t - first_t <= max(interval, resolution)]
    if len(tied) == 1 and len(known) > 1:
        gap = known[1][0] - first_t
        return [first], (f"its heartbeat stopped first, {gap:.2f} s before the next rank's "
                         f"(more than one heartbeat interval, {interval:g} s)")
    if len(known) == 1:
        return [first], "the only dead rank with a heartbeat time"
    gap = known[len(tied) - 1][0] - first_t
    return sorted(tied), (f"their last heartbeats are {_gap(gap)} apart, within one heartbeat "
                          f"interval ({interval:g} s): the order they died in cannot be told "
                          "from heartbeats")


def _tie_finding(a: Analysis, tied: list[int], why: str) -> Finding:
    evidence = [a.where_line(r) for r in tied] + [why] + _first_error_lines(a.ev)
    evidence.append("no launcher log with exit codes in the run directory's logs/ "
                    "(torchrun's root cause would decide it)")
    return Finding(
        "rank_dead", f"ranks {tied} died at about the same time: which failed first is a tie",
        ranks=tied, nodes=sorted({a.node(r) for r in tied}), confidence="low",
        evidence=evidence, runbook="TrainingRankDown",
        next_command=f"grep -n -E 'Error|terminate|Signal' {a.ev.run_dir}/logs/*.log | head")


def _doubt_root(ev: Evidence, root: dict[str, Any]) -> tuple[int, str] | None:
    """torchrun's root cause against the ranks' own errors: (the rank that more likely
    failed first, why) when they disagree, else None.

    torchrun orders failures by when it observed them, to the second, and takes the lower
    rank on a tie: when one rank's death makes another abort before the next poll, it may
    name the one that aborted. A root-cause rank whose own error is a peer's failure seen
    from it (connection reset or closed by the peer) did not fail first; the rank it tore
    down with no error of its own (killed by a signal) more likely did.
    """
    errors = ev.launcher.get("errors_by_rank") or {}
    own = errors.get(root["rank"]) or errors.get(str(root["rank"]))
    if not own or not PEER_FAILURE.search(own):
        return None
    others = [x for x in ev.launcher.get("failures", [])
              if x.get("rank") != root["rank"] and x.get("rank") in ev.ranks
              and not PEER_FAILURE.search(errors.get(x["rank"]) or errors.get(str(x["rank"]))
                                           or "")]
    killed = [x for x in others if x["exitcode"] < 0] or others
    if len(killed) != 1:
        return None
    other = killed[0]
    same = other.get("time") and other.get("time") == root.get("time")
    return other["rank"], (
        f"torchrun names rank {root['rank']} the root cause ({_exit_text(root['exitcode'])}), "
        f"but rank {root['rank']}'s own error is a peer's failure seen from it: {own[:160]}; "
        f"rank {other['rank']} ended {_exit_text(other['exitcode'])} with no error of its own, "
        "so it more likely failed first"
        + (f"; torchrun observed both at {other['time']} (one poll: on a tie it takes the "
           "lower rank, not the one that died first)" if same else "")
        + ". Confidence medium: the launcher's order and the ranks' own errors disagree")


def _failure_message(status: dict[str, Any]) -> str:
    """The error a failed rank's telemetry recorded (``failure.message``), else ''."""
    failure = status.get("failure")
    message = failure.get("message") if isinstance(failure, dict) else None
    return message if isinstance(message, str) else ""


def _first_error_lines(ev: Evidence) -> list[str]:
    first = ev.launcher.get("first_error")
    if not first:
        return []
    who = f"rank {first['rank']}" if first.get("rank") is not None else "no rank prefix"
    note = (" (a peer's failure seen from this rank, not its cause)"
            if PEER_FAILURE.search(first["line"]) else "")
    return [f"first error in the logs ({who}): {first['line']}{note}"]


def _gap(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 0.01 else f"{seconds:.2f} s"


def check_frozen(a: Analysis) -> list[Finding]:
    findings = []
    for rank, v in a.running.items():
        if rank in a.explained:
            continue
        status = a.proc(rank)
        hb = v.get("heartbeat_age")
        blocked = (v.get("process") or {}).get("threads_in_disk_sleep") or []
        if status == "stopped":
            title, runbook = f"rank {rank} is stopped (state T: SIGSTOP or a debugger)", \
                "TrainingStalled"
            cmd, category = f"grep State /proc/{v.get('pid')}/status   # then: kill -CONT " \
                            f"{v.get('pid')}", "rank_stuck"
        elif status == "disk_sleep" or (blocked and a.stalled):
            wchans = ", ".join(sorted({b["wchan"] for b in blocked}))
            title = (f"rank {rank} is blocked in uninterruptible I/O (D state"
                     + (f", in {wchans})" if wchans else ")"))
            runbook, category = "StorageProbeSlow", "storage"
            remote = f"ssh {a.node(rank)} " if (v.get("process") or {}).get("via") else ""
            cmd = f"{remote}cat /proc/{v.get('pid')}/stack; {remote}df -h {a.ev.run_dir}"
        elif status == "unknown" and heartbeat_stale(a.stall_options, hb):
            title = f"rank {rank} is frozen or dead (heartbeat {_s(hb)} old)"
            runbook, category = "TrainingStalled", "rank_stuck"
            cmd = f"ssh {a.node(rank)} py-spy dump --pid {v.get('pid')}"
        else:
            continue
        a.explained.add(rank)
        evidence = [a.where_line(rank)] + a.waiting_lines([rank])
        findings.append(Finding(category, title, ranks=[rank], nodes=[a.node(rank)],
                                confidence="high" if status != "unknown" else "medium",
                                evidence=evidence, runbook=runbook, next_command=cmd,
                                stack=format_frames(a.stack(rank))))
    return findings


def check_desync(a: Analysis) -> list[Finding]:
    findings = []
    for pg, g in a.groups.items():
        mismatch = g.get("mismatch")
        if not mismatch:
            continue
        ranks = sorted(mismatch["ops"])
        evidence = [f"process group {pg} ({g['desc']}), collective #{mismatch['seq']}:"]
        evidence += [f"  rank {r}: {op}" for r, op in mismatch["ops"].items()]
        for r, frames in mismatch["frames"].items():
            site = next((f for f in frames if not _IN_COLLECTIVE.search(str(f.get("file")))),
                        frames[0] if frames else None)
            if site:
                evidence.append(f"  rank {r} issued it at {site.get('file')}:{site.get('line')} "
                                f"in {site.get('function')}")
        if g["frontier"] == mismatch["seq"]:
            evidence.append(f"ranks {g['waiting']} are all waiting in #{g['frontier']}: "
                            "they will never match")
        a.explained |= set(ranks)
        # The odd one out: a rank issuing an op it never issued before (the extra
        # collective), else the minority op; with no way to tell, all of them.
        counts = {op: list(mismatch["ops"].values()).count(op) for op in mismatch["ops"].values()}
        minority = [r for r, op in mismatch["ops"].items() if counts[op] < max(counts.values())]
        culprits = next((c for c in (mismatch["novel"], minority) if 0 < len(c) < len(ranks)),
                        ranks)
        if culprits != ranks:
            evidence.append(f"rank(s) {culprits} issued an op they had not issued before "
                            "(the extra or missing collective is theirs)"
                            if culprits == mismatch["novel"] else
                            f"rank(s) {culprits} differ from the majority")
        findings.append(Finding(
            "collective_desync",
            f"collective desync at sequence number {mismatch['seq']} in process group {pg}: "
            "ranks issued different collectives", ranks=culprits,
            nodes=sorted({a.node(r) for r in culprits if r in a.ev.ranks}),
            evidence=evidence, runbook="TrainingStalled",
            next_command="check the call sites above: every rank must issue the same "
                         "collectives in the same order (look for rank-dependent branches)",
            stack=format_frames(a.stack(culprits[0]))))
    return findings


def check_crossed(a: Analysis) -> list[Finding]:
    """Ranks waiting in different groups' collectives for each other: one side skipped a
    collective (or issued an extra one). The smaller side is named; equal sides are a tie."""
    if not a.stalled:
        return []
    findings = []
    for c in a.crossed:
        culprits, waiting, other = c["culprits"], c["waiting"], c["waits_in"]
        if set(culprits + waiting) & a.explained:
            continue
        a.explained |= set(culprits + waiting)
        names = f"rank(s) {culprits}"
        evidence = [
            f"process group {c['group']}: rank(s) {waiting} wait in collective #{c['seq']} "
            f"{c['op']}; {names} never entered it (their last there: "
            f"#{a.groups[c['group']]['behind'][culprits[0]]['last_enqueued']}, completed)",
            f"process group {other['group']}: {names} wait in collective #{other['seq']} "
            f"{other['op']}, which rank(s) {waiting} never entered",
            "each side waits for the other: one skipped a collective the other issued "
            "(or issued an extra one)"]
        if c["tie"]:
            title = (f"collective desync: ranks {culprits} and {waiting} wait in different "
                     f"collectives (#{c['seq']} of process group {c['group']}, "
                     f"#{other['seq']} of process group {other['group']}); which side "
                     "skipped one cannot be told")
            evidence.append("the two sides are the same size: no odd one out")
            culprits, confidence = sorted(culprits + waiting), "low"
        else:
            title = (f"collective desync: {names} did not enter collective #{c['seq']} "
                     f"({c['op']}) of process group {c['group']}, which rank(s) {waiting} "
                     "wait in")
            evidence.append(f"{names} are the odd one out ({len(culprits)} against "
                            f"{len(waiting)})")
            confidence = "high"
        findings.append(Finding(
            "collective_desync", title, ranks=culprits, confidence=confidence,
            nodes=sorted({a.node(r) for r in culprits if r in a.ev.ranks}),
            evidence=[a.where_line(r) for r in culprits if r in a.ev.ranks] + evidence,
            runbook="TrainingStalled",
            next_command="check the code between the two collectives: every rank must issue "
                         "the same collectives on every group in the same order (look for "
                         "rank-dependent branches)",
            stack=format_frames(a.stack(culprits[0]))))
    return findings


def check_busy(a: Analysis) -> list[Finding]:
    """A rank that burns a core outside any collective while the job stalls: busy, not
    frozen. Holding the GIL in C (a regex, a C extension) also silences its telemetry
    thread, so its heartbeat looks like a frozen process's; its CPU and stack say otherwise."""
    if not a.stalled:
        return []
    waiting = {r for g in a.groups.values() for r in g["waiting"]}
    findings = []
    for rank, v in sorted(a.running.items()):
        process = v.get("process") or {}
        cpu, runnable = process.get("cpu_percent"), process.get("main_runnable_percent")
        stack = a.stack(rank)
        if rank in a.explained or rank in waiting or not isinstance(runnable, (int, float)) \
                or runnable < BUSY_CPU_PERCENT or _in_collective(stack):
            continue
        a.explained.add(rank)
        main = main_thread(a.ev.stacks.get(rank)) or {}
        where = qualified(stack[-1]) if stack else "code diagnose has no stack of"
        callers = " <- ".join(f"{qualified(f)} ({_short(f)})" for f in reversed(stack[-4:]))
        evidence = [a.where_line(rank),
                    f"CPU: its main thread was running or ready to run {runnable:.0f} % of "
                    f"the time diagnose looked (on a CPU: the process used {cpu:.0f} % of a "
                    f"core; process {a.proc(rank)}): busy, not frozen"]
        if callers:
            evidence.append(f"main thread: {callers}")
        gil = main.get("owns_gil")
        stale = heartbeat_stale(a.stall_options, v.get("heartbeat_age"))
        if gil:
            evidence.append("py-spy: the main thread is active and holds the GIL"
                            + (f"; the telemetry thread could not run, so the heartbeat is "
                               f"{_s(v.get('heartbeat_age'))} old" if stale else ""))
        evidence += a.waiting_lines([rank])
        title = (f"rank {rank} is busy in {where} (main thread runnable {runnable:.0f} %)"
                 + (", holding the GIL" if gil else "") + ", while the others wait")
        findings.append(Finding(
            "rank_stuck", title, ranks=[rank], nodes=[a.node(rank)],
            confidence="high" if stack else "medium", evidence=evidence,
            runbook="TrainingStalled",
            next_command=f"py-spy top --pid {v.get('pid')}   # or: py-spy dump --pid "
                         f"{v.get('pid')} --native (the C frames under {where})",
            stack=format_frames(stack)))
    return findings


def check_outside_collective(a: Analysis) -> list[Finding]:
    """Ranks the others wait for that are alive but somewhere else (data, I/O, a lock)."""
    if not a.stalled:
        return []
    behind: dict[int, list[str]] = {}
    for pg, g in a.groups.items():
        if not g["waiting"]:
            continue
        for rank, b in g["behind"].items():
            behind.setdefault(rank, []).append(
                f"process group {pg} ({g['desc']}): ranks {g['waiting']} wait in collective "
                f"#{g['frontier']} {g['frontier_op']}; rank {rank} last entered "
                f"#{b['last_enqueued']}" + (" (completed)" if not b["in_collective"] else ""))
    confidence = "high"
    if not a.groups:
        # No flight recorder: fall back to stacks — who is not inside torch.distributed.
        confidence = "medium"
        stacks = {r: a.stack(r) for r in a.running if r not in a.explained and a.stack(r)}
        waiting = [r for r, s in stacks.items() if _in_collective(s)]
        if waiting:
            for rank, s in stacks.items():
                if not _in_collective(s):
                    behind[rank] = [f"rank(s) {waiting} are inside a torch.distributed call "
                                    "(their stacks); this rank is not"]
    findings = []
    for rank, lines in sorted(behind.items()):
        if rank in a.explained or rank not in a.ev.ranks:
            continue
        a.explained.add(rank)
        stack = a.stack(rank)
        where = locate(a.ev.ranks[rank].get("phase"), stack)
        evidence = [a.where_line(rank), *lines]
        if not stack:
            evidence.append("no stack for this rank (see 'could not see')")
        cause = causes.rank_cause(a.ev.ranks[rank], a.ev.stacks.get(rank))
        worker = workers.blocked_worker(a.ev.ranks[rank])
        if worker:  # the rank waits for a batch: the worker process it waits for is the culprit
            cause = worker["cause"]
            if cause:
                cause["process"] = {"pid": worker["pid"], "role": "DataLoader worker"}
            evidence.append(f"DataLoader worker pid {worker['pid']} (a child process of rank "
                            f"{rank}) is inside a batch while the rank waits for it: "
                            + " <- ".join(reversed(worker["stack"][-4:])))
            evidence += [f"worker pid {worker['pid']}: {line}"
                         for line in cause_lines(cause, worker["frames"])]
            where = f"data loading (its DataLoader worker pid {worker['pid']} is blocked)"
        else:
            evidence += cause_lines(cause, stack)
        kind = cause.get("kind") if cause else None
        if isinstance(kind, str) and not worker:
            where = _CAUSE_WHERE.get(kind, where)
        category = "storage" if (where.startswith("file I/O") or kind == "disk_io") and a.proc(
            rank) == "disk_sleep" else "rank_stuck"
        title = (f"rank {rank} is stuck outside a collective, in {where}, while the "
                 "others wait" + (f": {causes.describe(cause)}" if cause else ""))
        elsewhere = [(pg, g) for pg, g in a.groups.items() if rank in g["waiting"]]
        if elsewhere:  # it waits in another group's collective: follow the chain there
            pg, g = elsewhere[0]
            title = (f"rank {rank} waits in collective #{g['frontier']} of process group {pg} "
                     "while the others wait for it")
            evidence.append(f"process group {pg}: rank(s) {sorted(g['behind']) or '?'} have not "
                            f"entered #{g['frontier']} {g['frontier_op']}")
        findings.append(Finding(
            category, title, ranks=[rank], nodes=[a.node(rank)], confidence=confidence,
            evidence=evidence, runbook="TrainingStalled",
            next_command=f"py-spy dump --pid {a.ev.ranks[rank].get('pid')} --native",
            stack=format_frames(stack), cause=cause))
    return findings


def check_blocked_in_kernel(a: Analysis) -> list[Finding]:
    """A stall no collective analysis explained, where a rank's kernel wait tells why."""
    if not a.stalled or a.explained & set(a.running):
        return []
    findings = []
    for rank in sorted(a.running):
        cause = causes.rank_cause(a.ev.ranks[rank], a.ev.stacks.get(rank))
        if cause is None or cause["kind"] == "lock":
            continue
        a.explained.add(rank)
        stack = a.stack(rank)
        others = [r for r in sorted(a.running) if r != rank]
        findings.append(Finding(
            "rank_stuck", f"rank {rank} is blocked: {causes.describe(cause)}", ranks=[rank],
            nodes=[a.node(rank)], confidence="medium",
            evidence=[a.where_line(rank), *cause_lines(cause, stack)]
            + ([f"rank(s) {others} made no progress either (waiting for it?)"] if others else []),
            runbook="TrainingStalled",
            next_command=f"py-spy dump --pid {a.ev.ranks[rank].get('pid')} --native",
            stack=format_frames(stack), cause=cause))
    return findings


def check_unexplained_stall(a: Analysis) -> list[Finding]:
    if not a.stalled or a.explained & set(a.running):
        return []
    return [Finding(
        "stalled", f"no rank made progress for {_s(a.progress_age)}; the cause is not "
        "identified", confidence="low", ranks=sorted(a.running),
        nodes=sorted({a.node(r) for r in a.running}),
        evidence=[a.where_line(r) for r in sorted(a.running)] + a.waiting_lines([]),
        runbook="TrainingStalled",
        next_command=(f"trainwatch diagnose --run-dir {a.ev.run_dir} --native" if a.groups else
                      f"TORCH_FR_BUFFER_SIZE=2000 in the job's environment, then "
                      f"trainwatch diagnose --run-dir {a.ev.run_dir} --native"))]


def check_storage_and_checkpoints(a: Analysis) -> list[Finding]:
    info = a.ev.checkpoints or {}
    findings = []
    disk = info.get("disk") or {}
    errors = [str(f.get("error") or "") for f in info.get("failures", [])]
    enospc = any("No space left" in e or "ENOSPC" in e or "Errno 28" in e for e in errors)
    free_ratio = disk.get("free_ratio")
    if enospc or (free_ratio is not None and free_ratio < LOW_FREE_RATIO):
        findings.append(Finding(
            "storage", f"checkpoint storage is full ({disk.get('path')})",
            evidence=[f"{disk.get('path')}: {disk.get('free_bytes')} bytes free of "
                      f"{disk.get('total_bytes')} ({_pct(free_ratio)})"]
            + [f"checkpoint save failed: {e}" for e in errors if e][:3],
            runbook="StorageFull", next_command=f"df -h {disk.get('path')}; du -sh "
                                                f"{info.get('dir')}/*"))
    if info.get("failures"):
        newest = info.get("newest")
        evidence = [f"{len(info['failures'])} failed checkpoint save(s); last: "
                    f"step {info['failures'][-1].get('step')}: {errors[-1] or 'no reason given'}",
                    "newest checkpoint: " + (_ckpt_text(newest) if newest
                                             else info.get("newest_text", "unknown"))]
        findings.append(Finding(
            "checkpoint", "checkpoint saves are failing", evidence=evidence,
            ranks=sorted({f["rank"] for f in info["failures"] if isinstance(f.get("rank"), int)}),
            runbook="CheckpointFailed",
            next_command=f"trainwatch checkpoint list {info.get('dir')}"))
    if not info.get("newest"):
        a.ev.cannot_see("newest verified checkpoint: unknown")
    return findings


def check_nonfinite(a: Analysis) -> list[Finding]:
    bad = {r: v for r, v in a.ev.ranks.items()
           if (v.get("counters") or {}).get("nonfinite_loss_total")
           or (v.get("recent") or {}).get("nonfinite_losses")}
    if not bad:
        return []
    evidence = [f"rank {r}: {v['counters'].get('nonfinite_loss_total', 0)} non-finite loss "
                f"step(s); latest loss {v.get('loss')}" for r, v in sorted(bad.items())]
    evidence += [f"journal: step {e.get('step')} {e.get('event')}"
                 for e in journal.recent(a.ev, "nonfinite_detected")[-3:]]
    return [Finding("nonfinite_loss", "the loss is NaN or Inf", severity="warning",
                    ranks=sorted(bad), nodes=sorted({a.node(r) for r in bad}),
                    evidence=evidence, runbook="TrainingLossNonFinite",
                    next_command=f"grep -n -E 'NaN|Infinity' {a.ev.run_dir}/metrics/*.jsonl "
                                 "| head")]


def check_silent_corruption(a: Analysis) -> list[Finding]:
    return corruption.check(a.ev)


def check_straggler(a: Analysis) -> list[Finding]:
    """A slow rank in a run that still progresses: late into collectives, or slow locally."""
    if a.stalled or len(a.running) < 2:
        return []
    step = a.step_time or 0.0
    for pg, g in a.groups.items():
        late = g.get("lateness") or {}
        if len(late) < 2 or not step:
            continue
        rank = max(late, key=lambda r: late[r])
        if late[rank] >= max(STRAGGLER_LATENESS_RATIO * step, STRAGGLER_LATENESS_FLOOR):
            others = statistics.median(v for r, v in late.items() if r != rank)
            return [_straggler(a, rank, [
                f"process group {pg}: rank {rank} enters collectives {late[rank] * 1000:.0f} ms "
                f"after the first rank (median over recent collectives; others "
                f"{others * 1000:.0f} ms); step time {step * 1000:.0f} ms"], "high")]
    window = job_window({r: v.get("timing") for r, v in a.running.items()})
    if window and window["job"]["ranks"] >= 2:
        # Time outside collective phases, from the job summary every rank publishes.
        job = window["job"]
        rank, slowest, median = job.get("slowest_rank"), job["max"], job["median"]
        if isinstance(rank, int) and median > 0 and slowest / median >= STRAGGLER_TIMING_RATIO \
                and rank in a.ev.ranks:
            own = a.ev.ranks[rank].get("timing") or {}
            data = own.get("data_wait_seconds") if own.get("step") == window["step"] else None
            cause = (" (mostly waiting for data)"
                     if isinstance(data, (int, float)) and data >= 0.5 * slowest else "")
            return [_straggler(a, rank, [
                f"rank {rank} local time {slowest * 1000:.0f} ms per step vs job median "
                f"{median * 1000:.0f} ms ({slowest / median:.2f}x){cause}"], "medium")]
    return []


def _straggler(a: Analysis, rank: int, evidence: list[str], confidence: str) -> Finding:
    evidence.append(f"the job still progresses (last step {_s(a.progress_age)} ago): "
                    "slow, not stalled")
    return Finding("straggler", f"rank {rank} is a straggler (slow but progressing)",
                   severity="warning", confidence=confidence, ranks=[rank],
                   nodes=[a.node(rank)], evidence=[a.where_line(rank), *evidence],
                   runbook="TrainingStragglerRank",
                   next_command=f"py-spy top --pid {a.ev.ranks[rank].get('pid')}")


_AGENT_KINDS = (  # agent finding kind / node evidence -> (category, runbook)
    (re.compile(r"xid|ecc|gpu", re.I), "gpu_fault", "GPUXidErrors"),
    (re.compile(r"storage|disk|probe", re.I), "storage", "StorageProbeSlow"),
    (re.compile(r"nccl", re.I), "network", "NCCLErrors"),
    (re.compile(r"network|nic|infiniband|\bib\b|link", re.I), "network",
     "NetworkInterfaceErrors"),
    (re.compile(r"straggler", re.I), "straggler", "TrainingStragglerRank"),
)


def check_node_evidence(a: Analysis) -> list[Finding]:
    """Node problems the agents report, attached to the ranks on those nodes."""
    findings: list[Finding] = []
    for f in agents.node_findings(a.ev):
        kind = str(f.get("kind", ""))
        if kind == "stall":
            continue  # diagnose explains stalls itself; the agent's view is in the evidence
        for pattern, category, runbook in _AGENT_KINDS:
            if pattern.search(kind):
                if category == "straggler" and any(x.category == "straggler" for x in findings):
                    break
                rank = f.get("rank")
                findings.append(Finding(
                    category, f"node {f.get('node')}: {f.get('message') or kind}",
                    severity="critical" if f.get("severity") == "critical" else "warning",
                    confidence="medium", ranks=[rank] if isinstance(rank, int) else [],
                    nodes=[str(f.get("node"))],
                    evidence=[f"agent finding {f.get('id')}"] + list(f.get("evidence") or []),
                    runbook=runbook, next_command=f"curl -s {_agent_url(a, f)}/status"))
                break
    for agent in a.ev.agents:
        for store in ((agent.get("node_health") or {}).get("storage") or []):
            probe = store.get("probe") or {}
            if probe and not probe.get("ok", True):
                findings.append(Finding(
                    "storage", f"node {agent.get('node')}: storage probe failed on "
                    f"{store.get('path')}", confidence="high", nodes=[str(agent.get("node"))],
                    evidence=[f"probe error: {probe.get('error')} after {probe.get('seconds')} s"],
                    runbook="StorageProbeSlow", next_command=f"df -h {store.get('path')}"))
    alerts = sorted({str(r.get("alert") or r.get("alertname"))
                     for r in a.ev.journal.get("firing_alerts", [])}
                    | set(prometheus.firing_alerts(a.ev)))
    if alerts:
        findings.append(Finding("alerts", "alerts firing: " + ", ".join(alerts), severity="info",
                                confidence="medium", evidence=["from the journal and Prometheus"]))
    return findings


def abandoned(a: Analysis, found: list[Finding]) -> None:
    """A run whose ranks are all gone with none to restart them (no live supervisor, e.g.
    after a node reboot) pages until someone ends it: its dead-rank findings say since
    when, and that ``trainwatch close`` ends it (the cause first: after a reboot the
    kernel log is the previous boot's)."""
    ev = a.ev
    if ev.supervisor.get("held") is not False or not a.running \
            or any(a.proc(r) not in ("gone", "zombie") for r in a.running):
        return
    beats = [v["heartbeat_at"] for v in a.running.values()
             if isinstance(v.get("heartbeat_at"), (int, float))]
    since = (f" since its last heartbeat {_s(ev.collected_at - max(beats))} ago "
             f"({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(max(beats)))})"
             if beats else "")
    rebooted = ev.supervisor.get("rebooted_ranks")
    line = (f"abandoned{since}: every rank's process is gone and no supervisor holds the run "
            f"({ev.supervisor.get('holder') or 'its lock names none'}"
            f"{', not running' if ev.supervisor.get('holder') else ''}), so nothing will "
            "restart it and TrainingRankDown pages until it is closed or started again"
            + (f"; this node rebooted since rank(s) {rebooted} ran (their boot id is not "
               "this boot's: see the previous boot's kernel log, journalctl -k -b -1)"
               if rebooted else ""))
    for finding in found:
        if finding.category == "rank_dead" and set(finding.ranks) & set(a.running):
            finding.evidence.append(line)
            finding.next_command = f"trainwatch close {ev.run_dir}"


def healthy(a: Analysis) -> Finding:
    ev = a.ev
    states = sorted({str(v.get("state")) for v in ev.ranks.values()})
    if not ev.ranks:
        return Finding("healthy", "nothing to diagnose: no rank status found", severity="info",
                       confidence="low", evidence=list(ev.unseen[:3]))
    if states == ["finished"]:
        title, evidence = "the run finished", [f"all {len(ev.ranks)} ranks finished"]
    elif a.stopped and not a.running:
        stop = a.stop or {}
        by, event, ended = (("closed by hand", "run_closed", "were gone when it was closed")
                            if stop.get("closed") else
                            ("stopped by its supervisor", "job_stopped",
                             "ended with it (their statuses still say running: the job did "
                             "not save and stop on SIGTERM)"))
        title = f"the run was {by} ({stop.get('reason')})"
        evidence = [f"journal: {event} {_s(ev.collected_at - stop.get('time', 0.0))} ago "
                    f"({stop.get('reason')}); rank(s) {sorted(a.stopped)} {ended}"]
    elif not a.running:
        title = "the run is not running"
        evidence = [f"rank states: {', '.join(states)} (stopped: saved and stopped on request)"]
    else:
        title = "healthy: every rank is progressing"
        evidence = [f"{len(a.running)} running rank(s); last step completed "
                    f"{_s(a.progress_age)} ago (stall budget {_s(a.stall_after)})"]
        if a.step_time:
            evidence.append(f"median step time {a.step_time * 1000:.1f} ms")
    return Finding("healthy", title, severity="info", ranks=sorted(ev.ranks),
                   evidence=evidence, confidence="high" if ev.dumps or ev.stacks else "medium")


# --------------------------------------------------------------------------- helpers

def locate(phase: str | None, stack: list[dict[str, Any]]) -> str:
    """Where a rank is, from its stack (preferred) or its phase."""
    text = "\n".join(format_frames(stack, limit=len(stack)))
    inner = causes.innermost_line(stack)  # a builtin (acquire, flock, open) leaves no frame
    text += f"\n{inner}" if inner else ""
    for where, pattern in _WHERE:
        if text and pattern.search(text):
            return where
    return _PHASE_WHERE.get(str(phase), f"phase '{phase}' (see its stack)")


def cause_lines(cause: dict[str, Any] | None, stack: list[dict[str, Any]]) -> list[str]:
    """Evidence lines: the innermost Python line, then what the kernel shows it waits for."""
    lines = []
    inner = causes.innermost_line(stack)
    if inner:
        lines.append(f"innermost Python line: {inner}")
    if cause:
        thread = cause.get("thread") or {}
        kernel = (f" (thread {thread.get('tid')}: syscall {thread.get('syscall')}, wait channel "
                  f"{thread.get('wchan') or '-'})" if thread else "")
        lines.append(f"cause ({cause['kind']}): {causes.describe(cause)}{kernel}")
        lines.append(f"runbook section: trainwatch runbook {cause['runbook'].split('#')[0]} "
                     f"(#{cause['runbook'].split('#')[1]})")
    return lines


def _short(frame: dict[str, Any]) -> str:
    return f"{str(frame.get('file')).rsplit('/', 1)[-1]}:{frame.get('line')}"


def _in_collective(stack: list[dict[str, Any]]) -> bool:
    return any(_IN_COLLECTIVE.search(str(f.get("file"))) for f in stack[-6:])


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _s(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:.1f} s"


def _pct(ratio: float | None) -> str:
    return "?" if ratio is None else f"{ratio * 100:.1f} % free"


def _ckpt_text(c: dict[str, Any]) -> str:
    age = c.get("age_seconds")
    return (f"step {c.get('step')} at {c.get('path')} ({c.get('source')}"
            + (f", {age:.0f} s old)" if isinstance(age, (int, float)) else ")"))


def _agent_url(a: Analysis, finding: dict[str, Any]) -> str:
    return next((x["url"] for x in a.ev.agents if x.get("node") == finding.get("node")),
                "AGENT_URL")
