"""Rule: dead ranks — which one failed first as far as the evidence can order them, an OOM
kill, a hang the deaths ended, and deaths of earlier attempts the run recovered from."""

from __future__ import annotations

import time
from typing import Any

from trainwatch.diagnose.casefile import Analysis
from trainwatch.diagnose.model import Evidence, Finding
from trainwatch.diagnose.post_mortem import hang_before_death
from trainwatch.diagnose.racing_deaths import (Death, exit_text, own_deaths, past_racers,
                                                racing_finding)
from trainwatch.diagnose.stacks import format_frames
from trainwatch.rundir import attempts
from trainwatch.rundir.torchrun_log import PEER_FAILURE

DEFAULT_HEARTBEAT_INTERVAL = 1.0  # trainer telemetry's default, for ranks that do not say


def check_dead(a: Analysis) -> list[Finding]:
    """Dead ranks now, and deaths of earlier attempts the run recovered from (history).

    torchrun's failure table names the process (pid) that failed: when a later attempt
    replaced that rank's process, the death is the past, not what is wrong now.
    """
    root = a.ev.launcher.get("root_cause")
    past = [root] if root and root.get("rank") in a.ev.ranks and not _current(a.ev, root) \
        else []
    failures = [x for x in a.ev.launcher.get("failures", []) if _current(a.ev, x)
                and x.get("rank") not in a.explained]
    if root and root.get("rank") in a.explained:  # a stronger rule's (first_silent's victim)
        root = None
    return [_recovered(a, x) for x in past] + _dead_now(a, None if past else root, failures)


def _current(ev: Evidence, entry: dict[str, Any]) -> bool:
    """A launcher's failure entry is about the rank's current process, or cannot be told
    apart from it (no pid on one side)."""
    rank = entry.get("rank")
    pid = (ev.ranks.get(rank) or {}).get("pid") if isinstance(rank, int) else None
    return not (isinstance(pid, int) and isinstance(entry.get("pid"), int)
                and pid != entry["pid"])


def _recovered(a: Analysis, entry: dict[str, Any]) -> Finding:
    """An earlier attempt's death, as history: in which attempt, and how the run went on.
    Ranks that died on their own in the same torchrun poll are named together: torchrun's
    pick among them is no order (racing_deaths.py)."""
    rank, ev = entry["rank"], a.ev
    racers = [x for x in past_racers(ev, entry) if x.get("rank") in ev.ranks]
    died = (f"rank {rank} died" if len(racers) < 2 else
            "ranks " + " and ".join(str(x["rank"]) for x in sorted(
                racers, key=lambda x: x["rank"])) + " died within one torchrun poll")
    exits = "; ".join((f"rank {x['rank']}: " if len(racers) > 1 else "")
                      + exit_text(x["exitcode"]) for x in sorted(racers, key=lambda x: x["rank"]))
    tried = ev.journal.get("attempts") or []
    n = next((i for i, g in enumerate(tried) if entry["pid"] in g["pids"].values()), None)
    if n is None:
        title = (f"{died} in an earlier attempt ({exits}); "
                 f"recovered: it runs again as pid {ev.ranks[rank].get('pid')}")
    else:
        resumed = tried[n + 1]["resumed_step"] if n + 1 < len(tried) else None
        how = (f"restarted from step {resumed}" if resumed is not None
               else "started again (no checkpoint resumed in the journal)")
        title = f"{died} in attempt {n + 1} ({exits}); recovered: attempt {n + 2} {how}"
    evidence = [f"torchrun named pid {entry['pid']} the root cause (first observed failure): "
                f"{exit_text(entry['exitcode'])} ({entry['log']})"]
    if len(racers) > 1:
        evidence[0] += (f"; it saw the others' exits in the same poll (stamped {entry.get('time')}) "
                        "and on a tie takes the lower rank: which died first cannot be told")
    evidence.append(f"now: {a.where_line(rank)}")
    if (ev.journal.get("restarts") or {}).get("attempts"):
        evidence.append(f"journal: {attempts.describe(ev.journal['restarts'])}")
    return Finding("rank_dead", title, severity="info",
                   confidence="high" if n is not None and len(racers) < 2 else "medium",
                   ranks=sorted(x["rank"] for x in racers),
                   nodes=sorted({a.node(x["rank"]) for x in racers}), evidence=evidence,
                   runbook="TrainingRankDown",
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
    launcher = [(by_pid[x["pid"]], x) for x in ev.launcher.get("failed", [])
                if x["pid"] in by_pid and by_pid[x["pid"]] not in a.explained]
    culprits: dict[int, str] = {}
    doubted = _doubt_root(ev, root) if root and root.get("rank") in ev.ranks else None
    if doubted:
        rank, why = doubted
        culprits[rank] = why
    elif root and root.get("rank") in ev.ranks:
        culprits[root["rank"]] = (f"torchrun names it the root cause (first observed failure): "
                                  f"{exit_text(root['exitcode'])} ({root['log']})"
                                  + (f"; its error file says: {root['error']}"
                                     if root.get("error") else ""))
    elif launcher:
        culprits = {r: f"the launcher logged its exit: {exit_text(x['exitcode'])} ({x['log']})"
                    for r, x in launcher}
    gone = [r for r, v in ev.ranks.items() if r not in a.explained
            and v.get("state") == "running" and a.proc(r) in ("gone", "zombie")]
    dead = [r for r in gone if r not in a.stopped]
    failed = [r for r, v in ev.ranks.items() if v.get("state") == "failed"
              and r not in a.explained]
    # A rank whose recorded error is a peer's failure seen from a collective (or that
    # recorded none: its beat says failed, its status could not be written) followed the
    # rank that raised on its own, or died without a word: it is a culprit only when
    # nothing else explains the deaths.
    own = [r for r in failed if (message := _failure_message(ev.ranks[r]))
           and not PEER_FAILURE.search(message)]
    peers = [r for r in failed if r not in own]
    race = own_deaths(a, root, failures, own)
    if len(race) > 1:  # two or more ranks died on their own: torchrun's pick is no order
        return _racing(a, race, root, failures, gone, dead + peers)
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
        torn_down = [f"rank {x['rank']}: {exit_text(x['exitcode'])}"
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


def _racing(a: Analysis, race: list[Death], root: dict[str, Any] | None,
            failures: list[dict[str, Any]], gone: list[int], dead: list[int]) -> list[Finding]:
    """Ranks that died on their own at about the same time: each with its own cause, the
    first only where their records order them (racing_deaths.py)."""
    ev, racers = a.ev, {d.rank for d in race}
    hang = hang_before_death(a, gone, root)
    a.explained |= racers | set(dead)
    followers = [f"rank {x['rank']}: {exit_text(x['exitcode'])}"
                 for x in ([root] if root else []) + failures if x.get("rank") not in racers]
    followers += [f"rank {r}: process gone" for r in sorted(set(dead) - racers)
                  if not any(x.get("rank") == r for x in failures)]
    extra = {}
    for d in race:
        title, lines, _ = _oom(ev.ranks[d.rank]) if "SIGKILL" in d.how else (None, [], False)
        extra[d.rank] = ([f"rank {d.rank} was {title}"] if title else []) + [
            f"rank {d.rank}: {line}" for line in lines]
    finding = racing_finding(a, race, root, followers, extra)
    finding.evidence += _first_error_lines(ev)
    if (ev.journal.get("restarts") or {}).get("restarts"):
        finding.evidence.append(f"journal: {attempts.describe(ev.journal['restarts'])} so far")
    return ([hang] if hang else []) + [_ended_hang(finding, hang)]


def _oom(view: dict[str, Any]) -> tuple[str | None, list[str], bool]:
    """(title, evidence, sure) about an OOM kill of a SIGKILLed rank: the kernel's line for
    its pid decides; without a readable kernel log, its cgroup's OOM kill count suggests."""
    oom = view.get("oom")
    if not oom:
        return None, [], False
    where = (f"cgroup {oom.get('cgroup')}, limit {_limit(oom)}"
             if oom.get("cgroup") else "its memory cgroup unknown")
    lines = []
    if oom.get("oom_kills") is not None:
        lines.append(f"memory cgroup {oom.get('cgroup')}: {oom['oom_kills']} OOM kill(s) "
                     f"counted, limit {_limit(oom)}")
    kernel = oom.get("kernel")
    if kernel and kernel.get("line"):
        lines.append(f"kernel log: {kernel['line']}")
        if kernel.get("memcg"):
            where = f"cgroup {kernel['memcg']}, limit {_kernel_limit(kernel) or _limit(oom)}"
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


def _limit(oom: dict[str, Any]) -> str:
    """The memory limit that bound the cgroup, where it is set when that is an ancestor."""
    n, at = oom.get("limit_bytes"), oom.get("limit_cgroup")
    if n is None:
        return "none (unlimited)" if oom.get("dir") else "unknown (its cgroup is gone)"
    return _size(n) + (f", set on its ancestor cgroup {at}" if at and at != oom.get("cgroup")
                       else "")


def _kernel_limit(kernel: dict[str, Any]) -> str | None:
    """The limit the kernel's OOM report says was hit, and whose it is when an ancestor's:
    it holds after the cgroup is gone (a transient unit removed when its job ended)."""
    n, at = kernel.get("limit_bytes"), kernel.get("oom_memcg")
    if not isinstance(n, int):
        return None
    return _size(n) + (f", set on its ancestor cgroup {at}" if at and at != kernel.get("memcg")
                       else "")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


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
        f"torchrun names rank {root['rank']} the root cause ({exit_text(root['exitcode'])}), "
        f"but rank {root['rank']}'s own error is a peer's failure seen from it: {own[:160]}; "
        f"rank {other['rank']} ended {exit_text(other['exitcode'])} with no error of its own, "
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
