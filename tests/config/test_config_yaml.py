"""Hostile YAML in a config file: exit 2 naming the file and line, in bounded time and memory."""

import resource
import subprocess
import sys

import pytest

from agent_helpers import REPO

LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


def _limited() -> None:  # a bomb must fail fast with our message, not by exhausting memory
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _check(tmp_path, args: list[str], text: str) -> tuple[object, subprocess.CompletedProcess]:
    """``trainwatch ARGS config.yaml`` (holding ``text``) with what else the command needs."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    other = (["--run-dir", str(tmp_path)] if args[0] == "agent"
             else ["--rules", str(REPO / "trainwatch/alerts/rules.yaml")])
    return path, subprocess.run([sys.executable, "-m", "trainwatch", *args, str(path), *other],
                                capture_output=True, text=True, timeout=120, cwd=REPO,
                                preexec_fn=_limited)


@pytest.mark.parametrize("args, text, line, problem", [
    (["agent", "--check-config", "--config"], LAUGHS, 6, "aliases expand to more than"),
    (["alerts", "check", "--thresholds"], LAUGHS, 6, "aliases expand to more than"),
    (["agent", "--check-config", "--config"], "a: &a [1, *a]\n", 1,
     "an alias refers to its own node"),
    # PyYAML keeps the last of two equal keys: the first stall section would be dropped.
    (["agent", "--check-config", "--config"],
     "stall:\n  floor_seconds: 30\ncollectors: {}\nstall:\n  k: 20\n", 4,
     "duplicate key 'stall'"),
])
def test_hostile_yaml_exits_2_naming_file_and_line(tmp_path, args, text, line, problem):
    path, done = _check(tmp_path, args, text)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{path}:{line}: invalid YAML: {problem}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, text, line, key, problem", [
    # math.isfinite raised OverflowError on an int past a float's range: a traceback
    (["agent", "--check-config", "--config"], "stall:\n  floor_seconds: 1" + "0" * 400 + "\n",
     2, "stall.floor_seconds", "must be a finite number, got an integer of 401 digits"),
    (["alerts", "check", "--thresholds"], "checkpoint_max_age_seconds: 1" + "0" * 400 + "\n",
     1, "checkpoint_max_age_seconds", "must be a finite number, got an integer of 401 digits"),
    # validated, then 'Python int too large to convert to C ssize_t' in the ranks collector
    # every second (the agent blind to its ranks), or a read of 10**18 bytes
    (["agent", "--check-config", "--config"],
     "collectors:\n  ranks:\n    max_skipped_shown: 1" + "0" * 30 + "\n", 3,
     "collectors.ranks.max_skipped_shown", "must be between 0 and 2,147,483,647, got an "
     "integer of 31 digits"),
    (["agent", "--check-config", "--config"],
     "collectors:\n  journal:\n    max_bytes_per_run: 1000000000000000000\n", 3,
     "collectors.journal.max_bytes_per_run", "must be between 0 and 2,147,483,647"),
])
def test_huge_numbers_exit_2_naming_file_key_and_line(tmp_path, args, text, line, key, problem):
    path, done = _check(tmp_path, args, text)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{path}:{line}, key '{key}': {problem}" in done.stderr
