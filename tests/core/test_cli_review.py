"""What a first-time user meets at the command line: clear messages and exit 2 for bad
input, never a traceback (found by walking the README and every --help as a new user)."""

import socket
import os
import subprocess
import sys

import pytest

from conftest import all_commands, REPO

CLI = [sys.executable, "-m", "trainwatch"]


def tw(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, **(env or {})})


@pytest.fixture
def busy_port():
    """A real listening socket, so the port is taken for the command under test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _no_traceback(done: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in done.stderr, done.stderr


def test_agent_on_a_port_in_use_says_so_and_exits_2(tmp_path, busy_port):
    done = tw("agent", "--run-dir", str(tmp_path), "--listen", f"127.0.0.1:{busy_port}",
              timeout=30)
    _no_traceback(done)
    assert done.returncode == 2
    assert f"key '--listen': 127.0.0.1:{busy_port} is already in use" in done.stderr


def test_agent_port_in_use_from_its_config_names_the_file(tmp_path, busy_port):
    config = tmp_path / "agent.yaml"
    config.write_text(f"listen: 127.0.0.1:{busy_port}\n")
    done = tw("agent", "--run-dir", str(tmp_path), "--config", str(config), timeout=30)
    _no_traceback(done)
    assert done.returncode == 2
    assert f"{config}, key 'listen': 127.0.0.1:{busy_port} is already in use" in done.stderr


def test_receiver_on_a_port_in_use_says_so_and_exits_2(tmp_path, busy_port):
    done = tw("alerts", "receive", "--run-dir", str(tmp_path), "--listen",
              f"127.0.0.1:{busy_port}", env={"TRAINWATCH_RECEIVER_TOKEN": "s3cret-token"})
    _no_traceback(done)
    assert done.returncode == 2
    assert "already in use" in done.stderr and "--listen" in done.stderr


def test_run_with_a_bad_trainer_key_names_it_and_exits_2_before_starting(tmp_path):
    """`trainwatch run` checks the trainer's config itself, before it starts anything."""
    done = tw("run", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"), "--no-live",
              "--set", "optim.lrr=1e-3", timeout=120)
    _no_traceback(done)
    assert done.returncode == 2
    assert "--set, key 'optim.lrr': unknown key" in done.stderr
    assert not (tmp_path / "run").exists()


def test_run_with_a_bad_agent_config_exits_2_before_starting_anything(tmp_path):
    config = tmp_path / "agent.yaml"
    config.write_text("colectors: {}\n")
    done = tw("run", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"), "--no-live",
              "--agent-config", str(config))
    assert done.returncode == 2
    assert f"{config}:1, key 'colectors': unknown key" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, message", [
    ("tests:\n- alert_rule_test:\n  - eval_time: 5m\n",
     "key 'tests[0].alert_rule_test[0]': needs alertname"),
    ("tests: [1, 2]\n", "key 'tests[0]': must be a mapping"),
    ("stall_for: 1m\n", "key 'tests': must be a list of test groups"),
    ("tests:\n- alert_rule_test:\n  - {eval_time: 5x, alertname: TrainingStalled}\n",
     "key 'tests[0].alert_rule_test[0].eval_time': '5x' is not a duration"),
    ('tests:\n- input_series:\n  - {series: "foo{", values: "1x3"}\n'
     "  alert_rule_test:\n  - {eval_time: 5m, alertname: TrainingStalled}\n",
     "cannot parse series 'foo{'"),
    ("tests: []\n", "no alert_rule_test checks to replay"),
])
def test_alerts_test_names_file_and_key_of_a_malformed_test_file(tmp_path, text, message):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    done = tw("alerts", "test", str(path))
    _no_traceback(done)
    assert done.returncode == 2, done.stdout
    assert f"trainwatch: error: {path}" in done.stderr and message in done.stderr


def test_silence_in_a_mistyped_run_dir_is_refused_not_written(tmp_path):
    typo = tmp_path / "exp1-typo"
    done = tw("alerts", "silence", "add", "--run-dir", str(typo), "alertname=TrainingStalled")
    assert done.returncode == 2
    assert f"{typo}, key '--run-dir': no such run directory" in done.stderr
    assert not typo.exists()
    assert tw("alerts", "silence", "list", "--run-dir", str(typo)).returncode == 2
    listed = tw("alerts", "silence", "list", "--run-dir", str(tmp_path))
    assert listed.returncode == 0 and listed.stdout.strip() == "no active silences"



def test_every_command_and_option_has_help_text():
    import click
    missing = []
    for name, cmd in all_commands():
        if not cmd.help:
            missing.append(name)
        missing += [f"{name} {p.opts[0]}" for p in cmd.params
                    if isinstance(p, click.Option) and not p.hidden and not p.help]
    assert not missing


@pytest.mark.parametrize("command", [["diagnose"], ["report"], ["drill", "score"]])
def test_readers_take_the_run_dir_as_argument_or_option(tmp_path, command):
    """diagnose took only --run-dir, report and drill score only RUN_DIR: both now work."""
    alien = tmp_path / "not-a-run"
    alien.mkdir()
    as_arg = tw(*command, str(alien))
    as_opt = tw(*command, "--run-dir", str(alien))
    assert as_arg.returncode == as_opt.returncode == 2
    assert str(alien) in as_arg.stderr and as_arg.stderr == as_opt.stderr
    both = tw(*command, str(alien), "--run-dir", str(tmp_path))
    assert both.returncode == 2 and "two run directories given" in both.stderr
    assert "key 'RUN_DIR'" not in both.stderr


@pytest.mark.parametrize("command", [["checkpoint", "list"], ["checkpoint", "verify"]])
def test_checkpoint_takes_the_run_dir_as_argument_or_option(tmp_path, command):
    as_arg, as_opt = tw(*command, str(tmp_path)), tw(*command, "--run-dir", str(tmp_path))
    assert as_arg.returncode == as_opt.returncode
    assert as_arg.stdout + as_arg.stderr == as_opt.stdout + as_opt.stderr
    assert "no checkpoints in" in as_arg.stdout + as_arg.stderr
    both = tw(*command, str(tmp_path), "--run-dir", str(tmp_path / "other"))
    assert both.returncode == 2 and "two run directories given" in both.stderr


def test_checkpoint_list_reads_manifests_only_and_prints_human_sizes(tmp_path):
    """Listing is names and manifests: no torch import (it took seconds), sizes in KiB/MiB."""
    import json
    folder = tmp_path / "checkpoints" / "step-00000010"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"x" * 3 * 1024 * 1024)
    (folder / "manifest.json").write_text(json.dumps({
        "format": "trainwatch.checkpoint", "version": 1, "step": 10, "world_size": 2,
        "files": {"model.pt": {"bytes": 3 * 1024 * 1024, "sha256": "0" * 64}}}))
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "trainwatch", "checkpoint",
                           "list", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {ln.rsplit("|", 1)[1].strip().split(".")[0] for ln in done.stderr.splitlines()
                if ln.startswith("import time:") and "|" in ln}
    assert "torch" not in imported
    assert "step-00000010" in done.stdout and "3.0 MiB" in done.stdout


@pytest.mark.parametrize("command", [["train"], ["run"], ["agent", "--check-config"]])
def test_writers_take_the_run_dir_as_argument_or_option(tmp_path, command):
    """train, run and agent took only --run-dir; RUN_DIR works too."""
    run_dir = tmp_path / "exp"
    bad = ["--nproc-per-node", "0"] if command != ["agent", "--check-config"] else []
    as_arg = tw(*command, str(run_dir), *bad)
    as_opt = tw(*command, "--run-dir", str(run_dir), *bad)
    assert as_arg.returncode == as_opt.returncode
    assert as_arg.stdout == as_opt.stdout and as_arg.stderr == as_opt.stderr
    if bad:
        assert as_arg.returncode == 2 and "nproc" in as_arg.stderr, as_arg.stderr
    else:
        assert as_arg.returncode == 0 and str(run_dir) in as_arg.stdout


def test_report_without_a_run_dir_says_what_to_give():
    done = tw("report")
    assert done.returncode == 2 and "no run directory given: pass RUN_DIR" in done.stderr


def test_diagnose_names_the_default_it_fell_back_to(tmp_path):
    import os
    env = {k: v for k, v in os.environ.items() if k != "TRAINWATCH_RUN_DIR"}
    done = subprocess.run([*CLI, "diagnose"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=60)
    assert done.returncode == 2
    assert "trainwatch-run: no such run directory (the default: give RUN_DIR" in done.stderr


def test_diagnose_names_the_option_of_a_bad_url(tmp_path):
    (tmp_path / "status").mkdir()  # a (still empty) run directory
    done = tw("diagnose", str(tmp_path), "--prometheus", "localhost:9090")
    assert done.returncode == 2 and "key '--prometheus'" in done.stderr


@pytest.mark.parametrize("args, key", [
    (["dashboards", "export", "--out", "/proc/trainwatch-dashboards"], "--out"),
    (["alerts", "export", "-o", "/proc/trainwatch/rules.yaml"], "--output"),
    (["drill", "run", "rank-killed", "--out", "/proc/trainwatch-drills"], "--out"),
    (["diagnose", "--bundle", "/proc/evidence.tar.gz"], "--bundle"),
    (["diagnose", "--bundle", "/proc/no/evidence.tar.gz"], "--bundle"),
])
def test_an_output_path_that_cannot_be_written_is_exit_2_naming_it(tmp_path, args, key):
    """/proc takes no new files, not even from root (these tests run as root in CI)."""
    if args[0] == "diagnose":
        (tmp_path / "status").mkdir()
        args = [*args, "--run-dir", str(tmp_path), "--no-dump-request"]
    done = tw(*args)
    _no_traceback(done)
    assert done.returncode == 2
    assert f"key '{key}'" in done.stderr and "/proc/" in done.stderr


def test_checkpoint_digest_tells_no_checkpoints_from_none_that_verifies(tmp_path):
    """Both used to say "no checkpoint here verifies"; the empty folder is a wrong path."""
    empty = tw("checkpoint", "digest", str(tmp_path))
    assert empty.returncode == 2 and "no complete checkpoints here" in empty.stderr
    from trainwatch.rank.checkpoint import CheckpointConfig, Checkpointer
    ckpt = Checkpointer(CheckpointConfig(every_steps=1, mode="sync", fsync=False),
                        tmp_path, rank=0, world_size=1).start()
    ckpt.after_step(1, lambda: {"model": {"w": __import__("torch").ones(4)}})
    ckpt.close()
    weights = next((tmp_path / "checkpoints").glob("step-*/model.pt"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped: the sha256 no longer matches
    weights.write_bytes(bytes(data))
    bad = tw("checkpoint", "digest", str(tmp_path))
    assert bad.returncode == 2
    assert "no checkpoint here verifies (1 complete; `trainwatch checkpoint verify" in bad.stderr


def test_the_launcher_starts_torchrun_without_importing_torch_itself(tmp_path):
    """`trainwatch train` (and every restart by the controller) only parses the config and
    the faults before torchrun: importing torch there cost seconds of every restart."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "trainwatch", "train",
                           str(tmp_path / "exp"), "--nproc-per-node", "0"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TRAINWATCH_FAULT": "nan:step=3"})
    assert done.returncode == 2, done.stderr[-2000:]  # refused before torchrun: nothing ran
    imported = {ln.rsplit("|", 1)[1].strip().split(".")[0] for ln in done.stderr.splitlines()
                if ln.startswith("import time:") and "|" in ln}
    assert "trainwatch" in imported and "torch" not in imported


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_diagnose_refuses_a_timeout_that_is_not_a_finite_number(tmp_path, value):
    (tmp_path / "status").mkdir()
    done = tw("diagnose", str(tmp_path), "--timeout", value, "--no-dump-request")
    _no_traceback(done)
    assert done.returncode == 2 and "'--timeout'" in done.stderr, done.stderr


@pytest.mark.parametrize("target", ["notaport:abc", "localhost", "host:99999", "ftp://h:1"])
def test_alerts_watch_refuses_an_unparsable_target_at_start(target):
    """It used to run forever, logging a traceback per scrape."""
    done = tw("alerts", "watch", "--target", target, timeout=30)
    _no_traceback(done)
    assert done.returncode == 2 and "key '--target'" in done.stderr, done.stderr


def _report_run(tmp_path):
    from trainwatch.rundir.run_dir import RunDir
    run = RunDir(tmp_path / "run").create()
    run.append_event("run_started", "rank0", world_size=1)
    return run.root


@pytest.mark.parametrize("kind", ["char device", "fifo", "symlink", "directory"])
def test_report_prom_textfile_never_replaces_what_is_not_a_regular_file(tmp_path, kind):
    """As root it used to turn a device node into a regular file."""
    import stat
    path = tmp_path / "cost.prom"
    if kind == "char device":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        (tmp_path / "target.prom").write_text("mine\n")
        path.symlink_to(tmp_path / "target.prom")
    else:
        path.mkdir()
    before = os.lstat(path)
    done = tw("report", str(_report_run(tmp_path)), "--prom-textfile", str(path))
    _no_traceback(done)
    assert done.returncode == 2 and "'--prom-textfile'" in done.stderr, done.stderr
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    if kind == "symlink":
        assert (tmp_path / "target.prom").read_text() == "mine\n"


def test_report_prom_textfile_replaces_a_regular_file_atomically(tmp_path):
    path = tmp_path / "cost.prom"
    path.write_text("old\n")
    done = tw("report", str(_report_run(tmp_path)), "--prom-textfile", str(path))
    assert done.returncode == 0, done.stderr
    assert "trainwatch_cost_wall_seconds" in path.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cost.prom", "run"]  # no temp left
