"""Replicas: compare the parameter digests of a run's data-parallel ranks on this node and
name the rank whose weights diverged (silent data corruption; agent/replicas.py, docs/sdc.md).

Builds on the ranks collector's records (each rank's ``replicas`` digests). Exports
trainwatch_replica_*: the divergence verdict the TrainingReplicaDivergence alert reads, the
per-rank mismatch count, and each rank's digest value for comparisons across nodes.
"""

from __future__ import annotations

from typing import Any

from trainwatch.agent.registry import Collector, Result, register
from trainwatch.agent.replicas import ReplicaJudge
from trainwatch.contract.replicas import suspects_label

_LOW_BITS = (1 << 52) - 1


@register("replicas", interval=1.0, timeout=5.0, first_delay=1.5, after="ranks")
class ReplicasCollector(Collector):
    def __init__(self, ctx, options):
        super().__init__(ctx, options)
        self.judge = ReplicaJudge()

    def collect(self) -> Result:
        ranks_data = self.ctx.store.data("ranks")
        if not ranks_data:
            return Result.absent("no rank data collected yet")
        result = Result()
        summary: dict[str, dict[str, Any]] = {}
        jobs = set()
        for job in ranks_data["jobs"]:
            name = job["job"]
            jobs.add(name)
            verdicts = self.judge.update(name, job["ranks"])
            for group, v in verdicts.items():
                labels = {"run": name, "node": self.ctx.node, "group": group}
                if v.last_step >= 0:
                    result.add("trainwatch_replica_digest_step", v.last_step, **labels)
                    result.add("trainwatch_replica_digest_ranks_compared", v.compared, **labels)
                    result.add("trainwatch_replica_digest_ranks_agreeing", v.agreeing, **labels)
                if v.suspects:
                    result.add("trainwatch_replica_divergence_digests", v.streak, **labels,
                               suspects=suspects_label(v.suspects, v.majority))
                summary.setdefault(name, {})[group] = {
                    "step": v.last_step if v.last_step >= 0 else None,
                    "compared": v.compared, "agreeing": v.agreeing,
                    "suspects": v.suspects, "majority": v.majority, "digests": v.streak}
            for rank in job["ranks"]:
                self._rank(name, rank, verdicts, result)
        self.judge.forget(jobs)
        result.data = {"jobs": summary}  # /status shows each job's groups
        return result

    def _rank(self, job: str, rank: dict[str, Any], verdicts: dict, result: Result) -> None:
        digests = rank.get("replicas") or []
        if not digests:
            return
        newest = digests[-1]
        labels = {"run": job, "node": self.ctx.node, "rank": rank["rank"],
                  "local_rank": rank.get("local_rank")}
        verdict = verdicts.get(newest["group"])
        if verdict is not None and rank["rank"] in verdict.mismatch:
            result.add("trainwatch_replica_digest_mismatch", verdict.mismatch[rank["rank"]],
                       **labels)
        result.add("trainwatch_replica_digest_value", int(newest["bits"], 16) & _LOW_BITS,
                   **labels, group=newest["group"])
        result.add("trainwatch_replica_digest_value_step", newest["step"], **labels,
                   group=newest["group"])
