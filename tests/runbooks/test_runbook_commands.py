"""Every shell command of every runbook, run against a real run directory of its situation.

A runbook is read at 3 a.m. by someone who pastes its commands: each must run, and print
something. Two real runs stand for the situations: *recovered* (rank 1 died, the controller
restarted the job from its checkpoint, mirror copies failed, the run finished) and
*stalled* (rank 1 hangs, its agent runs, TrainingStalled fires; actions held). A command
fails the test when it exits non-zero (``trainwatch diagnose`` and ``checkpoint verify`` may
answer 1, "a problem was found"), writes to stderr, or prints nothing (a grep or glob that
matches nothing). Commands that need hardware this machine lacks (a GPU, an InfiniBand
HCA, the agent's systemd unit) are listed as not run; CI fails if a tool it can install
is missing. Identical commands run once per situation, in runbook order.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, kill_tree, torchrun_env
from trainwatch import runbooks
from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # fixtures start real runs

SITUATION = {
    "recovered": ["TrainingRankDown", "TrainingReplicaDivergence",
                  "TrainingReductionChecksumMismatch", "TrainingRestartLoop", "TrainingStartupFailed",
                  "TrainingLossNonFinite", "TrainingLossNotDecreasing", "TrainingLossSpike",
                  "TrainingThroughputDrop", "CheckpointFailed", "CheckpointFailedRepeatedly",
                  "CheckpointTooOld",
                  "StorageFillingUp", "StorageFull", "StorageProbeSlow", "NCCLErrors"],
    "stalled": ["TrainingStallSuspected", "TrainingStalled", "NCCLPeerUnresponsive", "TrainingStragglerRank",
                "TrainingStragglerNode", "TrainwatchAgentDown", "TrainwatchCollectorFailing",
                "TrainwatchVersionSkew", "GPUXidErrors", "GPUUncorrectableECC",
                "GPUThermalThrottling", "GPUPowerThrottling", "NetworkInterfaceErrors",
                "NetworkLinkFlapping", "TrainwatchRunUnreadable", "TrainwatchCannotPublish",
                "TrainwatchSupervisorDown", "TrainingRanksMissing", "TrainwatchJournalUnreliable",
                "TrainingNetworkLinkSlow"],
}
# Sections whose commands act on a job that is not running (they restart it).
STOPPED_JOB_SECTIONS = ("Restart by hand",)
ANSWERS_1 = ("trainwatch diagnose", "trainwatch checkpoint verify")
SILENT = ("touch ", "chgrp ", "find ")  # act, print nothing by design


def _systemd_unit() -> bool:
    return subprocess.run(["systemctl", "cat", "trainwatch-agent"], capture_output=True
                          ).returncode == 0 if shutil.which("systemctl") else False


# What a command needs that this machine may lack: (pattern, available?, why).
NEEDS = [
    (r"\bnvidia-smi\b", lambda: shutil.which("nvidia-smi") is not None, "an NVIDIA GPU"),
    (r"\b(ibstat|perfquery)\b", lambda: Path("/sys/class/infiniband").is_dir(),
     "an InfiniBand HCA"),
    (r"-u trainwatch-agent|status trainwatch-agent", _systemd_unit,
     "the agent's systemd unit (deploy/systemd)"),
    (r"\b(id|chgrp -R) trainwatch\b", lambda: subprocess.run(
        ["getent", "group", "trainwatch"], capture_output=True).returncode == 0,
     "the trainwatch user and group (docs/run-directory.md, Permissions)"),
]
# Tools CI installs (.ci/run): missing there is a failure, not a skip.
CI_TOOLS = ("ethtool", "curl", "dmesg", "top", "ip", "py-spy", "getfacl")


def commands(name: str) -> list[tuple[str, str]]:
    """(section, command) for every shell line of a runbook, comments and blanks dropped."""
    out, section = [], ""
    text = runbooks.text(name)
    for block in re.finditer(r"^## ([^\n]+)$|^```(?:sh|bash)\n(.*?)^```", text, re.M | re.S):
        if block.group(1):
            section = block.group(1).strip()
            continue
        for line in block.group(2).splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append((section, line.strip()))
    return out


def test_every_runbook_has_a_situation():
    mapped = {n for names in SITUATION.values() for n in names}
    assert mapped == set(runbooks.names())
    for name in runbooks.names():
        assert commands(name), f"{name} has no shell command"


def _mountpoint(path: Path) -> str:
    return subprocess.run(["df", "--output=target", str(path)], capture_output=True,
                          text=True, check=True).stdout.splitlines()[-1].strip()


def _default_device() -> str:
    route = subprocess.run(["ip", "route", "show", "default"], capture_output=True,
                           text=True).stdout.split()
    return route[route.index("dev") + 1] if "dev" in route else "lo"


@pytest.fixture(scope="module")
def stalled_run(tmp_path_factory):
    """A live `trainwatch run` whose rank 1 hangs at step 5; TrainingStalled has fired and
    actions are held (control/hold-actions), so the stall stays for the commands."""
    tmp = tmp_path_factory.mktemp("stalled")
    (tmp / "train.yaml").write_text("train: {steps: 400, batch_size: 4, eval_interval: 1000}\n"
                                    "checkpoint: {every_steps: 2, fsync: false}\n")
    (tmp / "thresholds.yaml").write_text("evaluation_interval: 1s\nstall_for: 2s\n")
    (tmp / "agent.yaml").write_text("stall: {floor_seconds: 3, k: 10, first_step_seconds: 300}\n"
                                    "collectors:\n  ranks: {interval: 0.5}\n")
    run = RunDir(tmp / "exp")
    run.control_dir.mkdir(parents=True)
    (run.control_dir / "hold-actions").touch()
    log = tmp / "run.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "run", "--nproc-per-node", "2", "--run-dir",
         str(run.root), "--config", str(tmp / "train.yaml"), "--thresholds",
         str(tmp / "thresholds.yaml"), "--agent-config", str(tmp / "agent.yaml"), "--no-live"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        env=torchrun_env(tmp, TRAINWATCH_FAULT="hang:rank=1:step=5"))
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if any(e.get("alert") == "TrainingStalled" for e in run.events("alert_firing")):
                break
            time.sleep(0.5)
        else:
            pytest.fail("TrainingStalled did not fire: " + log.read_text()[-3000:])
        port = re.search(r"agent http://127\.0\.0\.1:(\d+)", log.read_text()).group(1)
        pids = {s["rank"]: s["pid"] for s in run.statuses().records}
        yield run.root, {"<pid>": str(pids[1]), "<instance>": f"127.0.0.1:{port}",
                         "<agent-port>": port}, (proc, log)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pass
        kill_tree(proc)


@pytest.fixture(scope="module")
def situations(recovered_run, stalled_run):
    recovered, options = recovered_run
    stalled, live, _ = stalled_run
    common = {"<rank>": "1", "<local-rank>": "1", "<nproc>": "2", "<collector>": "ranks",
              "<device>": _default_device()}
    return {
        "recovered": (recovered, {**common, "<job>": recovered.name, "<run>": recovered.name,
                                  "<mountpoint>": _mountpoint(recovered),
                                  "<options>": " ".join(options)}),
        "stalled": (stalled, {**common, **live, "<job>": stalled.name, "<run>": stalled.name,
                              "<mountpoint>": _mountpoint(stalled)}),
    }


_results: dict[tuple[str, str], tuple[str | None, str]] = {}


def _run(command: str, run_dir: Path, cwd: Path) -> tuple[str | None, str]:
    """(None, output) if the command did its job, else (what went wrong, output)."""
    env = {**os.environ, "RUN_DIR": str(run_dir),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    try:
        done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return "timed out after 180 s", ""
    out, err = done.stdout, done.stderr
    shown = f"stdout: {out[-1500:]}\nstderr: {err[-1500:]}"
    allowed = (0, 1) if command.startswith(ANSWERS_1) else (0,)
    if done.returncode not in allowed:
        return f"exit code {done.returncode}", shown
    if command.startswith("time "):  # bash's time and dd report on stderr
        out, err = err, ""
    if err.strip() and not command.startswith("trainwatch "):
        return "wrote to stderr", shown
    if not out.strip() and not command.startswith(SILENT):
        return "printed nothing (matched nothing?)", shown
    return None, shown


@pytest.mark.parametrize("name", sorted(n for names in SITUATION.values() for n in names))
def test_runbook_commands_run_in_their_situation(name, situations, tmp_path):
    kind = next(k for k, names in SITUATION.items() if name in names)
    failures, ran, not_run = [], 0, []
    for section, command in commands(name):
        where = "recovered" if section in STOPPED_JOB_SECTIONS else kind
        run_dir, values = situations[where]
        for key, value in values.items():
            command = command.replace(key, value)
        assert not re.search(r"<[a-z-]+>", command.split("#")[0]), f"unfilled: {command}"
        need = next((why for pattern, ok, why in NEEDS if re.search(pattern, command)
                     and not ok()), None)
        if need:
            not_run.append(f"{command}  (needs {need})")
            continue
        tool = command.split()[0]
        if tool in CI_TOOLS and shutil.which(tool, path=f"{Path(sys.executable).parent}:"
                                                        f"{os.environ['PATH']}") is None:
            if os.environ.get("CI"):
                failures.append(f"{command}: {tool} is not installed (.ci/run installs it)")
            else:
                not_run.append(f"{command}  (needs {tool})")
            continue
        key = (where, command)
        if key not in _results:
            _results[key] = _run(command, run_dir, tmp_path)
        problem, output = _results[key]
        ran += 1
        if problem:
            failures.append(f"[{where}] {command}\n  {problem}\n  {output}")
    if not_run:
        print(f"{name}: not run here:\n  " + "\n  ".join(not_run))
    assert not failures, "\n\n".join(failures)
    assert ran, f"no command of {name} could run here"


def test_runbook_renders_formatted_on_a_terminal_and_raw_when_asked():
    if shutil.which("script") is None:
        pytest.skip("needs script(1) for a terminal")
    cmd = f"{sys.executable} -m trainwatch runbook TrainingRankDown"
    tty = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True,
                         text=True, timeout=60, cwd=REPO,
                         env={**os.environ, "COLUMNS": "100", "TERM": "xterm"})
    assert tty.returncode == 0
    assert "## Diagnosis" not in tty.stdout and "Diagnosis" in tty.stdout   # rendered
    assert "\x1b[" in tty.stdout                                           # formatted
    raw = subprocess.run(["script", "-qec", cmd + " --raw", "/dev/null"], capture_output=True,
                         text=True, timeout=60, cwd=REPO, env={**os.environ, "TERM": "xterm"})
    assert "## Diagnosis" in raw.stdout
    piped = subprocess.run([sys.executable, "-m", "trainwatch", "runbook", "TrainingRankDown"],
                           capture_output=True, text=True, timeout=60)
    assert piped.stdout == runbooks.text("TrainingRankDown")


def test_ctrl_c_ends_the_stalled_run_with_a_summary_naming_its_checkpoint(stalled_run):
    """Last in this module: it stops the stalled run the runbook tests used."""
    run_dir, _, (proc, log) = stalled_run
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    out = log.read_text()
    assert f"trainwatch run interrupted: {run_dir}" in out
    assert re.search(r"checkpoints +│ \d+, newest at step \d+ \((saved on stop: )?the same "
                     r"command resumes from it\)", out), out[-2000:]
    assert f"trainwatch diagnose {run_dir}" in out
