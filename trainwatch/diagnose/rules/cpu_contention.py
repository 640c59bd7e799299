"""Rule: this node's CPUs are contended and the job's ranks here slowed together for it.

A whole contended node is not a straggler: every local rank slowed against its own earlier
steps (by 1.2x: on a node already busy, the hogs that take the cores slow a job that also
sleeps and waits by 1.3-2.2x, its median of 5 steps swinging across 1.5x from one diagnose to
the next), a rank waited for a CPU a large share of the time (at least half of the time its
steps grew by; a clean job on the same busy node waits under 10 %), and the kernel's run
queue says the node has more runnable tasks than cores while processes outside the job take
the CPU. Not every rank waits: the one the scheduler serves
first then sleeps in the collective, waiting for the other (measured: 55 % and 7 %). All
of it is required (``Evidence.node_cpu``, diagnose/node_cpu.py): a busy shared node whose
job keeps its pace is not reported, nor a slow rank that waits for something else.

Until the slowdown is established (3 slow steps), a local rank (of two or more) that waits
for a CPU on such a node is already explained, with no finding: the straggler rule after
this one must not name the rank the scheduler happened to serve last.
"""

from __future__ import annotations

from trainwatch.diagnose.casefile import Analysis
from trainwatch.diagnose.model import Finding

SLOWED_RATIO = 1.2        # every local rank's recent step time vs its own earlier steps
RANK_WAIT_SHARE = 0.2     # each rank's main thread waited for a CPU this share of the time
OUTSIDE_CPU_PERCENT = 100.0  # processes outside the job took at least one core's worth
PRESSURE_AVG10 = 25.0     # % of the last 10 s some task waited for a CPU (when PSI exists)


def check_cpu_contention(a: Analysis) -> list[Finding]:
    cpu = a.ev.node_cpu
    ranks = sorted(r for r in (cpu.get("slowdown") or {}) if r in a.running)
    if a.stalled or not ranks or "cores" not in cpu:
        return []
    slow = {r: cpu["slowdown"][r] for r in ranks}
    waited = cpu.get("rank_wait_share") or {}
    cores, runnable, load1 = cpu.get("cores") or 0, cpu.get("runnable"), cpu.get("load1")
    queue = max(x for x in (runnable, load1, 0) if isinstance(x, (int, float)))
    pressure = cpu.get("pressure_some_avg10")
    if not (cores and queue > cores and (pressure is None or pressure >= PRESSURE_AVG10)
            and cpu.get("outside_cpu_percent", 0) >= OUTSIDE_CPU_PERCENT):
        return []
    waiting = [r for r in ranks if waited.get(r, 0) >= RANK_WAIT_SHARE]
    if len(ranks) >= 2:
        # On a contended node the rank the scheduler serves last waits for a CPU and looks
        # slowest: not a straggler (a straggler's extra time is its own work, not a wait),
        # even before the slowdown is established.
        a.explained.update(waiting)
    if not (waiting and all(s and (s.get("ratio") or 0) >= SLOWED_RATIO for s in slow.values())
            and any(waited[r] >= 0.5 * (1 - 1 / slow[r]["ratio"]) for r in waiting)):
        return []
    a.explained.update(ranks)
    top = ", ".join(f"{p['pid']}/{p['comm']}/{p['cpu_percent']:.0f}%"
                    for p in cpu.get("top_outside") or [])
    node = a.node(ranks[0])
    steal = cpu.get("steal_share")
    evidence = [
        f"rank {r}: step time {s['recent'] * 1000:.0f} ms now vs {s['baseline'] * 1000:.0f} ms "
        f"earlier ({s['ratio']:.1f}x); its main thread waited for a CPU "
        f"{waited.get(r, 0) * 100:.0f} % of the last {cpu.get('seconds')} s"
        for r, s in slow.items()]
    evidence.append(
        f"node {node}: {runnable} runnable task(s) now, load {load1} on {cores} core(s)"
        + (f"; CPU pressure {pressure:.0f} % (some, avg10)" if pressure is not None else "")
        + (f"; hypervisor steal {steal * 100:.0f} %" if steal else ""))
    evidence.append(f"processes outside the job took {cpu['outside_cpu_percent']:.0f} % of a "
                    f"core: {top} (pid/comm/CPU%)")
    return [Finding(
        "node", f"the node is CPU-contended: {queue:g} runnable tasks on {cores} cores, top "
        f"consumers outside the job: {top}", severity="warning", confidence="medium",
        nodes=[node], evidence=evidence, runbook="TrainingStragglerRank",
        next_command="top -b -n1 -o %CPU | head -20")]
