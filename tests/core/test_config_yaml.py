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
    path = tmp_path / "config.yaml"
    path.write_text(text)
    done = subprocess.run([sys.executable, "-m", "trainwatch", *args, str(path),
                           "--run-dir" if args[0] == "agent" else "--rules",
                           str(tmp_path) if args[0] == "agent"
                           else str(REPO / "trainwatch/alerts/rules.yaml")],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          preexec_fn=_limited)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{path}:{line}: invalid YAML: {problem}" in done.stderr
    assert "Traceback" not in done.stderr
