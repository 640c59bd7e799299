"""Run one multi-node drill: a job of 2 nodes on one machine, each node a network namespace
(trainwatch/drill/netns.py) set up as a Slurm node would be, and the failure done to node 2.

The nodes share the run directory (``OUT``, the runs root, as cluster storage). The shipped
Slurm prolog makes the run directory, ``slurm-<job id>``; the shipped task prolog gives
each node's task its environment; each node then runs the command docs/deploy.md
("Multi-node jobs") gives a Slurm job script: one ``trainwatch run`` per node with its
``--node-rank`` and name, node 1 hosting the rendezvous on its address, each starting its
node's agent (the shipped agent config with the drill's shorter waits). The epilog is not
run: it would move the run directory away before the drill scores it.

Once the job has saved a checkpoint and completed the fault step, the drill SIGKILLs or
SIGSTOPs one rank of node 2, or loses node 2 whole (every process in its namespace
SIGKILLed: supervisor, launcher, ranks, agent), and journals ``fault_injected`` (source
``drill``) with the step in flight. Everything is stopped by PID and the namespaces are
deleted at the end, on a timeout, an error or Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from trainwatch.contract.env import FAULT_ENV, RUN_DIR_ENV
from trainwatch.drill import netns
from trainwatch.drill.catalog import KILL_RANK, NODE_LOST, Drill
from trainwatch.drill.record import RECORD_FORMAT, RECORD_VERSION, record_file
from trainwatch.drill.runner import snapshot, stop_tree
from trainwatch.drill.settings import DrillSettings, merged, write_files
from trainwatch.errors import ConfigError
from trainwatch.process.stopsignals import stopping
from trainwatch.rundir.atomic import atomic_write_json
from trainwatch.rundir.run_dir import RunDir

RDZV_PORT = 29400  # node 1's rendezvous; each namespace has ports of its own
SLURM_SCRIPTS = ("prolog.sh", "task_prolog.sh")
RUN_PREFIX = "slurm-"  # the prolog's name for a job's run directory


def default_deploy_dir() -> Path:
    """The shipped deploy/ folder of a source checkout (beside the package)."""
    return Path(__file__).resolve().parents[2] / "deploy"


def check_can_run(drill: Drill, deploy_dir: Path | None) -> Path:
    """Why this machine cannot run a multi-node drill, as a ConfigError (exit 2), before
    anything starts; else the deploy folder whose Slurm scripts and agent config it uses."""
    reason = netns.unavailable()
    if reason:
        raise ConfigError(f"drill {drill.name} runs its 2 nodes as network namespaces and "
                          f"cannot here: {reason} (run it as root on a Linux machine)")
    folder = deploy_dir or default_deploy_dir()
    needed = [folder / "slurm" / name for name in SLURM_SCRIPTS] + [folder / "agent.yaml"]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise ConfigError(f"drill {drill.name} uses the shipped Slurm scripts and agent "
                          f"config; missing: {', '.join(missing)} (give the repository's "
                          "deploy/ folder)", key="--deploy-dir")
    return folder


def agent_config(settings: DrillSettings, deploy_dir: Path, folder: Path) -> Path:
    """The shipped agent config with the drill's shorter waits; its ``discover`` is left
    out: each node's supervisor hands its agent the run directory."""
    shipped = yaml.safe_load((deploy_dir / "agent.yaml").read_text()) or {}
    shipped.pop("discover", None)
    path = folder / "agent.yaml"
    path.write_text(f"# written by trainwatch drill {settings.drill.name}: "
                    f"{deploy_dir / 'agent.yaml'} with the drill's settings\n"
                    + yaml.safe_dump(merged(shipped, settings.agent), sort_keys=False))
    return path


def slurm_env(run: RunDir, node: netns.Node, nnodes: int) -> dict[str, str]:
    """What Slurm gives the prolog and task of ``node``."""
    return {"SLURM_JOB_ID": run.root.name[len(RUN_PREFIX):], "SLURM_NNODES": str(nnodes),
            "SLURM_NODEID": str(node.index), "TRAINWATCH_RUNS_ROOT": str(run.root.parent)}


def task_env(deploy_dir: Path, node: netns.Node, env: dict[str, str]) -> dict[str, str]:
    """Run the shipped prolog (as root) and task prolog on ``node``; the task's exports."""
    for script in SLURM_SCRIPTS:
        done = subprocess.run(node.cmd("bash", str(deploy_dir / "slurm" / script)), env=env,
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise ConfigError(f"the shipped Slurm {script} failed on {node.netns} (exit "
                              f"{done.returncode}): {done.stderr.strip()[-500:]}",
                              file=str(deploy_dir / "slurm" / script))
    exports = {}
    for line in done.stdout.splitlines():
        name, sep, value = line.removeprefix("export ").partition("=")
        if line.startswith("export ") and sep:
            exports[name] = value
    return exports


def node_command(settings: DrillSettings, nodes: list[netns.Node], node: netns.Node,
                 run_dir: str, files: dict[str, Path]) -> list[str]:
    """docs/deploy.md's per-node command of a Slurm job, for ``node``."""
    drill = settings.drill
    cmd = [sys.executable, "-m", "trainwatch", "run", run_dir,
           "--nnodes", str(len(nodes)), "--node-rank", str(node.index),
           "--node-name", node.netns, "--nproc-per-node", str(settings.nproc_per_node),
           "--config", str(files["train"]), "--thresholds", str(files["thresholds"]),
           "--agent-config", str(files["agent"]), "--max-restarts", str(drill.max_restarts),
           "--rdzv-endpoint", f"{nodes[0].addr}:{RDZV_PORT}", "--local-addr", node.addr,
           "--no-live"]
    if drill.min_nnodes is not None:
        cmd += ["--min-nnodes", str(drill.min_nnodes)]
    return node.cmd(*cmd)


class NoFindings:
    """The agents listen inside their namespaces: the multi-node drills detect by the
    journal (alerts, events) and torchrun's log, not by polling an agent."""

    errors = 0

    def poll(self) -> None:
        pass

    def findings(self) -> list[dict[str, Any]]:
        return []


class NodeFault:
    """What the drill does to node 2 once the job saved a checkpoint and completed the
    fault step; journaled as ``fault_injected`` with the step then in flight."""

    def __init__(self, drill: Drill, run: RunDir, node: netns.Node, every: int):
        self.drill, self.run, self.node, self.every = drill, run, node, every
        self.done = False

    def _ranks(self) -> list[dict[str, Any]]:
        return [s for s in self.run.statuses().records
                if s.get("node") == self.node.netns and isinstance(s.get("step"), int)
                and isinstance(s.get("pid"), int)]

    def check(self, supervisor: subprocess.Popen) -> None:
        ranks = [s for s in self._ranks() if s.get("state") == "running"]
        saved = any(e.get("step", 0) >= self.every
                    for e in self.run.events("checkpoint_saved"))
        if self.done or not saved or not ranks or \
                max(s["step"] for s in ranks) < self.drill.fault_step:
            return
        self.done = True
        victim = max(ranks, key=lambda s: s["rank"])
        fields: dict[str, Any] = {"node": self.node.netns}
        if self.drill.node_fault == NODE_LOST:
            killed = netns.kill_all([self.node])
            supervisor.wait()  # reaped, as its node's init would
            ranks = [s for s in self._ranks() if s["pid"] in killed]
            fields.update(ranks=sorted(s["rank"] for s in ranks), pids=sorted(killed))
        else:
            os.kill(victim["pid"], signal.SIGKILL if self.drill.node_fault == KILL_RANK
                    else signal.SIGSTOP)
            ranks = [s for s in self._ranks() if s["rank"] == victim["rank"]]
            fields.update(rank=victim["rank"], pid=victim["pid"])
        # Read after the act: a killed or stopped rank's last completed step is final.
        in_flight = max(s["step"] for s in ranks) + 1 if ranks else victim["step"] + 1
        self.run.append_event("fault_injected", "drill", fault=self.drill.fault_kind,
                              step=in_flight, **fields)


def run_nodes_drill(settings: DrillSettings, run: RunDir, *, timeout: float,
                    deploy_dir: Path,
                    on_progress: Callable[[dict[str, Any]], None] | None = None,
                    poll_seconds: float = 0.5) -> dict[str, Any]:
    """Run the multi-node drill to its end (or ``timeout``); returns the record it wrote."""
    drill = settings.drill
    run.create()
    files = write_files(settings, run.drill_dir)
    files["agent"] = agent_config(settings, deploy_dir, run.drill_dir)
    started = time.time()
    record: dict[str, Any] = {
        "format": RECORD_FORMAT, "version": RECORD_VERSION, "drill": drill.name,
        "fault": drill.fault, "settings": settings.to_json(), "command": None,
        "started_at": started, "ended_at": None, "timeout_seconds": timeout,
        "exit_code": None, "timed_out": False, "interrupted": False, "findings": [],
        "agent_polls_failed": 0, "nodes": [], "node_exit_codes": {}}
    atomic_write_json(record_file(run), record)
    procs: list[subprocess.Popen] = []
    with netns.veth_nodes(drill.nnodes) as nodes:
        try:
            _start(settings, run, nodes, files, deploy_dir, record, procs)
            atomic_write_json(record_file(run), record)
            fault = NodeFault(drill, run, nodes[-1], settings.checkpoint_every)
            while any(p.poll() is None for p in procs):
                if time.time() - started > timeout:
                    record["timed_out"] = True
                    break
                fault.check(procs[-1])
                if on_progress is not None:
                    on_progress(snapshot(run, started, NoFindings()))  # type: ignore[arg-type]
                time.sleep(poll_seconds)
        except KeyboardInterrupt:
            stopping()
            record["interrupted"] = True
            raise
        finally:
            for proc in procs:  # SIGINT first: each stops its node's job with a checkpoint
                if proc.poll() is None:
                    stop_tree(proc)
            netns.kill_all(nodes)  # what escaped its parent, still by pid
            codes = {n.netns: p.returncode for n, p in zip(nodes, procs)}
            record.update({"ended_at": time.time(), "node_exit_codes": codes,
                           "exit_code": _job_exit_code(drill, list(codes.values()))})
            atomic_write_json(record_file(run), record)
    return record


def _job_exit_code(drill: Drill, codes: list[int | None]) -> int | None:
    """The job's exit code: its nodes' (a lost node's excepted), the first that failed."""
    if drill.node_fault == NODE_LOST:
        codes = codes[:-1]
    if not codes or None in codes:
        return None
    return next((c for c in codes if c != 0), 0)


def _start(settings: DrillSettings, run: RunDir, nodes: list[netns.Node],
           files: dict[str, Path], deploy_dir: Path, record: dict[str, Any],
           procs: list[subprocess.Popen]) -> None:
    """Each node's prolog, task prolog and supervisor, appended to ``procs`` as started."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
    for node in nodes:
        slurm = slurm_env(run, node, len(nodes))
        task = task_env(deploy_dir, node, {**base, **slurm})
        env = {**base, **slurm, **task, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "GLOO_SOCKET_IFNAME": node.ifname, FAULT_ENV: settings.drill.fault_env()}
        cmd = node_command(settings, nodes, node, task.get(RUN_DIR_ENV,
                                                          str(run.root)), files)
        record["nodes"].append({"name": node.netns, "addr": node.addr, "command": cmd})
        log = run.drill_dir / f"run-{node.netns}.log"
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True))
    record["command"] = record["nodes"][0]["command"]
