"""NCCL: what the collective library says about each job on this node.

* NCCL jobs: the RAS endpoint (communicators, missing ranks, errors); absent for jobs
  that do not use NCCL (gloo jobs report their backend and per-rank progress instead).
* WARN lines in NCCL_DEBUG_FILE logs (from the ranks' environment, ``%h``/``%p``
  expanded, plus configured globs), read incrementally.
* NCCL_* / TORCH_* environment consistency across the node's ranks (names only; values
  never leave the agent).
"""

from __future__ import annotations

import glob
import os
import socket
from collections import deque
from typing import Any

from trainwatch.agent.ncclras import RasError, query_status, summarize
from trainwatch.agent.registry import Collector, Result, register

_CONSISTENCY_PREFIXES = ("NCCL_", "TORCH_")
_PER_RANK = ("NCCL_DEBUG_FILE",)  # may legitimately differ (%p expands per process)


def env_mismatches(envs: list[dict[str, str]]) -> list[str]:
    """Names of NCCL_/TORCH_ variables not set identically on every rank."""
    keys = {k for env in envs for k in env if k.startswith(_CONSISTENCY_PREFIXES)}
    return sorted(k for k in keys - set(_PER_RANK) if len({env.get(k) for env in envs}) > 1)


@register("nccl", interval=10.0, timeout=8.0, first_delay=1.5, options={
    "ras_address": "localhost:28028",
    "ras_timeout": 5.0,
    "debug_files": [],          # extra globs of NCCL debug logs
    "max_lines_shown": 5,
})
class NcclCollector(Collector):
    def __init__(self, ctx, options):
        super().__init__(ctx, options)
        self._offsets: dict[str, int] = {}
        self._warnings: dict[str, int] = {}
        self._recent: dict[str, deque] = {}

    def collect(self) -> Result:
        ranks = self.ctx.store.data("ranks")
        if not ranks:
            return Result.absent("no rank data collected yet")
        result, jobs, version = Result(), {}, None
        for job in ranks["jobs"]:
            entry, found = self._job(job, result)
            version = version or found
            jobs[job["job"]] = entry
        result.data = {"jobs": jobs, "nccl_version": version}
        return result

    def _job(self, job: dict[str, Any], result: Result) -> tuple[dict[str, Any], str | None]:
        lab = {"run": job["job"], "node": self.ctx.node}
        backend = job.get("backend")
        envs = [e for e in (job.get("env") or {}).values() if e]
        entry: dict[str, Any] = {"backend": backend,
                                 "progress": {str(r["rank"]): r.get("step") for r in job["ranks"]}}
        version = None
        if backend == "nccl":
            address = next((e["NCCL_RAS_ADDR"] for e in envs if e.get("NCCL_RAS_ADDR")),
                           self.options["ras_address"])
            try:
                summary = summarize(query_status(address, float(self.options["ras_timeout"])))
                entry["ras"] = {"state": "ok", "address": address, **summary}
                version = summary.get("nccl_version")
                result.add("trainwatch_nccl_ras_up", 1, **lab)
                result.add("trainwatch_nccl_ras_communicators", summary["communicators"], **lab)
                result.add("trainwatch_nccl_ras_ranks_missing", summary["ranks_missing"], **lab)
                result.add("trainwatch_nccl_ras_errors", summary["errors"], **lab)
            except (OSError, RasError, ValueError) as exc:
                entry["ras"] = {"state": "failed", "address": address,
                                "reason": f"{type(exc).__name__}: {exc}"}
                result.add("trainwatch_nccl_ras_up", 0, **lab)
        else:
            entry["ras"] = {"state": "absent",
                            "reason": f"job uses {backend or 'no process group'}, not NCCL"}
        if envs:
            mismatched = env_mismatches(envs)
            entry["env_consistent"], entry["env_mismatches"] = not mismatched, mismatched
            result.add("trainwatch_nccl_env_consistent", not mismatched, **lab)
            result.add("trainwatch_nccl_env_mismatches", len(mismatched), **lab)
        files = self._debug_files(job, envs)
        if files:
            for path in files:
                self._tail(job["job"], path)
            result.add("trainwatch_nccl_log_warnings_total", self._warnings.get(job["job"], 0),
                       **lab)
            entry["log_files"] = files
            entry["log_warnings_total"] = self._warnings.get(job["job"], 0)
            entry["recent_warnings"] = list(self._recent.get(job["job"], ()))
        return entry, version

    def _debug_files(self, job: dict[str, Any], envs: list[dict[str, str]]) -> list[str]:
        patterns = list(self.options["debug_files"])
        host = socket.gethostname()
        pids = {r["rank"]: r.get("pid") for r in job["ranks"]}
        for rank, env in (job.get("env") or {}).items():
            pattern = env.get("NCCL_DEBUG_FILE") if env else None
            if pattern:
                patterns.append(pattern.replace("%h", host).replace("%p", str(pids.get(rank))))
        files: list[str] = []
        for pattern in patterns:
            files.extend(glob.glob(pattern) if any(c in pattern for c in "*?[") else
                         [pattern] if os.path.isfile(pattern) else [])
        return sorted(set(files))

    def _tail(self, job: str, path: str) -> None:
        """Count new ' NCCL WARN ' lines since the last read (restart at 0 if truncated)."""
        try:
            size = os.path.getsize(path)
            offset = self._offsets.get(path, 0)
            if size < offset:
                offset = 0
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(min(size - offset, 16 << 20))
        except OSError:
            return
        complete = data.rfind(b"\n") + 1
        self._offsets[path] = offset + complete
        recent = self._recent.setdefault(job, deque(maxlen=int(self.options["max_lines_shown"])))
        for line in data[:complete].splitlines():
            if b"NCCL WARN" in line:
                self._warnings[job] = self._warnings.get(job, 0) + 1
                recent.append(line.decode(errors="replace")[:300])
