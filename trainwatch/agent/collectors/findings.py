"""Findings: stalled ranks and stragglers, from the last values of the other collectors.

Conditions, not events: a finding stays while its cause holds and clears by itself
(node-problem-detector's lesson).  Exports trainwatch_rank_stall* and
trainwatch_straggler_* for the node's local ranks.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from functools import partial
from typing import Any

from trainwatch.agent.culprit_elsewhere import name_elsewhere
from trainwatch.agent.incident import group
from trainwatch.agent.registry import Collector, Result, label_values, register
from trainwatch.agent.series import Rows, SeriesBook, kept
from trainwatch.host.procinfo import describe_wait, main_thread_wait
from trainwatch.agent.stall import StallDetector, phase_holds
from trainwatch.agent.straggler import JobStragglers
from trainwatch.contract.states import STALL_KINDS

_THERMAL = ("hw_thermal", "sw_thermal")
_NO_LABELS: tuple[tuple[str, str], ...] = ()
_KIND_LABELS = {kind: (("kind", kind),) for kind in STALL_KINDS}
_POWER = ("hw_power_brake", "sw_power_cap")
# The agent reads no stacks (that takes ptrace): diagnose samples them.
_BUSY_WHERE = ("; busy in code that holds the GIL or spins: trainwatch diagnose names the "
               "function")


@register("findings", interval=1.0, timeout=5.0, first_delay=1.5, after="ranks", options={"keep_cleared": 20})
class FindingsCollector(Collector):
    def __init__(self, ctx, options):
        super().__init__(ctx, options)
        self.stalls = StallDetector(ctx.config.stall)
        self.stragglers: dict[str, JobStragglers] = {}
        self.active: dict[str, dict[str, Any]] = {}
        self.cleared: deque = deque(maxlen=int(options["keep_cleared"]))
        self.stall_counts: dict[tuple, int] = {}
        self._last: Result | None = None
        self._series: dict[tuple, SeriesBook] = {}  # a rank's series, dropped with the rank

    def collect(self) -> Result:
        ranks_data = self.ctx.store.data("ranks")
        if not ranks_data:
            return Result.absent("no rank data collected yet")
        waiting = self._not_yet(ranks_data)
        if waiting is not None:
            # Judge nobody on old observations: keep the last verdicts (no new finding,
            # none cleared, no counter moved) until the ranks have been looked at again.
            if self._last is None:
                return Result.absent(waiting)
            return Result(samples=self._last.samples, later=self._last.later,
                          data=self._last.data, reason=waiting)
        self._last = result = self._judge(ranks_data)
        return result

    def _not_yet(self, ranks_data: dict[str, Any]) -> str | None:
        """Why the rank observations cannot be judged now (None: they can)."""
        mono = time.monotonic()
        observed = ranks_data.get("observed_mono")
        interval = float(self.ctx.config.collector("ranks")["interval"])
        if not isinstance(observed, (int, float)):
            return "no rank observation yet"
        if mono - observed > max(5.0, 3 * interval):
            return (f"rank observations are {mono - observed:.1f} s old (the agent was "
                    "paused or the ranks collector is late): re-observing")
        if mono < ranks_data.get("judge_after_mono", 0.0):
            return "re-observing the ranks after a pause of the agent"
        return None

    def _judge(self, ranks_data: dict[str, Any]) -> Result:
        result = Result()
        now = time.time()
        elapsed = max(0.0, time.monotonic() - ranks_data["observed_mono"])
        current: dict[str, dict[str, Any]] = {}
        verdicts: dict[str, Any] = {}
        nodes: dict[str, Any] = {}
        keep = set()
        books: dict[tuple, SeriesBook] = {}
        stopped = self._supervisor_stopped()
        for job in ranks_data["jobs"]:
            if job.get("run_dir") in stopped:
                continue  # its ranks were stopped on purpose: nobody to page, nothing to find
            tracker = self.stragglers.setdefault(job["job"],
                                                 JobStragglers(self.ctx.config.straggler))
            tracker.options = self.ctx.config.straggler
            local = [r["rank"] for r in job["ranks"] if r.get("state") == "running"]
            if job.get("timing"):
                tracker.update(job["timing"], local, now,
                               node_ranks=[r["rank"] for r in job["ranks"]])
            holders = phase_holds(self.stalls, job["ranks"], elapsed)
            stalled = []
            for rank in job["ranks"]:
                key = (job["job"], rank["rank"], rank.get("pid"))
                keep.add(key)
                book = self._book(job["job"], rank, books)
                rows: list[tuple[str, Any, tuple[tuple[str, str], ...]]] = []
                verdict = self._stall(key, job, rank, rows, elapsed, holders, current)
                if verdict.stalled:
                    stalled.append((rank, verdict))
                standing = len(rows)  # the stall rows: the same second after second
                straggler = self._straggler(tracker, job, rank, rows, current)
                result.defer(partial(_rank_series, book, rows, standing))
                verdicts[f"{job['job']}/{rank['rank']}"] = {
                    "stall": {"budget_seconds": verdict.budget, "stalled": verdict.stalled,
                              "kind": verdict.kind},
                    "straggler": straggler,
                    "typical_step_seconds": self.stalls.typical_step(key)}
            nodes[job["job"]] = self._node_straggler(tracker, job, result, current)
            self._incident(job, stalled, now, result, current)
        self.stalls.forget(keep)
        self._series = books
        for name in set(self.stragglers) - {job["job"] for job in ranks_data["jobs"]}:
            del self.stragglers[name]  # the job's run dir is gone
        self._settle(current, now)
        result.data = {"findings": sorted(self.active.values(), key=lambda f: f["id"]),
                       "recently_cleared": list(self.cleared), "ranks": verdicts,
                       "node_stragglers": nodes}
        return result

    def _supervisor_stopped(self) -> set[str]:
        """Run directories whose journal ends with their supervisor stopping the job."""
        journal = self.ctx.store.data("journal") or {}
        return {key for key, tail in journal.items()
                if isinstance(tail, dict) and tail.get("supervisor_stopped")}

    def _book(self, job: str, rank: dict[str, Any], books: dict[tuple, SeriesBook]
              ) -> SeriesBook:
        """The rank's series, kept from the last judgement (``books``: this one's)."""
        key = (job, rank["rank"], rank.get("local_rank", ""))
        book = books.get(key) or self._series.get(key)
        if book is None:
            book = SeriesBook(label_values({"run": job, "node": self.ctx.node,
                                            "rank": rank["rank"], "local_rank": key[2]}))
        books[key] = book
        return book

    # -- stalls ----------------------------------------------------------------------
    def _stall(self, key, job, rank, rows, elapsed, holders, current):
        verdict = self.stalls.check(key, rank, elapsed, holders)
        rows += (("trainwatch_rank_stalled", verdict.stalled, _NO_LABELS),
                 ("trainwatch_rank_stall_seconds",
                  verdict.stalled_for if verdict.stalled else 0.0, _NO_LABELS),
                 ("trainwatch_rank_stall_budget_seconds", verdict.budget, _NO_LABELS))
        fid = f"stall/{job['job']}/{rank['rank']}"
        if verdict.stalled:
            phase = rank.get("phase") or ""
            rows.append(("trainwatch_rank_stall_info", 1,
                         tuple(label_values({"kind": verdict.kind, "phase": phase}).items())))
            previous = self.active.get(fid)
            if previous is None or previous.get("stall_kind") != verdict.kind:
                counter_key = (job["job"], rank["rank"], verdict.kind)
                self.stall_counts[counter_key] = self.stall_counts.get(counter_key, 0) + 1
            current[fid] = {
                "id": fid, "kind": "stall", "severity": "critical", "job": job["job"],
                "node": self.ctx.node, "rank": rank["rank"], "local_rank": rank.get("local_rank"),
                "pid": rank.get("pid"), "stall_kind": verdict.kind, "phase": phase,
                "step": rank.get("step"), "since": verdict.since,
                "stalled_seconds": round(verdict.stalled_for, 3),
                "budget_seconds": verdict.budget,
                "message": (f"rank {rank['rank']} {verdict.kind} ({verdict.reason}) in phase "
                            f"{phase or '?'} at step {rank.get('step')}; no progress for "
                            f"{verdict.stalled_for:.1f} s (budget {verdict.budget:.1f} s)"
                            + (_BUSY_WHERE if verdict.kind == "busy" else ""))}
        for kind in STALL_KINDS:
            rows.append(("trainwatch_rank_stalls_total",
                         self.stall_counts.get((job["job"], rank["rank"], kind), 0),
                         _KIND_LABELS[kind]))
        return verdict

    def _incident(self, job, stalled, now, result, current) -> None:
        """One incident per job on this node: culprit(s) critical, waiting ranks context."""
        incident = group(stalled)
        labels = {"run": job["job"], "node": self.ctx.node}
        result.add("trainwatch_stall_incident_ranks", len(incident.culprits) if incident else 0,
                   **labels, role="culprit")
        result.add("trainwatch_stall_incident_ranks", len(incident.waiting) if incident else 0,
                   **labels, role="waiting")
        if incident is None:
            return
        name_elsewhere(incident, (job.get("view") or {}).get("down_elsewhere") or [])
        culprit = incident.culprit
        result.add("trainwatch_stall_incident_seconds",
                   max(0.0, now - incident.since) if incident.since else 0.0,
                   **{**labels, "node": incident.node or self.ctx.node},
                   culprit_rank="unknown" if culprit is None else culprit, kind=incident.kind)
        iid = f"stall_incident/{job['job']}"
        for r in incident.culprits + incident.waiting:
            finding = current.get(f"stall/{job['job']}/{r}")
            if finding is not None:
                finding["incident"] = iid
                finding["role"] = "culprit" if r in incident.culprits else "waiting"
                if r not in incident.culprits and incident.culprits:
                    finding["severity"] = "info"  # context of the incident, not a page
        who = (f"rank(s) {incident.culprits} {incident.kind} ({incident.reason})"
               if incident.culprits and incident.node is None else incident.reason)
        # What the culprit waits on, from the kernel (a file lock, a FIFO, a socket...).
        cause = None
        if culprit is not None and incident.kind == "stuck":
            cause = main_thread_wait(incident.ranks[culprit].get("pid"),
                                     self.ctx.config.proc_root)
            if cause is not None:
                who += f": {describe_wait(cause)}"
        current[iid] = {
            "id": iid, "kind": "stall_incident", "severity": "critical", "job": job["job"],
            "node": self.ctx.node, "culprit_rank": culprit, "culprit_ranks": incident.culprits,
            "culprit_node": incident.node or (self.ctx.node if incident.culprits else None),
            "waiting_ranks": incident.waiting, "stall_kind": incident.kind,
            "since": incident.since, "reason": incident.reason, "cause": cause,
            "message": (f"job {job['job']} stalled: {who}; {len(incident.waiting)} rank(s) on "
                        f"this node wait{'' if incident.culprits else ' (culprit unknown here)'}")}

    # -- stragglers ------------------------------------------------------------------
    def _straggler(self, tracker, job, rank, rows, current) -> dict[str, Any] | None:
        if rank.get("state") != "running":
            return None  # a rank that ended is nobody's straggler: its last ratio must not stand
        scores = tracker.last_scores
        r = rank["rank"]
        track = tracker.ranks.get(r)
        # A slow rank is often the last to publish the newest window: its verdict (from the
        # windows it did publish) stands until it does, the flag does not blink off.
        if scores is None or (r not in scores.ratio and (track is None or track.level is None)):
            return None
        active = bool(track and track.active)
        # The level the verdict follows (median of recent windows), not one noisy window.
        ratio = track.level if track and track.level is not None else scores.ratio[r]
        window_ratio = scores.ratio.get(r, ratio)
        z = scores.score.get(r, track.recent[-1][2] if track and track.recent else None)
        if z is not None:
            rows.append(("trainwatch_straggler_score", z, _NO_LABELS))
        rows += (("trainwatch_straggler_time_ratio", ratio, _NO_LABELS),
                 ("trainwatch_straggler_slow_windows", track.slow_windows if track else 0,
                  _NO_LABELS),
                 ("trainwatch_straggler_active", active, _NO_LABELS))
        local = (job.get("timing") or {}).get("local") or {}
        if r in local:
            rows.append(("trainwatch_rank_local_seconds", local[r], _NO_LABELS))
        summary = {"ratio": round(ratio, 4), "window_ratio": round(window_ratio, 4),
                   "score": round(z, 3) if z is not None else None,
                   "slow_windows": track.slow_windows if track else 0, "active": active,
                   "judging": bool(track and track.judging),
                   "cleared_step": track.cleared_step if track else None}
        if active:
            cause, evidence = self._cause(job, rank)
            rows.append(("trainwatch_straggler_info", 1, (("cause", cause),)))
            fid = f"straggler/{job['job']}/{r}"
            current[fid] = {
                "id": fid, "kind": "straggler", "severity": "warning", "job": job["job"],
                "node": self.ctx.node, "rank": r, "local_rank": rank.get("local_rank"),
                "ratio": summary["ratio"], "score": summary["score"],
                "slow_windows": summary["slow_windows"], "since": track.since,
                "since_step": track.since_step, "detected_step": track.detected_step,
                "cause": cause, "evidence": evidence,
                "message": (f"rank {r} runs at {1 / max(ratio, 1e-9):.2f}x the speed of the "
                            f"other ranks (needs {ratio:.2f}x their time per step outside "
                            f"collectives; cause: {cause})")}
        return summary

    def _node_straggler(self, tracker, job, result, current) -> dict[str, Any] | None:
        labels = {"run": job["job"], "node": self.ctx.node}
        if tracker.node_ratio is None:
            return None
        result.add("trainwatch_straggler_node_time_ratio", tracker.node_ratio, **labels)
        result.add("trainwatch_straggler_node_active", tracker.node.active, **labels)
        if tracker.node.active:
            causes = [self._cause(job, r) for r in job["ranks"]]
            named = [c for c, _ in causes if c != "unknown"]
            fid = f"node_straggler/{job['job']}"
            current[fid] = {
                "id": fid, "kind": "node_straggler", "severity": "warning", "job": job["job"],
                "node": self.ctx.node, "ratio": round(tracker.node_ratio, 4),
                "slow_windows": tracker.node.slow_windows, "since": tracker.node.since,
                "cause": max(set(named), key=named.count) if named else "unknown",
                "evidence": sorted({e for _, ev in causes for e in ev}),
                "message": (f"node {self.ctx.node} runs at {1 / tracker.node_ratio:.2f}x the "
                            "speed of the job's other nodes")}
        return {"ratio": round(tracker.node_ratio, 4), "active": tracker.node.active,
                "slow_windows": tracker.node.slow_windows}

    def _cause(self, job: dict[str, Any], rank: dict[str, Any]) -> tuple[str, list[str]]:
        """The likely reason a rank is slow, from node evidence; 'unknown' without any."""
        opts = self.ctx.config.straggler
        gpu = self.ctx.store.data("gpu") or {}
        for g in gpu.get("gpus", []):
            if rank.get("pid") not in g.get("pids", ()):
                continue
            events = [name for name, on in (g.get("clock_events") or {}).items() if on]
            for reasons, cause in ((_THERMAL, "gpu_thermal"), (_POWER, "gpu_power"),
                                   (("hw_slowdown",), "gpu_throttle")):
                hit = [e for e in events if e in reasons]
                if hit:
                    return cause, [f"GPU {g['index']} clock events active: {', '.join(hit)}"]
        timing = job.get("timing") or {}
        local, data = timing.get("local") or {}, timing.get("data_wait") or {}
        r = rank["rank"]
        slow_storage = self._slow_storage(job)
        if (rank.get("process") or {}).get("status") == "disk_sleep":
            return "storage", ["the rank's process is in uninterruptible I/O (D)"] + slow_storage
        if r in data and local.get(r, 0) > 0:
            share = data[r] / local[r]
            if share >= float(opts["data_wait"]):
                evidence = [f"data wait is {share:.0%} of the rank's local step time"]
                if slow_storage:
                    return "storage", evidence + slow_storage
                return "data_wait", evidence
        contention = (rank.get("process") or {}).get("cpu_contention_ratio")
        # Contention is a cause only where this rank suffers more of it than its peers on
        # the node: on a machine every rank shares, it slows all of them alike.
        peers = [c for other in job.get("ranks", []) if other is not rank and isinstance(
            c := (other.get("process") or {}).get("cpu_contention_ratio"), (int, float))]
        baseline = statistics.median(peers) if peers else 0.0
        if isinstance(contention, (int, float)) and contention >= float(opts["cpu_contention"]) \
                and contention - baseline >= float(opts["cpu_contention"]) / 2:
            cpus = (rank.get("process") or {}).get("cpus") or []
            return "cpu_contention", [
                f"other processes used {contention:.0%} of the rank's cores {cpus}"
                + (f" (its peers on this node: {baseline:.0%})" if peers else "")]
        network = self.ctx.store.data("network") or {}
        growing = network.get("errors_growing") or []
        if growing:
            return "network_errors", [f"error counters growing on {', '.join(growing)}"]
        return "unknown", []

    def _slow_storage(self, job: dict[str, Any]) -> list[str]:
        """Evidence that the job's storage is slow: a failed or slow probe of its directories."""
        storage = self.ctx.store.data("storage")
        slow = float(self.ctx.config.straggler["storage_probe_seconds"])
        lines = []
        for entry in storage if isinstance(storage, list) else []:
            if entry.get("job") not in (None, job["job"]):
                continue
            probe = entry.get("probe") or {}
            if probe and not probe.get("ok", True):
                lines.append(f"storage probe of {entry.get('path')} failed: {probe.get('error')}")
            elif isinstance(probe.get("seconds"), (int, float)) and probe["seconds"] >= slow:
                lines.append(f"storage probe of {entry.get('path')} took {probe['seconds']:.2f} s")
        return lines

    # -- bookkeeping -----------------------------------------------------------------
    def _settle(self, current: dict[str, dict[str, Any]], now: float) -> None:
        for fid, finding in current.items():
            previous = self.active.get(fid)
            if previous and previous.get("stall_kind") == finding.get("stall_kind"):
                finding["detected_at"] = previous["detected_at"]
            else:
                finding["detected_at"] = now
        for fid, finding in self.active.items():
            if fid not in current:
                self.cleared.append({**finding, "cleared_at": now})
        self.active = current


def _rank_series(book: SeriesBook, rows: list[tuple[str, Any, tuple[tuple[str, str], ...]]],
                 standing: int) -> Rows:
    """One rank's stall and straggler series from the rows a judgement took (built when
    a scrape reads them: a row per series is cheaper than a sample every second). The
    first ``standing`` (the stall rows, which stand while the rank runs) are a block,
    the one handed over last while their values are the same."""
    out = Rows()
    for metric, value, extra in rows[:standing]:
        out.add(book.labelled(metric, extra) if extra else book.one(metric), value)
    book.block = kept(book.block, out.pairs)
    out.blocks.append(book.block)
    out.pairs = []
    for metric, value, extra in rows[standing:]:
        out.add(book.labelled(metric, extra) if extra else book.one(metric), value)
    return out
