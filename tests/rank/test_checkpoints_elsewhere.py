"""A run whose checkpoints live outside its run directory (``checkpoint.dir`` on another
disk) is seen where it is: by ``diagnose``, ``trainwatch checkpoint list RUN_DIR`` and the
agent (storage of the checkpoint folder, checkpoint age). One real run, held at a step by
the ``hang`` fault so that it is still running while it is looked at."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_helpers import get_json, http_get, start_agent, stop_process, wait_for
from conftest import TRAIN, kill_tree
from trainwatch.contract.env import FAULT_ENV
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow

AGENT_CONFIG = """
collectors:
  ranks: {interval: 0.5}
  findings: {interval: 0.5}
  storage: {interval: 1, probe: false}
  gpu: {enabled: false}
  nccl: {enabled: false}
  network: {enabled: false}
  versions: {enabled: false}
"""


@pytest.fixture(scope="module")
def held_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("elsewhere")
    run_dir, folder = base / "run", base / "other-disk" / "checkpoints"
    log = open(base / "train.log", "wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1", FAULT_ENV: "hang:rank=0:step=12"}
    proc = subprocess.Popen(
        [*TRAIN, "--nproc-per-node", "1", "--run-dir", str(run_dir), "--max-restarts", "0",
         "--steps", "1000", "--set", f"checkpoint.dir={folder}",
         "--set", "checkpoint.every_steps=5", "--set", "telemetry.heartbeat_interval=0.2"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: len(list(folder.glob("step-*/manifest.json"))) >= 2, 180,
                 what="two checkpoints in the outside folder")
        yield run_dir, folder, base
    finally:
        kill_tree(proc)
        log.close()


def test_the_run_records_where_its_checkpoints_are(held_run):
    run_dir, folder, _ = held_run
    assert RunDir(run_dir).checkpoint_folders() == [folder.resolve()]
    assert not (run_dir / "checkpoints" / "step-00000005").exists()


def test_checkpoint_list_of_the_run_directory_finds_them(held_run):
    run_dir, folder, _ = held_run
    out = subprocess.run([sys.executable, "-m", "trainwatch", "checkpoint", "list", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    listed = [Path(e["path"]) for e in json.loads(out.stdout) if e["state"] == "complete"]
    assert len(listed) >= 2 and all(p.parent == folder.resolve() for p in listed), listed


def test_diagnose_finds_the_newest_checkpoint_there(held_run):
    run_dir, folder, _ = held_run
    out = subprocess.run([sys.executable, "-m", "trainwatch", "diagnose", str(run_dir),
                          "--json", "--no-dump-request", "--timeout", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr
    checkpoints = json.loads(out.stdout)["evidence"]["checkpoints"]
    assert checkpoints["newest"]["source"] == "manifest"
    assert Path(checkpoints["newest"]["path"]).parent == folder.resolve()
    assert checkpoints["dirs"] == [str(folder.resolve())]


def test_the_agent_watches_the_folder_and_reports_the_checkpoint_age(held_run):
    run_dir, folder, base = held_run
    config = base / "agent.yaml"
    config.write_text(AGENT_CONFIG)
    proc, url = start_agent(base, "--run-dir", str(run_dir), config=config)
    try:
        def storage_paths():
            storage = get_json(url + "/status")["node_health"].get("storage") or []
            return {e["path"]: e["role"] for e in storage}
        paths = wait_for(lambda: str(folder.resolve()) in storage_paths() and storage_paths(),
                         60, what="the agent's storage entry for the outside folder")
        assert paths[str(folder.resolve())] == "checkpoint"

        def age():
            for line in http_get(url + "/metrics").decode().splitlines():
                if line.startswith("trainwatch_checkpoint_age_seconds{"):
                    return float(line.rsplit(" ", 1)[1])
            return None
        seconds = wait_for(lambda: age() is not None and age() + 1, 60,
                           what="trainwatch_checkpoint_age_seconds") - 1
        newest = max(json.loads(p.read_text())["created_at"]
                     for p in folder.glob("step-*/manifest.json"))
        # The age counts from the newest save there (not from the run's start).
        assert seconds < time.time() - newest + 5
    finally:
        stop_process(proc)
