"""Each agent exports only the ranks whose process runs on its node (issue #34, item 4).

On a shared runs root (cluster storage) every node's agent reads every job's statuses: a
2-rank job on one node showed `trainwatch_rank_up` from the other node's agent too, whose
view of the ranks' pids means nothing. A rank publishes its node (TRAINWATCH_NODE, else
the hostname) and boot; an agent counts it when the node is its own (or, for a trainer
container with a hostname of its own, when it runs on this very machine and boot).
"""

from __future__ import annotations

import os

import pytest

from agent_helpers import collector, samples, write_status
from trainwatch.agent.config import load_config
from trainwatch.agent.context import AgentContext
from trainwatch.contract.env import NODE_ENV
from trainwatch.rundir.run_dir import RunDir

BOOTS = {"gpu-a": "boot-of-gpu-a", "gpu-b": "boot-of-gpu-b"}


def _ranks_up(run: RunDir, node: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ranks `trainwatch_rank_up` names in the view of node ``node``'s agent: its name
    from TRAINWATCH_NODE, as a deployed agent's, its boot that machine's."""
    monkeypatch.setenv(NODE_ENV, node)
    monkeypatch.setattr("trainwatch.agent.collectors.ranks.boot_id", lambda: BOOTS[node])
    ctx = AgentContext(load_config(None, run_dirs=[str(run.root)]))
    assert ctx.node == node
    result = collector(ctx, "ranks").collect()
    return sorted(dict(labels)["rank"] for labels in samples(result, "trainwatch_rank_up"))


@pytest.mark.parametrize("nnodes", [1, None])  # run.json says one node, or says nothing
def test_a_one_node_jobs_ranks_are_counted_by_its_nodes_agent_only(tmp_path, monkeypatch,
                                                                   nnodes):
    run = RunDir(tmp_path / "shared" / "exp").create()
    run.write_run_info({"job": "exp", "world_size": 2,
                        **({"nnodes": nnodes} if nnodes else {})})
    for rank in (0, 1):  # pids of the test: alive here, as on gpu-a
        write_status(run, rank, os.getpid(), node="gpu-a", boot=BOOTS["gpu-a"])
    assert _ranks_up(run, "gpu-a", monkeypatch) == ["0", "1"]
    assert _ranks_up(run, "gpu-b", monkeypatch) == []


def test_a_status_that_names_no_node_keeps_the_jobs_shape_rule(tmp_path, monkeypatch):
    """Statuses of an older writer carry no node: a one-node job is all ours, as before."""
    run = RunDir(tmp_path / "exp").create()
    for rank in (0, 1):
        write_status(run, rank, os.getpid(), node=None)
    assert _ranks_up(run, "gpu-b", monkeypatch) == ["0", "1"]
    run.write_run_info({"job": "exp", "world_size": 4, "nnodes": 2})
    assert _ranks_up(run, "gpu-b", monkeypatch) == []
