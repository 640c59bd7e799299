"""`trainwatch run` rejects bad input before it starts anything.

Exit 2 with this launch's own message (never an old line of logs/job.log), no agent,
engine or torchrun started (torch is not even imported), and the run directory exactly
as it was, so a rejected launch leaves nothing for `report` or `diagnose` to count.
"""

import os
import subprocess
import sys

import pytest

OLD_ERROR = "ERROR FROM AN EARLIER LAUNCH"


def _tree(root):
    """Every path under root with its size and mtime: what 'unchanged' means."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def used_run_dir(tmp_path):
    """A run directory an earlier launch left: a job log ending with an error, a journal."""
    run = tmp_path / "exp"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "job.log").write_text(f"step 3: loss 5.1\n{OLD_ERROR}\n")
    (run / "journal.jsonl").write_text('{"v":1,"time":1.0,"event":"run_started","source":"rank0"}\n')
    return run


def _run(tmp_path, run_dir, *args):
    (tmp_path / "bad.yaml").write_text("train:\n  steps: 5\n  stepz: 3\n")
    cmd = [sys.executable, "-X", "importtime", "-m", "trainwatch", "run", "--nproc-per-node",
           "2", "--run-dir", str(run_dir), "--no-live", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def _imported(stderr: str) -> set[str]:
    """Top-level module names from -X importtime's lines."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def _message(stderr: str) -> str:
    return "\n".join(ln for ln in stderr.splitlines() if not ln.startswith("import time:"))


@pytest.mark.parametrize("args, says, not_says", [
    (("--config", "missing.yaml"), "missing.yaml", None),
    (("--config", "bad.yaml"), "key 'train.stepz'", None),
    (("--set", "optim.lrr=1"), "key 'optim.lrr'", None),
    (("--set", "model.heads=3"), "key 'model.heads'", None),
    (("--steps", "-5"), "--steps", "train.steps"),
    (("--steps", "0"), "--steps", "train.steps"),
    (("--agent-config", "missing-agent.yaml"), "missing-agent.yaml", None),
    (("--nproc-per-node", "99999999999999999999"), "--nproc-per-node", None),
    (("--telemetry-grace", "-1"), "--telemetry-grace", None),
    (("--telemetry-grace", "nan"), "--telemetry-grace", None),
    (("--steps", "5", "--", "python", "job.py"),
     "--nproc-per-node, --steps configure the reference trainer; with a COMMAND", None),
])
def test_bad_input_exits_2_before_anything_starts(tmp_path, used_run_dir, args, says, not_says):
    before = _tree(used_run_dir)
    done = _run(tmp_path, used_run_dir, *args)
    message = _message(done.stderr)
    assert done.returncode == 2, done.stdout + message
    assert says in message
    if not_says:
        assert not_says not in message
    assert OLD_ERROR not in message + done.stdout      # only this launch's message
    assert "Traceback" not in message
    assert "torch" not in _imported(done.stderr)      # nothing heavy, nothing started
    assert _tree(used_run_dir) == before              # the run directory is untouched


def test_bad_input_to_a_new_run_dir_creates_nothing(tmp_path):
    run_dir = tmp_path / "new"
    done = _run(tmp_path, run_dir, "--set", "train.steps=abc")
    assert done.returncode == 2, _message(done.stderr)
    assert "key 'train.steps'" in _message(done.stderr)
    assert not run_dir.exists()


def test_a_missing_dataset_is_refused_before_anything_starts(tmp_path, used_run_dir):
    before = _tree(used_run_dir)
    done = _run(tmp_path, used_run_dir, "--set", f"data.path={tmp_path / 'no-data'}")
    assert done.returncode == 2, _message(done.stderr)
    assert "no-data" in _message(done.stderr) and "Traceback" not in done.stderr
    assert _tree(used_run_dir) == before


def test_train_names_steps_option_not_the_config_key(tmp_path):
    done = subprocess.run([sys.executable, "-m", "trainwatch", "train", "--run-dir",
                           str(tmp_path / "r"), "--steps", "-5"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--steps" in done.stderr and "train.steps" not in done.stderr


def test_a_journal_that_is_a_directory_is_refused_before_anything_starts(tmp_path,
                                                                          used_run_dir):
    """It used to fail after the agent had started, leaving the agent running."""
    (used_run_dir / "journal.jsonl").unlink()
    (used_run_dir / "journal.jsonl").mkdir()
    before = _tree(used_run_dir)
    done = _run(tmp_path, used_run_dir)
    message = _message(done.stderr)
    assert done.returncode == 2, done.stdout + message
    assert "journal.jsonl" in message and "not a regular file" in message
    assert "Traceback" not in message and "torch" not in _imported(done.stderr)
    assert _tree(used_run_dir) == before


def test_checkpoints_of_which_none_verifies_are_refused_not_trained_over(tmp_path,
                                                                          used_run_dir):
    """A real checkpoint with a truncated file: the ranks would pass it over and find no
    other; the launch must not start over from step 0 (exit 2, naming the folder)."""
    import torch

    from trainwatch.rank.checkpoint import CheckpointConfig, Checkpointer
    folder = used_run_dir / "checkpoints"
    model = torch.nn.Linear(8, 8)
    ckpt = Checkpointer(CheckpointConfig(dir=str(folder), mode="sync", every_steps=1,
                                         save_final=False, fsync=False),
                        used_run_dir).start()
    ckpt.after_step(1, lambda: {"model": model.state_dict(), "data": {"index": 1}})
    ckpt.close()
    shard = next(p for p in (folder / "step-00000001").iterdir() if p.suffix == ".pt")
    shard.write_bytes(shard.read_bytes()[:10])
    before = _tree(used_run_dir)
    done = _run(tmp_path, used_run_dir, "--nproc-per-node", "1")
    message = _message(done.stderr)
    assert done.returncode == 2, done.stdout + message
    assert "no checkpoint verifies" in message and str(folder) in message, message
    assert "Traceback" not in message
    assert _tree(used_run_dir) == before


def test_one_trainer_option_with_a_command_is_named_in_the_singular(tmp_path):
    done = subprocess.run([sys.executable, "-m", "trainwatch", "run", "--run-dir",
                           str(tmp_path / "r"), "--steps", "5", "--", "python", "job.py"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert "--steps configures the reference trainer" in done.stderr, done.stderr
