"""A newcomer follows the README top to bottom from a fresh clone, each command in a new
login shell with no virtual environment active: `bash scripts/demo.sh` sets up `.venv` and
trains, ending with a summary (steps, final loss, goodput, the agent's address) and the
next commands; each runs as printed (the text report says where the time went, in box
drawing; the HTML page is written); the README's longer demo (`TRAINWATCH_DEMO_STEPS=...`)
works after the first; the first demo run again says it is complete and journals nothing.

The clone's `.venv` is the script's own (python -m venv, pip install -e .); only torch and
the other dependencies are seeded from the environment running the tests (a .pth line), so
the test does not unpack a torch wheel. The longer demo runs fewer steps than the README's
figure (the same script path: any length other than the default)."""

import re
import subprocess
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO, clone_checkout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

README = (REPO / "README.md").read_text()
LONGER = re.compile(r"`TRAINWATCH_DEMO_STEPS=(\d+) bash scripts/demo\.sh`")


def _two_commands() -> list[str]:
    """The shell lines of the README's "Two commands" section, in order."""
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def _fresh_shell(command: str, cwd: Path, home: Path, timeout: float = 600):
    """`bash -lc COMMAND` as a new login shell gets it: the system's PATH, no venv."""
    env = {"HOME": str(home), "TERM": "dumb", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
           "TMPDIR": str(home / "tmp"), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    return subprocess.run(["bash", "-lc", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _next_commands(stdout: str) -> list[str]:
    lines = stdout.split("\nnext:\n", 1)[1].splitlines()
    return [line.split("   # ", 1)[0].strip() for line in lines if line.startswith("  ")]


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory):
    base = tmp_path_factory.mktemp("readme")
    home, clone = base / "home", base / "trainwatch"
    (home / "tmp").mkdir(parents=True)
    clone_checkout(clone)
    python3 = _fresh_shell("command -v python3", clone, home).stdout.strip()
    if not python3:
        pytest.skip("no python3 in a login shell")
    subprocess.run([python3, "-m", "venv", str(clone / ".venv")], check=True, timeout=120)
    site = subprocess.run([str(clone / ".venv/bin/python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "zz-seeded-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return clone, home


def test_the_readme_top_to_bottom_in_fresh_shells(newcomer):
    clone, home = newcomer
    lines = _two_commands()
    assert lines[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"]  # then installs
    first = _fresh_shell("bash scripts/demo.sh --no-live", clone, home, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = first.stdout
    assert "trainwatch run finished: runs/demo" in out
    assert "300 of 300" in out and "final loss" in out and "goodput" in out
    assert "agent http://127.0.0.1:" in out                       # where the agent listens
    assert "step " in out                                          # progress lines (--no-live)
    printed = _next_commands(out)
    assert any(c.endswith("report runs/demo") for c in printed), printed
    assert any(c.endswith("report runs/demo --html report.html") for c in printed), printed
    said = {}
    for command in printed:               # as printed, each in a new shell: no exit 127
        done = _fresh_shell(command, clone, home, timeout=300)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        said[command] = done.stdout
    report = next(text for c, text in said.items() if c.endswith("report runs/demo"))
    assert "Where the time went" in report and "productive steps" in report, report
    assert "─" in report and "+---" not in report                  # box drawing, not ASCII
    assert (clone / "report.html").stat().st_size > 0

    m = LONGER.search(README)
    assert m, "the README names the longer demo as `TRAINWATCH_DEMO_STEPS=N bash scripts/demo.sh`"
    longer = _fresh_shell("TRAINWATCH_DEMO_STEPS=40 bash scripts/demo.sh --no-live", clone, home)
    assert longer.returncode == 0, longer.stdout[-3000:] + longer.stderr[-3000:]
    assert "40 of 40" in longer.stdout
    for command in _next_commands(longer.stdout)[:1]:
        done = _fresh_shell(command, clone, home, timeout=300)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])

    journal = (clone / "runs/demo/journal.jsonl").read_bytes()
    again = _fresh_shell("bash scripts/demo.sh --no-live", clone, home)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "Already complete — nothing to do" in again.stdout
    assert "report runs/demo" in again.stdout
    # Nothing started, nothing journaled: report counts no fake downtime.
    assert (clone / "runs/demo/journal.jsonl").read_bytes() == journal


def test_printed_program_is_the_one_that_ran(tmp_path, monkeypatch):
    """On PATH as this very program: its name; else the path it was run by."""
    from trainwatch.invocation import program

    monkeypatch.chdir(tmp_path)
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    script = venv_bin / "trainwatch"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert program(str(script)) == ".venv/bin/trainwatch"
    monkeypatch.setenv("PATH", f"{venv_bin}:/usr/bin:/bin")
    assert program(str(script)) == "trainwatch"
    assert program(str(REPO / "trainwatch" / "__main__.py")).endswith(" -m trainwatch")
