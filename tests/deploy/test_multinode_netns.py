"""Two nodes on one machine, for real: two network namespaces joined by a veth pair
(trainwatch/drill/netns.py), each running its own `trainwatch train` launcher (torchrun, c10d
rendezvous on node 0's veth address, gloo over the veth) and its own `trainwatch agent`.
The nodes share one run directory, as nodes share a filesystem on a cluster; each
node's ranks and agent carry the node's name (`--node-name`, TRAINWATCH_NODE), because
the namespaces share the machine's hostname.

1. A watched run: node 1's ranks are slowed 4x for steps 100-199 (TRAINWATCH_FAULT
   `slow` with `until`). Each agent reports only its node's ranks; node 1's agent flags
   node 1 as a node straggler and clears it after the slowdown, node 0's never flags.
2. A killed run: node 1's rank is SIGKILLed after a checkpoint; both nodes' torchrun
   agents restart their workers (one re-rendezvous), the job resumes from the newest
   verified checkpoint and ends with the same weights as the watched run (the slowdown
   only sleeps, so it changes no numbers).
3. The `nodes-frozen-rank` drill (`trainwatch drill`, which makes two namespaces of its
   own and runs the shipped Slurm prolog and task prolog): a rank on node 1 SIGSTOPped,
   one repair on every node, the drill's scorecard asserted.
4. A lost node of an elastic own loop: the job goes on with fewer ranks and grows back.

Agents listen on their node's veth address (reachable only inside the two namespaces);
the test scrapes them from a thread inside node 0's namespace. Root only (namespaces);
skips with the reason elsewhere. Every process is stopped by PID and the namespaces are
deleted, also when a test fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_helpers import REPO, get_json, http_get, stop_process
from conftest import kill_tree
from trainwatch.drill.netns import Node, NetnsWorker, kill_all, unavailable, veth_nodes
from trainwatch.contract.ports import AGENT_PORT
from trainwatch.rank.memory_snapshots import store as snapshot_store
from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")]

STEPS = 300  # long enough after the slowdown (steps 200+) to see the flag clear while it runs
SLOW = "slow:factor=4:step=100:until=200"     # node 1 only: 10 windows, after the 8 a verdict waits for
TRAIN_ARGS = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1",
              "--steps", str(STEPS), "--set", "data.corpus_bytes=20000",
              "--set", "model.dropout=0.1",             # the RNG must resume exactly too
              "--set", "train.eval_interval=0", "--set", "checkpoint.every_steps=50",
              "--set", "telemetry.heartbeat_interval=0.2",
              "--set", "telemetry.exchange_every=10"]
# Faster collection than the defaults, so a few seconds of slowdown are seen several times.
# Ratio 3 (default 1.15): on a shared, oversubscribed 2-core machine a window of ten 10 ms
# steps came out up to 1.9x slower by scheduling alone; the drill makes node 1 4-15x slower.
AGENT_CONFIG = """\
collectors:
  ranks: {interval: 0.5}
  findings: {interval: 0.5}
  network: {interval: 1}
  gpu: {enabled: false}
  nccl: {enabled: false}
  storage: {enabled: false}
  versions: {enabled: false}
straggler: {ratio: 3.0}
"""


@pytest.fixture(scope="module")
def nodes():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with veth_nodes(2) as made:
        yield made


class Cluster:
    """Starts launchers and agents inside the nodes; ``stop()`` ends them all by PID."""

    def __init__(self, nodes: list[Node], folder: Path):
        self.nodes, self.folder = nodes, folder
        self.procs: list[subprocess.Popen] = []

    def _start(self, node: Node, argv: list[str], env: dict[str, str], log: str
               ) -> subprocess.Popen:
        full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
        full.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": node.ifname, **env})
        with open(self.folder / log, "wb") as out:
            proc = subprocess.Popen(node.cmd(sys.executable, "-m", "trainwatch", *argv),
                                    env=full, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=REPO)
        self.procs.append(proc)
        return proc

    def train(self, run_dir: Path, port: int, fault_on_node1: str | None = None
              ) -> list[subprocess.Popen]:
        """One launcher per node; node 0 hosts the rendezvous on its veth address."""
        return [self._start(node, ["train", "--node-rank", str(node.index),
                                   "--rdzv-endpoint", f"{self.nodes[0].addr}:{port}",
                                   "--local-addr", node.addr, "--node-name", node.netns,
                                   "--run-dir", str(run_dir), *TRAIN_ARGS],
                            {"TRAINWATCH_FAULT": fault_on_node1}
                            if fault_on_node1 and node.index == 1 else {},
                            f"{run_dir.name}-{node.netns}.log")
                for node in self.nodes]

    def supervise(self, run_dir: Path, port: int, options: list[str], env: dict[str, str]
                  ) -> list[subprocess.Popen]:
        """One `trainwatch run` per node on the shared run directory, as docs/deploy.md
        (Multi-node) tells an admin: node 0 hosts the rendezvous and leads."""
        return [self._start(node, ["run", str(run_dir), "--nnodes", str(len(self.nodes)),
                                   "--node-rank", str(node.index), "--node-name", node.netns,
                                   "--rdzv-endpoint", f"{self.nodes[0].addr}:{port}",
                                   "--local-addr", node.addr, "--no-live", *options],
                            env, f"{run_dir.name}-{node.netns}.log")
                for node in self.nodes]

    def agent(self, node: Node, run_dir: Path) -> subprocess.Popen:
        config = self.folder / "agent.yaml"
        config.write_text(AGENT_CONFIG)
        return self._start(node, ["agent", "--run-dir", str(run_dir), "--config", str(config),
                                  "--listen", f"{node.addr}:{AGENT_PORT}"],
                           {"TRAINWATCH_NODE": node.netns}, f"agent-{node.netns}.log")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted(self.folder.glob("*.log")))

    def stop(self) -> None:
        for proc in self.procs:
            kill_tree(proc)
        kill_all(self.nodes)  # anything that escaped its parent, still by PID


def finish(procs: list[subprocess.Popen], cluster: Cluster, timeout: float = 150) -> None:
    deadline = time.time() + timeout
    for proc in procs:
        try:
            code = proc.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            raise AssertionError("a launcher did not finish in time\n" + cluster.logs()) from None
        assert code == 0, f"launcher exited {code}\n" + cluster.logs()


def digest(run_dir: Path) -> dict:
    """What `trainwatch checkpoint digest RUN_DIR --json` prints (in-process)."""
    from click.testing import CliRunner
    from trainwatch.rank.checkpoint.cli import checkpoint
    done = CliRunner().invoke(checkpoint, ["digest", "--json", str(run_dir)])
    assert done.exit_code == 0, done.output
    return json.loads(done.output)


@pytest.fixture(scope="module")
def watched(nodes, tmp_path_factory):
    """Run 1 with an agent per node; /status of both agents polled every 0.25 s from a
    thread in node 0's namespace (like a Prometheus on node 0 scraping both nodes)."""
    folder = tmp_path_factory.mktemp("watched")
    run_dir = folder / "watched-run"
    cluster = Cluster(nodes, folder)
    scraper = NetnsWorker(nodes[0])
    urls = {node.netns: f"http://{node.addr}:{AGENT_PORT}" for node in nodes}
    seen: dict[str, list[dict]] = {name: [] for name in urls}
    metrics: dict[str, bytes] = {}
    try:
        agents = [cluster.agent(node, run_dir) for node in nodes]
        launchers = cluster.train(run_dir, 29400, fault_on_node1=SLOW)
        deadline = time.time() + 150
        while any(p.poll() is None for p in launchers):
            assert time.time() < deadline, "the watched run did not finish\n" + cluster.logs()
            assert all(a.poll() is None for a in agents), "an agent died\n" + cluster.logs()
            for name, url in urls.items():
                try:
                    status = scraper.call(get_json, url + "/status")
                except OSError:
                    continue  # not listening yet
                seen[name].append(status)
                if name not in metrics and _node_finding(status):
                    metrics[name] = scraper.call(http_get, url + "/metrics")
            time.sleep(0.25)
        finish(launchers, cluster)
        final = {name: scraper.call(get_json, url + "/status") for name, url in urls.items()}
        for agent in agents:
            assert stop_process(agent) == 0, cluster.logs()
        yield {"run_dir": run_dir, "seen": seen, "final": final, "metrics": metrics,
               "nodes": nodes, "logs": cluster.logs}
    finally:
        scraper.close()
        cluster.stop()


def _job(status: dict) -> dict:
    jobs = status.get("jobs") or [{}]
    return jobs[0]


def _node_finding(status: dict) -> dict | None:
    return next((f for f in status.get("findings", []) if f["kind"] == "node_straggler"), None)


def _running(status: dict) -> bool:
    ranks = _job(status).get("ranks") or []
    return bool(ranks) and all(r["state"] == "running" and (r["step"] or 0) < STEPS - 1
                               for r in ranks)


def test_each_node_has_its_own_ranks_and_its_own_network(watched):
    run = RunDir(watched["run_dir"])
    node_of = {s["rank"]: s["node"] for s in run.statuses().records}
    names = [n.netns for n in watched["nodes"]]
    # Global ranks follow the rendezvous, not --node-rank: read who is where.
    assert sorted(node_of) == [0, 1] and sorted(node_of.values()) == sorted(names), node_of
    assert {e["host"] for e in run.events("launcher_started")} == set(names)
    for node in watched["nodes"]:
        history = [s for s in watched["seen"][node.netns] if _job(s).get("ranks")]
        assert history, f"agent on {node.netns} never reported a rank\n" + watched["logs"]()
        assert all(s["node"] == node.netns for s in history)
        reported = {(r["rank"], r["node"]) for s in history for r in _job(s)["ranks"]}
        mine = {(rank, name) for rank, name in node_of.items() if name == node.netns}
        assert reported == mine, (node.netns, reported)  # its own rank, never the other's
        # The agent sees its namespace's interfaces only: its end of the veth.
        nics = {i["device"] for s in history
                for i in (s.get("node_health") or {}).get("network", {}).get("interfaces", [])}
        assert nics == {node.ifname}, nics
    # Node 1 reaches the job's master (rank 0's store on node 0) over the veth.
    master = next(n for n in watched["nodes"] if n.netns == node_of[0])
    other = next(n for n in watched["nodes"] if n is not master)
    peers = [p for s in watched["seen"][other.netns]
             for p in (s.get("node_health") or {}).get("network", {}).get("peers", [])
             if p.get("role") == "master"]
    assert peers and all(p["peer"].startswith(master.addr + ":") for p in peers), peers
    assert any(p["up"] for p in peers), peers


def test_the_slowed_node_is_flagged_then_cleared_and_the_other_never(watched):
    fast, slow = (n.netns for n in watched["nodes"])
    history = watched["seen"][slow]
    flagged = [i for i, s in enumerate(history) if _node_finding(s) and _running(s)]
    assert flagged, "node 1 was never flagged as a node straggler\n" + json.dumps(
        [_job(s).get("node_straggler") for s in history]) + watched["logs"]()
    finding = _node_finding(history[flagged[0]])
    assert finding["node"] == slow and finding["ratio"] >= 3.0, finding
    print(f"node straggler flagged: ratio {finding['ratio']}, cause {finding['cause']}")
    # The gauge says so on /metrics too, labelled with the slowed node.
    assert re.search(rf'trainwatch_straggler_node_active{{[^}}]*node="{slow}"[^}}]*}} 1',
                     watched["metrics"][slow].decode()), "node_active gauge not 1"
    # Cleared by itself after the slowdown ended (step 200), while the job still ran.
    cleared = [s for s in history[flagged[0] + 1:] if _running(s) and not _node_finding(s)
               and _job(s)["node_straggler"] and not _job(s)["node_straggler"]["active"]]
    assert cleared, "node 1's straggler finding did not clear while the job ran\n" + json.dumps(
        [_job(s).get("node_straggler") for s in history])
    assert any(f["id"] == finding["id"] for f in watched["final"][slow]["recently_cleared"])
    # Node 0 ran at full speed throughout: no node or rank straggler, ever.
    for status in [*watched["seen"][fast], watched["final"][fast]]:
        assert not [f for f in status.get("findings", [])
                    if f["kind"] in ("node_straggler", "straggler")], status["findings"]
        assert not [f for f in status.get("recently_cleared", [])
                    if f["kind"] in ("node_straggler", "straggler")]
    ratios = [_job(s)["node_straggler"]["ratio"] for s in watched["seen"][fast]
              if _job(s).get("node_straggler")]
    assert ratios and min(ratios) < 1.0, ratios  # it was scored: faster than node 1
    print(f"node 0's node ratio: {min(ratios)}..{max(ratios)} (threshold 3)")


def test_sigkill_on_node1_restarts_both_nodes_and_resumes_to_the_same_weights(
        nodes, watched, tmp_path):
    reference = digest(watched["run_dir"])
    assert reference["path"].endswith(f"step-{STEPS:08d}")
    run_dir = tmp_path / "killed-run"
    cluster = Cluster(nodes, tmp_path)
    run = RunDir(run_dir)
    try:
        launchers = cluster.train(run_dir, 29401)
        deadline = time.time() + 120
        victim = None
        while victim is None:
            assert time.time() < deadline, "no checkpoint before the deadline\n" + cluster.logs()
            assert all(p.poll() is None for p in launchers), cluster.logs()
            if any(e["step"] >= 50 for e in run.events("checkpoint_saved")):
                victim = next((s for s in run.statuses().records
                               if s["node"] == nodes[1].netns and s["state"] == "running"), None)
            time.sleep(0.1)
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.time()
        finish(launchers, cluster)
        restart_took = min(e["time"] for e in run.events("rank_started")
                           if e["restart_count"] == 1) - killed_at
    finally:
        cluster.stop()

    started = run.events("rank_started")
    # Two attempts, each with one rank per node; the job-wide restart count on both.
    assert sorted((e["restart_count"], e["host"]) for e in started) == sorted(
        (count, node.netns) for count in (0, 1) for node in nodes), started
    saved_before = [e["step"] for e in run.events("checkpoint_saved")
                    if e["time"] < min(e2["time"] for e2 in started if e2["restart_count"])]
    resumed = run.events("checkpoint_resumed")
    (last,) = resumed
    if last.get("state_from", "checkpoint") != "checkpoint":
        # from memory (the default): a snapshot, its peer copy or a survivor's dying gasp
        assert last["durable_step"] == max(saved_before) < last["step"], (last, saved_before)
    else:  # no snapshot newer than the checkpoint (the kill came right after it)
        assert last["step"] == max(saved_before), (resumed, saved_before)
    assert [e["restart_count"] for e in run.events("restarted")] == [1]
    statuses = run.statuses().records
    assert sorted(s["node"] for s in statuses) == sorted(n.netns for n in nodes)
    assert all(s["state"] == "finished" and s["step"] == STEPS - 1 and s["restart_count"] == 1
               for s in statuses), statuses
    assert [e["exit_code"] for e in run.events("launcher_exited")] == [0, 0]
    assert digest(run_dir)["digest"] == reference["digest"]
    print(f"resumed from step {resumed[0]['step']}; workers restarted {restart_took:.1f} s "
          "after the SIGKILL")


def test_sigstop_on_node1_is_repaired_once_on_every_node_without_losing_the_rendezvous(
        tmp_path):
    """The `nodes-frozen-rank` drill, as an admin runs it (`trainwatch drill run`, root):
    2 nodes x 2 ranks in network namespaces of its own, the shipped Slurm prolog and task
    prolog, one `trainwatch run` per node on the shared run directory, each with its agent.
    A rank on node 1 is frozen (SIGSTOP) after a checkpoint: one repair is decided (by node
    0, the leader) and journaled, each node kills its own ranks (not its launcher, which
    keeps the rendezvous store up), every torchrun restarts its workers once, all ranks
    resume from the newest in-memory state and the job finishes on both nodes."""
    out = tmp_path / "drills"
    done = subprocess.run([sys.executable, "-m", "trainwatch", "drill", "run",
                           "nodes-frozen-rank", "--out", str(out), "--keep", "--json"],
                          capture_output=True, text=True, timeout=400, cwd=REPO)
    (card,) = json.loads(done.stdout)["drills"] if done.stdout else [{}]
    assert done.returncode == 0 and card["passed"], done.stderr[-3000:] + json.dumps(
        card.get("criteria"), indent=1)
    assert [c["name"] for c in card["criteria"]][-1] == "restarted once on every node"
    names = [n["node"] for n in card["nodes"]]
    assert [n["restarts"] for n in card["nodes"]] == [1, 1], card["nodes"]
    assert card["recovery"]["by"] == "torchrun" and card["recovery"]["restarts"] == 1
    assert card["steps"]["lost"] <= 1 and card["steps"]["resumed_with"] == "memory snapshot"
    run = RunDir(card["run_dir"])
    assert run.root.name.startswith("slurm-nodes-frozen-rank-")  # the prolog's name
    requested = run.events("repair_requested")
    assert len(requested) == 1 and requested[0]["node"] == names[0], requested
    taken = run.events("action_taken")
    assert [e["action"] for e in taken] == ["stall_restart"], taken
    assert taken[0]["host"] == names[0] and taken[0]["request"] == 1
    applied = run.events("repair_applied")
    assert sorted(e["node"] for e in applied) == sorted(names), applied
    assert all(e["number"] == 1 and e["launcher_running"] for e in applied), applied
    (fault,) = [e for e in run.events("fault_injected") if e["source"] == "drill"]
    assert fault["node"] == names[1] and fault["pid"] in next(
        e for e in applied if e["node"] == names[1])["killed"]
    # No launcher was stopped or restarted: the rendezvous store stayed up.
    assert not run.events("job_stopped") and len(run.events("job_started")) == 2
    assert [e["exit_code"] for e in run.events("launcher_exited")] == [0, 0]
    statuses = run.statuses().records
    assert len(statuses) == 4 and sorted({s["node"] for s in statuses}) == sorted(names)
    assert all(s["state"] == "finished" and s["restart_count"] == 1 for s in statuses)
    # Everything the drill started is gone, its namespaces too.
    assert not [n for n in names if Path(f"/run/netns/{n}").exists()]
    print(f"freeze -> repair decided {requested[0]['time'] - fault['time']:.1f} s, -> first "
          f"resumed step {card['recovery']['seconds']:.1f} s ({card['steps']})")


LOSS_STEPS = 100_000  # never reached: the test stops the job once it has grown back
GROWN_STEPS = 10  # steps the grown-back world of 4 ranks trains before the test stops it


def own_loop_on(node: Node, nodes: list[Node], port: int) -> list[str]:
    """An own DDP loop's elastic torchrun on ``node``, as docs/deploy.md ("A lost node")
    tells a user: --nnodes 1:2, node 0 hosts the rendezvous (is_host)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
            "--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{nodes[0].addr}:{port}", "--local-addr", node.addr,
            "--rdzv-conf", f"is_host={int(node.index == 0)},last_call_timeout=3",
            str(REPO / "examples" / "own_loop.py"), "--steps", str(LOSS_STEPS),
            "--pace", "0.05", "--checkpoint-every", "20", "--memory-snapshots", "every_step"]


def _grown(run: RunDir) -> bool:
    """The world has grown back to 4 ranks, and each trained GROWN_STEPS after resuming."""
    returned = run.events("node_returned")
    if len(run.events("checkpoint_resharded")) < 2 or not returned:
        return False
    resumed = run.events("checkpoint_resumed")[-1]["step"]
    now = [s for s in run.statuses().records if s.get("world_size") == 4
           and (s.get("started_at") or 0) > returned[0]["time"]]
    return len(now) == 4 and all((s.get("step") or 0) >= resumed + GROWN_STEPS for s in now)


def test_a_lost_node_is_journaled_once_the_job_goes_on_with_fewer_ranks_and_grows_back(
        nodes, tmp_path):
    """2 nodes x 2 ranks of an own DDP loop, one `trainwatch run` per node, elastic torchrun.
    Node 1 is lost after a checkpoint (supervisor, launcher, ranks SIGKILLed): node 0's
    torchrun goes on alone, its 2 ranks resume from their memory snapshots (4 -> 2 ranks),
    losing at most the step in flight although the durable checkpoint is older,
    and the leader journals node_lost once, naming node 1; report names it as the cause.
    Node 1's supervisor is started again: node_returned, the job grows back to 4 ranks at
    the next re-rendezvous (2 -> 4) and trains on all 4; then both nodes are stopped with
    Ctrl-C (the job is paced to outlast any machine's speed, so the test ends it)."""
    run_dir = tmp_path / "elastic-run"
    run = RunDir(run_dir)
    cluster = Cluster(nodes, tmp_path)
    port = 29404

    def supervise(node: Node, log: str) -> subprocess.Popen:
        return cluster._start(node, ["run", str(run_dir), "--nnodes", "2", "--node-rank",
                                     str(node.index), "--node-name", node.netns, "--no-live",
                                     "--", *own_loop_on(node, nodes, port)], {}, log)

    try:
        sups = [supervise(node, f"elastic-{node.netns}.log") for node in nodes]
        deadline = time.time() + 120
        while not any(e["step"] >= 40 for e in run.events("checkpoint_saved")):
            assert time.time() < deadline, "no checkpoint in time\n" + cluster.logs()
            assert all(p.poll() is None for p in sups), cluster.logs()
            time.sleep(0.2)
        # The lost node's ranks have snapshots newer than the durable checkpoint (the
        # namespaces share /dev/shm, so they stay readable here after the kill).
        root = Path(run.events("memory_snapshots_started")[0]["root"])

        def sealed_step(rank: int) -> int:
            return max((s.step for s in snapshot_store.sealed(
                snapshot_store.rank_folder(root, rank))), default=-1)
        durable = max(e["step"] for e in run.events("checkpoint_saved"))
        while min(sealed_step(2), sealed_step(3)) < durable + 3:
            assert time.time() < deadline, "no snapshot past the checkpoint\n" + cluster.logs()
            time.sleep(0.05)
        kill_all([nodes[1]])  # the node is gone: supervisor, torchrun, ranks, agent
        lost_at = time.time()
        at_loss = max(sealed_step(2), sealed_step(3))
        sups[1].wait(10)  # reaped, as its node's init would (a zombie still has its pid)
        while not (run.events("node_lost") and run.events("checkpoint_resharded")):
            assert time.time() < lost_at + 90, "node 0 did not go on alone\n" + cluster.logs()
            assert sups[0].poll() is None, cluster.logs()
            time.sleep(0.2)
        back = supervise(nodes[1], f"elastic-{nodes[1].netns}-back.log")
        deadline = time.time() + 120
        while not _grown(run):
            assert time.time() < deadline, "the job did not grow back\n" + cluster.logs()
            assert sups[0].poll() is None and back.poll() is None, cluster.logs()
            time.sleep(0.2)
        for proc in (sups[0], back):
            proc.send_signal(signal.SIGINT)  # Ctrl-C on each node
        codes = [proc.wait(60) for proc in (sups[0], back)]
        assert codes == [130, 130], (codes, cluster.logs())  # stopped on request
        assert "Traceback" not in cluster.logs(), cluster.logs()  # each said so, in words
    finally:
        cluster.stop()

    # The lost node cost at most the step in flight: the shrunk world resumed from memory at
    # (or past) the newest step the lost ranks had sealed, not from the durable checkpoint.
    shrunk = [e for e in run.events("checkpoint_resumed") if e["time"] >= lost_at][0]
    assert shrunk["state_from"] in ("memory snapshot", "peer copy"), shrunk
    assert shrunk["step"] >= at_loss > shrunk["durable_step"], (shrunk, at_loss)
    (lost,) = run.events("node_lost")
    assert lost["lost_node"] == nodes[1].netns and lost["host"] == nodes[0].netns
    assert lost["ranks"] == [2, 3] and lost["silent_seconds"] >= 15
    (returned,) = run.events("node_returned")
    assert returned["lost_node"] == nodes[1].netns
    worlds = [(e["from_world_size"], e["to_world_size"])
              for e in run.events("checkpoint_resharded")]
    assert worlds == [(4, 2), (2, 4)], worlds
    statuses = run.statuses().records
    assert sorted(s["rank"] for s in statuses) == [0, 1, 2, 3]
    assert {s["node"] for s in statuses} == {n.netns for n in nodes}
    assert all(s["world_size"] == 4 and s["state"] == "stopped" for s in statuses), statuses
    # Every rank carried the agreed stop out, also those whose own SIGTERM came during it:
    # none failed in the stop's collectives, and each node's supervisor journaled its stop.
    assert not [e for e in run.events("failed") if e["time"] > returned["time"]], statuses
    assert sorted(e["host"] for e in run.events("controller_stopping")) == sorted(
        n.netns for n in nodes)
    done = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run_dir), "--json"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    causes = [i["cause"] for i in json.loads(done.stdout)["incidents"]]
    assert causes[0].startswith(f"node {nodes[1].netns} lost"), causes
    assert causes[1].startswith(f"node {nodes[1].netns} returned"), causes
    assert not [c for c in causes if "died without a word" in c], causes  # went with its node
    print(f"node lost -> journaled {lost['time'] - lost_at:.1f} s; incidents: {causes}")
