"""A run directory copied elsewhere (to keep, to share, to inspect) is its own: the paths
run.json records inside it resolve inside the copy, so `checkpoint verify COPY` checks the
copy's files, and a corrupted copy fails even while the original is intact."""

import json
import shutil
import subprocess
import sys

import pytest

from conftest import TRAIN, torchrun_env
from trainwatch.contract.layout import CHECKPOINT_DIRS_KEY
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow


def _verify(run_dir):
    return subprocess.run([sys.executable, "-m", "trainwatch", "checkpoint", "verify",
                           str(run_dir)], capture_output=True, text=True, timeout=120)


def test_verify_of_a_corrupted_copy_fails_and_names_the_copy(tmp_path):
    original, copy = tmp_path / "run", tmp_path / "copy"
    done = subprocess.run([*TRAIN, "--nproc-per-node", "1", "--run-dir", str(original),
                           "--steps", "10", "--max-restarts", "0",
                           "--set", "checkpoint.every_steps=5", "--set", "checkpoint.fsync=false"],
                          env=torchrun_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((original / "run.json").read_text())[CHECKPOINT_DIRS_KEY] == ["checkpoints"]
    shutil.copytree(original, copy)
    newest = sorted((copy / "checkpoints").glob("step-*"))[-1]
    victim = max((p for p in newest.iterdir() if p.name != "manifest.json"),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    bad = _verify(copy)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"BAD {newest.resolve()}" in bad.stdout or f"BAD {newest}" in bad.stdout, bad.stdout
    assert str(original) + "/" not in bad.stdout
    good = _verify(original)
    assert good.returncode == 0, good.stdout + good.stderr


def test_checkpoint_folders_are_recorded_relative_inside_and_absolute_outside(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    elsewhere = tmp_path / "other-disk" / "ckpt"
    run.record_checkpoint_folders([run.checkpoint_dir, elsewhere])
    assert run.run_info()[CHECKPOINT_DIRS_KEY] == ["checkpoints", str(elsewhere.resolve())]
    shutil.copytree(run.root, tmp_path / "copy")
    assert RunDir(tmp_path / "copy").checkpoint_folders() == [
        tmp_path / "copy" / "checkpoints", elsewhere.resolve()]
