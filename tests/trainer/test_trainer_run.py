"""`trainwatch train` end to end: real torchrun, gloo, two ranks, restarts and signals."""

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import TRAIN, finish, kill_tree, start_train
from trainwatch.rundir.run_dir import RunDir
from trainwatch.trainer.data import load_dataset, prepare_generated

# The finished run's options but its length: a longer run of them is another experiment.
FINISHED_OPTIONS = ("--nproc-per-node", "2", "--set", "train.eval_interval=40",
                    "--set", "telemetry.heartbeat_interval=0.2")


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    """Two real 2-rank runs at once (each mostly waits: start-up, rendezvous, a restart):
    "finished", 80 steps to their end, shared (the contract test reads it, the
    refused-resume tests start a longer run in a copy of its directory); "restarted", whose
    rank 1 exits in step 5, on a dataset prepared beforehand (data.path) with gradient
    accumulation under DDP. {name: (folder, run directory, exit code, output)}."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("finished", "restarted")}
    prepare_generated(folders["restarted"] / "data", size_bytes=200_000, seed=5,
                      val_fraction=0.1)
    procs = {"finished": start_train("--run-dir", str(folders["finished"] / "run"),
                                     "--steps", "80", *FINISHED_OPTIONS),
             "restarted": start_train(
                 "--nproc-per-node", "2", "--run-dir", str(folders["restarted"] / "run"),
                 "--steps", "20", "--max-restarts", "1", "--set", "optim.grad_accum=2",
                 "--set", f"data.path={folders['restarted'] / 'data'}",
                 env={"TRAINWATCH_FAULT": "exit:rank=1:step=5:code=3"})}
    pool = ThreadPoolExecutor(len(procs))  # both outputs drained at once
    try:
        done = {name: pool.submit(finish, proc) for name, proc in procs.items()}
        return {name: (folders[name], folders[name] / "run", *result.result())
                for name, result in done.items()}
    finally:
        pool.shutdown(wait=False)
        for proc in procs.values():
            kill_tree(proc)


@pytest.fixture(scope="module")
def finished_run(side_by_side):
    _, run_dir, code, out = side_by_side["finished"]
    return run_dir, code, out


@pytest.mark.slow
def test_two_ranks_train_to_completion_and_publish_the_contract(finished_run):
    run_dir, code, out = finished_run
    assert code == 0, out[-4000:]
    run = RunDir(run_dir)
    info = run.run_info()
    assert info["world_size"] == 2 and info["config"]["train"]["steps"] == 80
    statuses = run.statuses()
    assert statuses.skipped == [] and sorted(s["rank"] for s in statuses.records) == [0, 1]
    for status in statuses.records:
        assert status["state"] == "finished" and status["step"] == 79
        assert status["backend"] == "gloo" and status["restart_count"] == 0
        assert status["counters"]["steps_total"] == 80
        assert status["counters"]["telemetry_errors_total"] == 0
        assert status["info"]["flops_per_token"] > 0
        assert math.isfinite(status["eval"]["val_loss"])
    norms = {}
    for rank in (0, 1):
        records = run.metrics(rank)
        assert records.skipped == []
        steps = [r for r in records.records if r["kind"] == "step"]
        assert [r["step"] for r in steps] == list(range(80))
        assert {"data", "forward", "backward", "optimizer"} <= set(steps[0]["phase_seconds"])
        assert all(r["tokens"] == 8 * 64 and r["grad_norm"] > 0 for r in steps)
        first = sum(r["loss"] for r in steps[:5]) / 5
        last = sum(r["loss"] for r in steps[-5:]) / 5
        assert last < first - 1.0, (first, last)  # ln(256) = 5.5 -> clearly learning
        norms[rank] = [r["grad_norm"] for r in steps]
    # DDP all-reduces gradients: both ranks see the same global norm at every step.
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)
    events = [e["event"] for e in run.events()]
    for name in ("launcher_started", "run_started", "validation", "step_milestone", "finished",
                 "launcher_exited"):
        assert name in events, name
    assert "restarted" not in events and "failed" not in events
    assert run.events("launcher_exited")[0]["exit_code"] == 0
    (finished,) = run.events("finished")  # with rank 0's last training loss
    rank0 = [r for r in run.metrics(0).records if r["kind"] == "step"]
    assert finished["loss"] == pytest.approx(rank0[-1]["loss"], rel=1e-5)
    vals = [e["val_loss"] for e in run.events("validation")]
    assert len(vals) == 2 and vals[1] < vals[0]
    assert (run_dir / "data" / "manifest.json").exists()
    assert (run.logs_dir / "torchrun.log").stat().st_size > 0
    assert list((run.logs_dir / "torchrun").rglob("stdout.log"))


@pytest.mark.slow
def test_a_rank_that_dies_is_restarted_and_training_finishes(side_by_side):
    """Also: a dataset prepared beforehand (data.path) and gradient accumulation under DDP."""
    tmp_path, run_dir, code, out = side_by_side["restarted"]
    assert code == 0, out[-4000:]
    run = RunDir(run_dir)
    injected = run.events("fault_injected")
    assert [(e["rank"], e["step"], e["fault"]) for e in injected] == [(1, 5, "exit")]
    restarted = run.events("restarted")
    assert len(restarted) == 1 and restarted[0]["restart_count"] == 1
    assert {e["rank"]: e["restart_count"] for e in run.events("rank_started")
            if e["restart_count"] == 1} == {0: 1, 1: 1}
    for status in run.statuses().records:
        assert status["restart_count"] == 1 and status["state"] == "finished"
        assert status["step"] == 19
        assert status["metrics"]["tokens"] == 2 * 8 * 64  # two micro-batches per step
        assert status["info"]["dataset_sha256"] == load_dataset(tmp_path / "data").manifest[
            "splits"]["train"]["sha256"]
    assert not (run_dir / "data").exists()  # the given dataset was used, nothing prepared
    assert run.events("finished") and run.events("launcher_exited")[0]["exit_code"] == 0


def free_port_pair():
    """A port P with P+1 also free (rank r serves P+r)."""
    for _ in range(20):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    pytest.fail("no free port pair")


@pytest.mark.slow
def test_sigterm_is_forwarded_and_every_rank_records_it(tmp_path, launch_train):
    """Also: with --metrics-port each rank serves its metrics while it trains."""
    run_dir = tmp_path / "run"
    port = free_port_pair()
    proc = launch_train("--nproc-per-node", "2", "--run-dir", str(run_dir), "--steps", "100000",
                  "--metrics-port", str(port), "--set", "telemetry.heartbeat_interval=0.2")
    run = RunDir(run_dir)
    deadline = time.time() + 120
    while time.time() < deadline:
        records = run.statuses().records
        if len(records) == 2 and all((r.get("step") or 0) >= 3 for r in records):
            break
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.2)
    else:
        pytest.fail("ranks never got going")
    for local_rank in (0, 1):
        url = f"http://127.0.0.1:{port + local_rank}/metrics"
        with urllib.request.urlopen(url, timeout=30) as resp:
            text = resp.read().decode()
        assert f'rank="{local_rank}"' in text and "trainwatch_rank_steps_total{" in text
    rank_pids = [r["pid"] for r in run.statuses().records]
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc, timeout=120)
    assert code == 128 + signal.SIGTERM, out[-4000:]
    exited = run.events("launcher_exited")[0]
    assert exited["exit_code"] == 143 and exited["signal"] == "SIGTERM"
    # Every rank saved its part of one checkpoint, then stopped (docs/checkpoints.md).
    for status in run.statuses().records:
        assert status["state"] == "stopped"
    assert [e["reason"] for e in run.events("checkpoint_saved")] == ["stop"]
    assert not run.events("failed")
    for pid in rank_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_bad_config_exits_2_before_starting_torchrun(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: fast\n")
    run_dir = tmp_path / "run"
    for args, words in (
        (["--config", str(bad)], [str(bad), "key 'optim.lr'", "must be float"]),
        (["--set", "model.widht=3"], ["--set", "key 'model.widht'", "unknown key"]),
        (["--set", f"data.path={tmp_path / 'nowhere'}"], ["nowhere", "manifest.json missing"]),
        (["--set", "parallel.mode=zero3"], ["key 'parallel.mode'", "must be ddp, fsdp or hsdp"]),
        (["--set", "parallel.mode=hsdp", "--set", "parallel.shard_size=3"],
         ["key 'parallel.shard_size'", "3 does not divide the world size 2"]),
    ):
        proc = subprocess.run([*TRAIN, "--nproc-per-node", "2", "--run-dir", str(run_dir), *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert all(w in proc.stderr for w in words), proc.stderr
        assert not (run_dir / "logs").exists()  # torchrun never started


@pytest.mark.slow
def test_two_nodes_rendezvous_through_c10d(tmp_path, launch_train):
    """Multi-node passthrough: two launchers (nodes) on loopback form one job of two ranks,
    sharing one run directory (both prepare the default corpus into it at once)."""
    run_dir = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port_pair()}"
    nodes = [launch_train("--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(node),
                    "--rdzv-endpoint", endpoint, "--run-dir", str(run_dir), "--steps", "10")
             for node in (0, 1)]
    for node in nodes:
        code, out = finish(node)
        assert code == 0, out[-4000:]
    run = RunDir(run_dir)
    statuses = run.statuses().records
    assert sorted(s["rank"] for s in statuses) == [0, 1]
    assert all(s["world_size"] == 2 and s["state"] == "finished" for s in statuses)
    assert len(run.events("launcher_started")) == 2 and run.run_info()["nnodes"] == 2
    assert len(run.events("run_started")) == 1 and run.events("finished")


def test_launcher_turns_the_flight_recorder_on_unless_the_user_set_it(tmp_path, monkeypatch):
    from trainwatch.trainer.launcher import LaunchSpec, torchrun_env

    run = RunDir(tmp_path / "run").create()
    spec = LaunchSpec(run_dir=run.root, nproc_per_node=2)
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    env = torchrun_env(spec, run)
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # a user's value wins, even "off"
    assert torchrun_env(spec, run)["TORCH_FR_BUFFER_SIZE"] == "0"


def test_launcher_multinode_command_hosts_on_node_zero_and_names_the_node(tmp_path,
                                                                        monkeypatch):
    """c10d ignores --node-rank; the launcher uses it to say which node hosts the
    rendezvous store (torchrun's hostname guess misses a secondary NIC's address), passes
    --local-addr (the MASTER_ADDR other nodes reach) and names the node for the ranks."""
    from trainwatch.errors import ConfigError
    from trainwatch.trainer.launcher import LaunchSpec, torchrun_command, torchrun_env, validate

    run = RunDir(tmp_path / "run").create()
    monkeypatch.delenv("TRAINWATCH_NODE", raising=False)
    commands = {}
    for node in (0, 1):
        spec = LaunchSpec(run_dir=run.root, nproc_per_node=1, nnodes=2, node_rank=node,
                          rdzv_endpoint="10.77.0.1:29400", local_addr=f"10.77.0.{node + 1}",
                          node_name=f"n{node}")
        commands[node] = torchrun_command(spec, run)
        assert torchrun_env(spec, run)["TRAINWATCH_NODE"] == f"n{node}"
        assert f"--local-addr=10.77.0.{node + 1}" in commands[node]
        assert not [a for a in commands[node] if a.startswith("--node-rank")]
    assert "--rdzv-conf=is_host=1" in commands[0] and "--rdzv-conf=is_host=0" in commands[1]
    # Without --node-rank torchrun keeps guessing; without --node-name the hostname is used.
    spec = LaunchSpec(run_dir=run.root, nproc_per_node=1, nnodes=2, rdzv_endpoint="h:1")
    assert not [a for a in torchrun_command(spec, run) if "is_host" in a or "local-addr" in a]
    assert torchrun_env(spec, run)["TRAINWATCH_NODE"] == socket.gethostname()
    for bad in ("", " n0"):
        with pytest.raises(ConfigError) as info:
            validate(LaunchSpec(run_dir=run.root, nproc_per_node=1, node_name=bad))
        assert info.value.key == "--node-name"



def test_min_nnodes_makes_the_rendezvous_elastic_and_refuses_a_world_it_cannot_go_on_with(
        tmp_path):
    """--min-nnodes M: torchrun --nnodes M:N (the others go on when a node is lost, grow
    back when it returns); refused before anything starts when a smaller world could not
    take the global batch, which would otherwise surface when a node is lost at 3 a.m."""
    from trainwatch.errors import ConfigError
    from trainwatch.trainer.launcher import LaunchSpec, torchrun_command, validate

    run = RunDir(tmp_path / "run").create()

    def spec(min_nnodes, batch=8):
        return LaunchSpec(run_dir=run.root, nproc_per_node=2, nnodes=3, min_nnodes=min_nnodes,
                          node_rank=0, rdzv_endpoint="h:1",
                          overrides=[f"train.batch_size={batch}"])

    assert "--nnodes=2:3" in torchrun_command(spec(2), run)
    assert "--nnodes=3" in torchrun_command(spec(3), run)
    assert "--nnodes=3" in torchrun_command(spec(None), run)
    validate(spec(1))  # 48 windows a step: 4 ranks take 12 each, 2 take 24
    validate(spec(3, batch=3))  # no smaller world
    with pytest.raises(ConfigError) as info:  # 18 windows: 4 ranks cannot share them
        validate(spec(2, batch=3))
    assert info.value.key == "--min-nnodes"
    assert "go on with 2 node(s), 4 ranks" in str(info.value)
    assert "4 ranks cannot share 18 evenly" in str(info.value)
    for bad in (0, 4):
        with pytest.raises(ConfigError, match="between 1 and --nnodes 3"):
            validate(spec(bad))

@pytest.mark.parametrize("hash_of, nproc, says, options", [
    ("another config", "1", "refusing to resume a different experiment", []),
    ("this config", "3", "3 ranks cannot share 16 evenly", []),  # 1 rank x 2 x batch 8
    ("this config", "1", "written by a data-parallel run (parallel.mode: ddp; a whole "
     "model.pt), this run is sharded", ["--set", "parallel.mode=fsdp"]),
])
def test_an_incompatible_checkpoint_is_refused_before_anything_starts(
        tmp_path, hash_of, nproc, says, options):
    """The ranks would refuse it (exit 2) and torchrun restart them for nothing, printing
    the reason once per rank and attempt under its own traceback."""
    import torch

    from trainwatch.rank.checkpoint import Checkpointer, CheckpointConfig
    from trainwatch.trainer.config import load_config

    run_dir = tmp_path / "run"
    digest = load_config(None, ["train.steps=5"]).training_digest()
    ckpt = Checkpointer(CheckpointConfig(mode="sync", fsync=False), run_dir,
                        config_hash=digest if hash_of == "this config" else "0123456789ab")
    ckpt.start()
    try:
        data = {"epoch": 0, "position": 6, "consumed": 48, "seed": 0, "world_size": 1,
                "batch_size": 8, "grad_accum": 2}
        ckpt.after_step(3, lambda: {"model": {"w": torch.zeros(2)}, "data": data}, final=True)
    finally:
        ckpt.close()
    done = subprocess.run([*TRAIN, "--run-dir", str(run_dir), "--nproc-per-node", nproc,
                           "--steps", "5", *options], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count(says) == 1 and "step-00000003" in done.stderr
    assert RunDir(run_dir).events("launcher_started") == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["train", "run"])
def test_a_refused_resume_says_what_changed_not_only_two_hashes(tmp_path, finished_run, how):
    """A longer run in the directory of a shorter one: the refusal names the key that
    changed (train.steps 80 -> 88) besides the checkpoint's and this config's hashes."""
    finished, code, out = finished_run
    assert code == 0, out[-4000:]
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)  # the shared run stays as it finished
    cmd = ([*TRAIN, "--run-dir", str(run_dir), "--steps", "88", *FINISHED_OPTIONS]
           if how == "train" else
           [sys.executable, "-m", "trainwatch", "run", str(run_dir), "--steps", "88",
            *FINISHED_OPTIONS, "--no-live"])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "refusing to resume a different experiment" in done.stderr
    assert "changed: train.steps 80 -> 88" in done.stderr, done.stderr
