"""Shared test helpers: real torchrun jobs with scratch files in the test's folders, real tmpfs mounts."""

import contextlib
import os
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from suite_order_helpers import keep_our_file_order, longest_files_first

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    keep_our_file_order(config)


def pytest_collection_modifyitems(config, items):
    longest_files_first(items)  # with a file per xdist worker, the last one sets the end


def torchrun_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Environment for a torchrun child: TMPDIR in the test's own folder, quiet OMP."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update({"TMPDIR": str(scratch), "OMP_NUM_THREADS": "1",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def run_torchrun(tmp_path: Path, script: str, *args: str, nproc: int = 2,
                 timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", script, *args]
    return subprocess.run(cmd, env=torchrun_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.fixture
def repo() -> Path:
    return REPO


def clone_checkout(clone: Path) -> Path:
    """A fresh git clone of this checkout at ``clone``, with its uncommitted work copied in:
    what a newcomer gets, and what is being tested (CI's clone has no uncommitted work)."""
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    for path in subprocess.run(["git", "-C", str(REPO), "ls-files", "--modified", "--others",
                                "--exclude-standard"], capture_output=True, text=True,
                               check=True).stdout.split():
        if not (REPO / path).exists():  # deleted here, not yet committed
            (clone / path).unlink(missing_ok=True)
            continue
        (clone / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / path, clone / path)
    return clone


@contextlib.contextmanager
def tmpfs_mount(path: Path, size: str):
    """A real tmpfs of ``size`` at ``path`` (root only; the test skips elsewhere), unmounted after."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def frozen_disk(path: Path, image: Path, size: str = "32M"):
    """A real ext4 disk (a loop-mounted ``image``) at ``path``, frozen (``fsfreeze``) while
    the block runs: every write to it hangs in the kernel, as on a hung NFS server or a
    stuck device, until it is thawed. Root only; the test skips elsewhere. Thawed and
    unmounted after, whatever happens."""
    path.mkdir(parents=True, exist_ok=True)
    steps = [["truncate", "-s", size, str(image)], ["mkfs.ext4", "-q", "-F", str(image)],
             ["mount", "-o", "loop", str(image), str(path)]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot make a loop-mounted disk here: {done.stderr.strip()}")
    try:
        frozen = subprocess.run(["fsfreeze", "-f", str(path)], capture_output=True, text=True)
        if frozen.returncode != 0:
            pytest.skip(f"cannot freeze a disk here: {frozen.stderr.strip()}")
        try:
            yield path
        finally:
            subprocess.run(["fsfreeze", "-u", str(path)], check=False)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_to_the_brim(folder: Path) -> float:
    """Fill a (tmpfs) folder until not one more byte fits, big chunks then smaller down to
    one (again: what others freed since); the time it was full."""
    with open(folder / "filler", "ab", buffering=0) as fh:
        size = 1 << 20
        while size:
            try:
                fh.write(b"\0" * size)
            except OSError:
                size //= 2
    return time.time()


TRAIN = [sys.executable, "-m", "trainwatch", "train"]


def kill_tree(proc: subprocess.Popen) -> None:
    """Finalizer: kill a process and everything it started (torchrun puts ranks in sessions
    of their own, so a process-group kill would miss them)."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        proc.kill()
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def start_train(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`trainwatch train ARGS` in its own session; TRAINWATCH_FAULT only when ``env`` sets it."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full_env.pop("TRAINWATCH_FAULT", None)
    full_env.update(env or {})
    return subprocess.Popen([*TRAIN, *args], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


@pytest.fixture
def launch_train():
    """Start `trainwatch train` runs; whatever is left of them is killed at teardown."""
    procs = []

    def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        procs.append(start_train(*args, env=env))
        return procs[-1]

    yield start
    for proc in procs:
        kill_tree(proc)


@pytest.fixture(scope="session")
def recovered_run(tmp_path_factory):
    """A real `trainwatch run` whose rank 1 exits at step 15; the controller restarts the job
    from its checkpoint and it finishes. Its mirror folder is unusable, so every mirror copy
    fails for real (checkpoint_failed, ENOTDIR). Shared by the HTML report and runbook tests:
    restarts, an incident, rank logs, checkpoint saves and failures to look at."""
    tmp = tmp_path_factory.mktemp("recovered")
    (tmp / "not-a-directory").write_text("")
    (tmp / "train.yaml").write_text(
        "train: {steps: 40, batch_size: 4, eval_interval: 1000}\n"
        f"checkpoint: {{every_steps: 10, fsync: false, mirror_dir: {tmp}/not-a-directory/m}}\n")
    run_dir = tmp / "exp"
    options = ["--config", str(tmp / "train.yaml"), "--max-restarts", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--nproc-per-node", "2", "--run-dir",
         str(run_dir), *options, "--no-live"],
        env=torchrun_env(tmp, TRAINWATCH_FAULT="exit:rank=1:step=15:launch=1"),
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "incidents   │ 1:" in done.stdout
    return run_dir, options


@pytest.fixture
def processes():
    """Start services (Prometheus, Alertmanager) with their logs; stopped by PID at the end."""
    procs = []

    def start(cmd, log):
        p = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def all_commands():
    """Every trainwatch command and sub-command, as (name, click command)."""
    import click

    from trainwatch.cli import cli
    ctx = click.Context(cli)

    def walk(cmd, path):
        yield " ".join(path), cmd
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                yield from walk(cmd.get_command(ctx, name), [*path, name])
    return list(walk(cli, ["trainwatch"]))


@pytest.fixture
def group():
    """A one-rank gloo process group in this process (DDP, FSDP2 and DCP need one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def one_thread():
    """One intra-op thread: bit-exact comparisons, and no spinning OpenMP on a busy box."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
