"""The drill catalog: the real-world failure each drill simulates, the ``TRAINWATCH_FAULT`` it
injects into the reference trainer (or, for the supervisor drills, what the drill itself does
to ``trainwatch run``), what must notice it and what must recover from it.

A drill's settings (alert thresholds, agent and trainer config) are the drill defaults of
``trainwatch.drill.settings`` plus the few overrides listed here: shorter waits than a
production run would use, so that one drill takes a minute, not an hour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainwatch.errors import ConfigError

# How a drill's failure may be noticed (Signal.kind); EVENT: a journal event by that name.
ALERT, FINDING, LAUNCHER, SUPERVISOR, EVENT = ("alert", "finding", "launcher", "supervisor",
                                               "event")
# How the run must get going again (Drill.recovery); RERUN: the same command, run again;
# REPAIR: the multi-node leader's action, carried out by every node (its ranks killed,
# its torchrun restarts them).
TORCHRUN, CONTROLLER, RERUN, NONE, REPAIR = "torchrun", "controller", "rerun", "none", "repair"
# What a multi-node drill does to node 2 at the fault step (Drill.node_fault).
KILL_RANK, FREEZE_RANK, NODE_LOST = "kill", "freeze", "node_lost"
# What a supervisor drill does to `trainwatch run` at the fault step (Drill.supervisor_fault).
KILL_SUPERVISOR, SECOND_SUPERVISOR = "kill", "second"
# SUPERVISOR signals, by name: the journal event the drill (or the next supervisor) writes.
SUPERVISOR_SIGNALS = {
    "tree-gone": "every process of the killed trainwatch run ended by itself",
    "leftovers-stopped": "the next trainwatch run stopped what the killed one left",
    "refused": "the second trainwatch run exited 2 naming the holder",
}


@dataclass(frozen=True)
class Signal:
    """One way the failure may be detected: an alert firing (journal ``alert_firing``), an
    agent finding (its ``/status``), or torchrun reporting the failed worker (its log)."""

    kind: str
    name: str

    def __str__(self) -> str:
        if self.kind == ALERT:
            return f"alert {self.name}"
        if self.kind == FINDING:
            return f"agent finding {self.name}"
        if self.kind == SUPERVISOR:
            return SUPERVISOR_SIGNALS[self.name]
        if self.kind == EVENT:
            return f"journal {self.name}"
        return "torchrun: worker failed"

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "text": str(self)}


@dataclass(frozen=True)
class Drill:
    name: str
    simulates: str
    fault_kind: str
    fault_step: int
    fault_params: str              # extra ``key=value`` pairs of the fault spec
    detect: tuple[Signal, ...]     # any of these counts as detection; the first one is timed
    recovery: str                  # TORCHRUN, CONTROLLER, RERUN or NONE
    action: str | None             # the automatic action that must be taken (once)
    detect_within: float           # seconds from the fault to the first detection
    recover_within: float | None   # seconds from the fault to the first step after resuming
    steps: int                     # train.steps
    max_restarts: int = 0          # torchrun's own restarts (trainwatch run --max-restarts)
    fault_rank: int = 1
    pace: str | None = None        # a fault spec for every rank that paces the steps
    thresholds: dict[str, Any] = field(default_factory=dict)
    agent: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    supervisor_fault: str | None = None  # KILL_SUPERVISOR, SECOND_SUPERVISOR: the drill acts
    nproc_per_node: int = 2        # ranks by default, and the fewest the drill works with
    detect_within_steps: int | None = None  # steps from the fault to the alert (sdc)
    # a failure every rank's memory snapshot outlives: the restart loses at most 1 step
    # (docs/memory-snapshots.md), whatever the checkpoint interval
    memory_resume: bool = False
    # multi-node drills (trainwatch/drill/nodes.py): nodes of the job, what the drill does
    # to node 2 (KILL_RANK, FREEZE_RANK, NODE_LOST), and the elastic floor (--min-nnodes)
    nnodes: int = 1
    node_fault: str | None = None
    min_nnodes: int | None = None
    notes: str = ""

    @property
    def fault(self) -> str:
        """The failure, as a TRAINWATCH_FAULT spec (a supervisor drill's: kind and step)."""
        if self.supervisor_fault:
            return f"{self.fault_kind}:step={self.fault_step}"
        if self.node_fault:
            return f"{self.fault_kind}:node=2:step={self.fault_step}"
        extra = f":{self.fault_params}" if self.fault_params else ""
        return f"{self.fault_kind}:rank={self.fault_rank}:step={self.fault_step}{extra}"

    def fault_env(self) -> str:
        """The whole TRAINWATCH_FAULT value: the failure, and the pacing if any (a supervisor
        drill's is the pacing only: the drill itself acts)."""
        return ",".join(filter(None, (None if self.supervisor_fault or self.node_fault
                                      else self.fault, self.pace)))

    def expected_recovery(self) -> str:
        if self.recovery == TORCHRUN and self.min_nnodes is not None:
            return ("the surviving nodes' torchrun re-rendezvous without the lost node "
                    f"(--min-nnodes {self.min_nnodes}); the ranks resume from the newest "
                    "in-memory state every rank has (local, or the lost ranks' peer copies)")
        if self.recovery == TORCHRUN:
            return "torchrun restarts the ranks; they resume from the newest checkpoint"
        if self.recovery == CONTROLLER:
            return (f"the controller's {self.action}: the job restarts from a checkpoint")
        if self.recovery == REPAIR:
            return (f"the leader's {self.action}, carried out once on every node: each "
                    "kills its ranks, its torchrun restarts them from the newest state")
        if self.recovery == RERUN:
            return ("the same trainwatch run command, run again, trains one job, resumed from "
                    "the newest checkpoint")
        return f"no restart; action {self.action} (report only)" if self.action else "none"


_RANK_DOWN = (Signal(LAUNCHER, "torchrun"), Signal(FINDING, "stall"),
              Signal(ALERT, "TrainingRankDown"))
_STALL = (Signal(FINDING, "stall"), Signal(ALERT, "TrainingStallSuspected"))
# Multi-node drills: the first attempt paced, so the drill acts mid-run on a loaded machine.
_NODES_PACE = "slow:delay=0.15:attempt=0"

DRILLS: tuple[Drill, ...] = (
    Drill(
        name="rank-killed",
        simulates="a rank is SIGKILLed mid-step (the kernel OOM killer, a preempted or "
                  "evicted process)",
        fault_kind="kill", fault_step=15, fault_params="launch=1",
        detect=_RANK_DOWN, recovery=TORCHRUN, action=None,
        detect_within=15, recover_within=90, steps=40, max_restarts=1,
        thresholds={"rank_down_for": "0s"},
        memory_resume=True,
        notes="torchrun restarts every rank within its --max-restarts 1; the controller only "
              "watches (TrainingRankDown's restart is skipped while the launcher runs)."),
    Drill(
        name="rank-crash",
        simulates="a rank exits with an error (an uncaught exception, a CUDA error, a failed "
                  "assertion) and torchrun has no restarts left",
        fault_kind="exit", fault_step=15, fault_params="code=3:launch=1",
        detect=_RANK_DOWN, recovery=CONTROLLER, action="restart",
        detect_within=15, recover_within=90, steps=40, max_restarts=0,
        thresholds={"rank_down_for": "0s"},
        memory_resume=True,
        notes="torchrun (--max-restarts 0) gives up; the controller's supervisor restarts the "
              "job from its newest verified checkpoint, exactly once."),
    Drill(
        name="hung-rank",
        simulates="a rank stops making progress while its process lives on (a hung "
                  "collective, a deadlocked data loader, a stuck kernel)",
        fault_kind="hang", fault_step=15, fault_params="launch=1",
        detect=_STALL, recovery=CONTROLLER, action="stall_restart",
        detect_within=30, recover_within=120, steps=40,
        # a snapshot every 4 steps: the survivors' dying gasp, asked for by the stall
        # restart before its kill, is what keeps the loss at the step in flight
        trainer={"checkpoint": {"memory_snapshots_every": 4}},
        memory_resume=True,
        notes="the agent flags a stall (heartbeats go on, steps do not); "
              "TrainingStallSuspected fires; the controller confirms the stall, stall_restart "
              "captures stacks, kills the job and restarts it (before TrainingStalled pages)."),
    Drill(
        name="frozen-rank",
        simulates="a whole rank process stops (SIGSTOP; a frozen host, a GPU that wedged the "
                  "driver, uninterruptible I/O on a dead mount)",
        fault_kind="freeze", fault_step=15, fault_params="launch=1",
        detect=_STALL, recovery=CONTROLLER, action="stall_restart",
        detect_within=30, recover_within=120, steps=40,
        # a snapshot every 4 steps: the survivors' dying gasp, asked for by the stall
        # restart before its kill, is what keeps the loss at the step in flight
        trainer={"checkpoint": {"memory_snapshots_every": 4}},
        memory_resume=True,
        notes="heartbeats stop too: the agent calls the stall 'frozen'; stall_restart kills "
              "the stopped process with SIGKILL and restarts the job."),
    Drill(
        name="nan-batch",
        simulates="a corrupt batch makes the loss NaN (bad data on disk, a numeric blow-up)",
        fault_kind="nan", fault_step=15, fault_params="",
        detect=(Signal(ALERT, "TrainingLossNonFinite"),),
        recovery=CONTROLLER, action="rollback_skip",
        detect_within=15, recover_within=120, steps=120, pace="slow:factor=4",
        trainer={"checkpoint": {"mode": "sync", "keep_last": 100}},
        notes="the NaN fires whenever step 15 runs (a batch corrupt on disk), so only "
              "rollback_skip, which restarts before it and drops its data, lets the run "
              "finish. slow:factor=4 on every rank paces a step to ~0.1-0.2 s on a CPU, so "
              "the run outlives detection as a real job would; keep_last 100 keeps the "
              "checkpoint before the NaN."),
    Drill(
        name="straggler",
        simulates="one rank computes 3x slower than the others (a throttled GPU, a noisy "
                  "neighbour, a degraded host)",
        fault_kind="slow", fault_step=10, fault_params="factor=3",
        detect=(Signal(FINDING, "straggler"), Signal(ALERT, "TrainingStragglerRank")),
        recovery=NONE, action="straggler",
        detect_within=60, recover_within=None, steps=200,
        thresholds={"straggler_for": "2s"}, trainer={"telemetry": {"exchange_every": 5}},
        notes="on one machine the straggler action only asks for a checkpoint and reports "
              "(no --straggler-command); the run must finish without a restart."),
    Drill(
        name="supervisor-killed",
        simulates="trainwatch run itself is SIGKILLed (the OOM killer picks it, a node agent "
                  "kills the session, kill -9 by hand) while its job trains",
        fault_kind="supervisor_kill", fault_step=15, fault_params="",
        detect=(Signal(SUPERVISOR, "tree-gone"), Signal(SUPERVISOR, "leftovers-stopped")),
        recovery=RERUN, action=None,
        detect_within=60, recover_within=150, steps=40, pace="slow:delay=0.2",
        supervisor_fault=KILL_SUPERVISOR,
        notes="the agent, the launcher (and with it torchrun and the ranks) get SIGTERM when "
              "their supervisor dies; the drill then runs the same command again, which must "
              "find no job left (or stop it first) and train one job from the newest "
              "checkpoint. slow:delay=0.2 paces the steps so the kill lands mid-run."),
    Drill(
        name="two-supervisors",
        simulates="the same trainwatch run command is started twice on one run directory (a "
                  "retried CI step, a second terminal, a scheduler that requeues too early)",
        fault_kind="second_supervisor", fault_step=15, fault_params="",
        detect=(Signal(SUPERVISOR, "refused"),),
        recovery=NONE, action=None,
        detect_within=45, recover_within=None, steps=60, pace="slow:delay=0.5",
        supervisor_fault=SECOND_SUPERVISOR,
        notes="the second trainwatch run must exit 2 at once naming the first's pid and host, "
              "start nothing and write nothing; the first run must finish untouched. "
              "slow:delay=0.5 keeps the first run training while the second one starts."),
    Drill(
        name="sdc",
        simulates="silent data corruption: one GPU flips a bit of its copy of a weight without "
                  "any error (a marginal SM, memory ECC does not cover)",
        fault_kind="sdc", fault_step=22, fault_params="launch=1",
        detect=(Signal(ALERT, "TrainingReplicaDivergence"),),
        recovery=CONTROLLER, action="replica_rollback",
        detect_within=30, recover_within=120, steps=60, pace="slow:delay=0.3",
        agent={"collectors": {"replicas": {"interval": 0.5}}},
        trainer={"telemetry": {"replica_every": 5},
                 "checkpoint": {"mode": "sync", "keep_last": 10}},
        nproc_per_node=3, detect_within_steps=20,
        notes="3 ranks, so a majority names the odd one; a digest every 5 steps, so two "
              "digests confirm the divergence within 10 steps of the flip (the rest of the "
              "20-step allowance is the agent's and the engine's seconds at ~0.3 s a step). "
              "replica_rollback must resume from a checkpoint saved before the flip; launch=1: "
              "the replayed step 22 runs clean, as after a transient flip."),
    # Two nodes (network namespaces, root only): trainwatch/drill/nodes.py. The drill acts
    # on node 2 once the job completed the fault step, after the first checkpoint.
    Drill(
        name="nodes-rank-killed",
        simulates="on a 2-node job, a rank on node 2 is SIGKILLed (the OOM killer, an "
                  "evicted process on one host)",
        fault_kind=KILL_RANK, fault_step=15, fault_params="",
        detect=_RANK_DOWN[:1] + _RANK_DOWN[2:], recovery=TORCHRUN, action=None,
        detect_within=15, recover_within=120, steps=40, max_restarts=1,
        pace=_NODES_PACE, thresholds={"rank_down_for": "0s"}, memory_resume=True,
        # a snapshot every 4 steps: the survivors gasp and wait for their torchrun to stop
        # them, which the agent may take for a stall; the controller must leave the
        # restart round under way to torchrun (control/restart_round.py), no stall_restart
        trainer={"checkpoint": {"memory_snapshots_every": 4}},
        nnodes=2, node_fault=KILL_RANK,
        notes="every node's torchrun restarts its workers in one re-rendezvous; the ranks "
              "resume from their memory snapshots."),
    Drill(
        name="nodes-frozen-rank",
        simulates="on a 2-node job, a rank on node 2 stops (SIGSTOP: a frozen host process, "
                  "a wedged driver)",
        fault_kind=FREEZE_RANK, fault_step=15, fault_params="",
        detect=(Signal(ALERT, "TrainingStallSuspected"),), recovery=REPAIR,
        action="stall_restart", detect_within=30, recover_within=120, steps=40,
        max_restarts=2, pace=_NODES_PACE, memory_resume=True,
        nnodes=2, node_fault=FREEZE_RANK,
        notes="the leader (node 1, which hosts the rendezvous) decides one stall_restart; "
              "every node kills its own ranks, never its launcher, so the store stays up "
              "and each torchrun restarts its workers once."),
    Drill(
        name="node-lost",
        simulates="node 2 of a 2-node job vanishes (power, a kernel panic, a partition): its "
                  "supervisor, launcher, ranks and agent are SIGKILLed at once",
        fault_kind=NODE_LOST, fault_step=15, fault_params="",
        detect=(Signal(EVENT, "node_lost"), Signal(ALERT, "TrainingRanksMissing")),
        recovery=TORCHRUN, action=None, detect_within=30, recover_within=120, steps=40,
        max_restarts=1, pace=_NODES_PACE, thresholds={"ranks_missing_for": "5s"},
        memory_resume=True, nnodes=2, node_fault=NODE_LOST, min_nnodes=1,
        notes="the documented node-loss policy 'go on with fewer nodes' (--min-nnodes 1): "
              "node 1's torchrun re-rendezvouses alone after torchrun's last_call_timeout "
              "(30 s); its 2 ranks resume from the newest in-memory step every rank has "
              "(data-parallel: their own snapshots hold the whole state; a sharded job's "
              "lost shards come from the peer copies node 1 holds) and the run finishes "
              "on 2 ranks; the leader journals node_lost once, naming node 2."),
)


def names() -> list[str]:
    return [d.name for d in DRILLS]


def get(name: str) -> Drill:
    """The drill called ``name``; an unknown name is bad usage (exit 2)."""
    for drill in DRILLS:
        if drill.name == name:
            return drill
    raise ConfigError(f"unknown drill {name!r} (known: {', '.join(names())})")
