"""``trainwatch train``: validate, then run the reference trainer under torchrun with restarts.

The launcher adds what a bare torchrun call forgets: the config (and a given
dataset) is checked before any process starts; torchrun's scratch files go to
RUN_DIR/tmp and its logs to RUN_DIR/logs; ``run.json`` and journal events
(``launcher_started``, ``launcher_exited``) record the run; SIGINT/SIGTERM are
forwarded to torchrun, which stops its workers; the exit code says what happened
(0 finished, 1 training failed after the allowed restarts, 2 bad input,
128+N stopped by signal N). Restarts are torchrun's own ``--max-restarts``; rank 0
of a restarted attempt writes the ``restarted`` event.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from trainwatch import __version__
from trainwatch.config.clitypes import MAX_RESTARTS
from trainwatch.contract.env import FAULT_ENV, JOB_ENV, NODE_ENV, RUN_DIR_ENV, STORE_ADDR_ENV
from trainwatch.contract.layout import (CHECKPOINT_DIRS_KEY, CONFIG_DIGEST_KEY, RUN_FILE, TORCHRUN_LOG,
                                       TORCHRUN_LOG_DIR, WEIGHTS_CONFIG_DIGEST_KEY)
from trainwatch.contract.ports import LOOPBACK
from trainwatch.errors import ConfigError
from trainwatch.node import node_name
from trainwatch.process.output_pump import OutputPump
from trainwatch.process.output_queue import OutputQueue
from trainwatch.process.proctree import die_with_parent
from trainwatch.rundir.best_effort_log import BestEffortLog
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import hold, under_holder
from trainwatch.checkpoint_format.catalog import newest_complete
from trainwatch.checkpoint_format.compat import check_compatible, config_changes
from trainwatch.trainer.config import Config, check_world_size, load_config
from trainwatch.trainer.faults import parse_faults
from trainwatch.trainer.step_shape import StepShape, check_resumable, reshaped
from trainwatch.trainer.rendezvous import one_node_args

FLIGHT_RECORDER_ENTRIES = 2000


@dataclass
class LaunchSpec:
    run_dir: Path
    nproc_per_node: int
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    max_restarts: int = MAX_RESTARTS
    nnodes: int = 1
    min_nnodes: int | None = None  # elastic: go on with as few nodes (torchrun --nnodes MIN:MAX)
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    local_addr: str | None = None
    node_name: str | None = None
    monitor_interval: float = 0.5

    @property
    def job(self) -> str:
        return RunDir(self.run_dir).run_name(os.environ.get(JOB_ENV))

    @property
    def node(self) -> str:
        return self.node_name or node_name()


def validate(spec: LaunchSpec) -> Config:
    """Everything that can be checked before starting processes; ConfigError (exit 2) if not."""
    if spec.nproc_per_node < 1:
        raise ConfigError(f"must be at least 1, got {spec.nproc_per_node}",
                          key="--nproc-per-node")
    if spec.nnodes < 1:
        raise ConfigError(f"must be at least 1, got {spec.nnodes}", key="--nnodes")
    if spec.nnodes > 1 and not spec.rdzv_endpoint:
        raise ConfigError("several nodes need --rdzv-endpoint HOST:PORT", key="--nnodes")
    name = spec.node_name
    if name is not None and (not name or name != name.strip()):
        raise ConfigError(f"must be a non-empty name without surrounding spaces, got {name!r}",
                          key="--node-name")
    if spec.max_restarts < 0:
        raise ConfigError(f"must be >= 0, got {spec.max_restarts}", key="--max-restarts")
    cfg = load_config(spec.config, spec.overrides)
    check_world_size(cfg.parallel, spec.nnodes * spec.nproc_per_node)
    check_elastic(spec, cfg)
    parse_faults(os.environ.get(FAULT_ENV, ""))
    if cfg.data.path is not None:
        from trainwatch.trainer.data import load_dataset  # imports torch: only when needed
        load_dataset(cfg.data.path)
    return cfg


def check_elastic(spec: LaunchSpec, cfg: Config) -> None:
    """``--min-nnodes``: every smaller world the job may go on with after losing nodes must
    take the same global batch (trainer/step_shape.py) and, for HSDP, whole shard groups;
    asked before anything starts, not when a node is lost at 3 a.m."""
    low = spec.min_nnodes
    if low is None or low == spec.nnodes:
        return
    if not 1 <= low <= spec.nnodes:
        raise ConfigError(f"must be between 1 and --nnodes {spec.nnodes}, got {low}",
                          key="--min-nnodes")
    full = StepShape(cfg.train.batch_size, cfg.optim.grad_accum,
                     spec.nnodes * spec.nproc_per_node)
    for nodes in range(low, spec.nnodes):
        world = nodes * spec.nproc_per_node
        try:
            check_world_size(cfg.parallel, world)
            reshaped(full, world, cfg.train.batch_size)
        except ConfigError as exc:
            raise ConfigError(f"{low} lets the job go on with {nodes} node(s), {world} ranks, "
                              f"which it cannot: {exc.problem}; raise --min-nnodes or change "
                              "the batch or shard size", key="--min-nnodes") from None


def torchrun_command(spec: LaunchSpec, run: RunDir) -> list[str]:
    # torchrun, its stores bound to STORE_ADDR_ENV (trainer/stores.py)
    cmd = [sys.executable, "-m", "trainwatch.trainer.stores",
           f"--nproc-per-node={spec.nproc_per_node}", f"--max-restarts={spec.max_restarts}",
           f"--monitor-interval={spec.monitor_interval}",
           f"--log-dir={run.logs_dir / TORCHRUN_LOG_DIR}", "--redirects=3", "--tee=3"]
    if spec.nnodes == 1 and not spec.rdzv_endpoint:
        # Not --standalone: it advertises the hostname, which need not resolve to loopback.
        cmd += one_node_args(spec.rdzv_id or spec.job, spec.local_addr or LOOPBACK)
    else:
        nnodes = (f"{spec.min_nnodes}:{spec.nnodes}"
                  if spec.min_nnodes is not None and spec.min_nnodes < spec.nnodes
                  else str(spec.nnodes))
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={spec.rdzv_endpoint}", f"--rdzv-id={spec.rdzv_id or spec.job}"]
        if spec.node_rank is not None:
            # c10d ignores --node-rank (global ranks follow the rendezvous order); here it
            # says which node hosts the rendezvous store, which torchrun otherwise guesses
            # from the hostname and misses when the endpoint is a secondary NIC's address.
            cmd.append(f"--rdzv-conf=is_host={int(spec.node_rank == 0)}")
        if spec.local_addr:
            # The address other nodes reach this one at; on rank 0's node the workers'
            # store listens there (MASTER_ADDR), else torchrun uses the FQDN.
            cmd.append(f"--local-addr={spec.local_addr}")
    cmd += ["-m", "trainwatch.trainer", "--run-dir", str(run.root.resolve())]
    if spec.config:
        cmd += ["--config", str(Path(spec.config).resolve())]
    for override in spec.overrides:
        cmd += ["--set", override]
    return cmd


def torchrun_env(spec: LaunchSpec, run: RunDir) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        # Required for --max-restarts with gloo on torch 2.13 (the shared store
        # breaks re-rendezvous).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "TMPDIR": str(run.tmp_dir.resolve()),
        RUN_DIR_ENV: str(run.root.resolve()),
        JOB_ENV: spec.job,
        NODE_ENV: spec.node,
        "PYTHONUNBUFFERED": "1",
        # torchrun's stores listen on loopback for one node, on the address other nodes
        # reach this one at for several (--local-addr), never on every interface.
        STORE_ADDR_ENV: spec.local_addr or (LOOPBACK if spec.nnodes == 1 else ""),
    })
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.nproc_per_node)))
    # Keep the last collectives in the flight recorder, so `trainwatch diagnose` can
    # say which one a hung rank is in (a user's own value wins).
    env.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    return env


def write_run_info(spec: LaunchSpec, run: RunDir, cfg: Config, cmd: list[str]) -> None:
    previous = run.run_info() or {}
    run.write_run_info({
        "job": spec.job, "created_at": previous.get("created_at", time.time()),
        "world_size": spec.nnodes * spec.nproc_per_node, "nproc_per_node": spec.nproc_per_node,
        "nnodes": spec.nnodes, "max_restarts": spec.max_restarts, "config": cfg.to_dict(),
        CONFIG_DIGEST_KEY: cfg.digest(), WEIGHTS_CONFIG_DIGEST_KEY: cfg.training_digest(),
        "trainwatch_version": __version__, "command": cmd,
        CHECKPOINT_DIRS_KEY: [run.recordable(p) for p in checkpoint_folders(run, cfg)],
    })


def checkpoint_folders(run: RunDir, cfg: Config) -> list[Path]:
    """Where the job's checkpoints go: ``checkpoint.dir`` and ``mirror_dir``."""
    return run.configured_checkpoint_folders(cfg.checkpoint.dir, cfg.checkpoint.mirror_dir)


class _TorchrunOutput:
    """torchrun's output copied to the console and to RUN_DIR/logs/torchrun.log, each best
    effort and each behind a bounded queue of its own: a closed or stalled console (a
    frozen supervisor) or a full or hung disk drops lines (counted), never blocks torchrun
    (the pipe is always drained) and never fails the launcher; the log resumes when space
    returns."""

    def __init__(self, log_file: Path):
        self.log = BestEffortLog(log_file)
        self._log = OutputQueue(self.log.write, skipped=self.log.skip,
                                name="tw-torchrun-log-writer")
        self._console = OutputQueue(_to_stdout, name="tw-torchrun-console")

    @property
    def dropped_bytes(self) -> int:
        """What torchrun.log lacks of torchrun's output."""
        return self.log.dropped_bytes + self._log.dropped_bytes

    def write(self, data: bytes) -> None:
        self._log.put(data)
        self._console.put(data)

    def close(self, timeout: float) -> None:
        """Hand on what is queued (each up to ``timeout``), then close the log."""
        self._console.close(timeout)
        self._log.call(self.log.settle)
        self._log.call(self.log.close)
        if not self._log.close(timeout):
            self.log.close()


def _to_stdout(data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(sys.stdout.fileno(), view):]
    except (OSError, ValueError, AttributeError):  # closed, gone, or none at all
        pass


def _record(what: str, write: Callable[[], object]) -> None:
    """A journal or run.json write of the launcher's: a full or failing disk costs the
    record (said on stderr), never the job."""
    try:
        write()
    except OSError as exc:
        try:
            print(f"trainwatch train: could not record {what}: {exc.strerror or exc}",
                  file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass


def refuse_incompatible_checkpoint(spec: LaunchSpec, cfg: Config) -> None:
    """The ranks refuse to resume a checkpoint of another config, or one whose global batch
    this world size cannot split (exit 2), and torchrun would restart them for nothing,
    burying the reason under its traceback; say it once, before starting anything. Reads
    manifests only (the ranks verify)."""
    if not cfg.checkpoint.enabled or cfg.checkpoint.resume == "never":
        return
    folders = checkpoint_folders(RunDir(spec.run_dir), cfg)
    newest = newest_complete(folders)
    if newest is not None:
        _, path, manifest = newest
        recorded = (RunDir(spec.run_dir).run_info() or {}).get("config")
        check_compatible(manifest, path, config_hash=cfg.training_digest(),
                         changes=config_changes(recorded, cfg.to_dict()),
                         sharded=cfg.parallel.mode != "ddp")
        check_resumable(manifest, spec.nnodes * spec.nproc_per_node, cfg.train.batch_size,
                        cfg.optim.grad_accum, file=str(path))


def launch(spec: LaunchSpec) -> int:
    """Run the job to the end; return the exit code ``trainwatch train`` should use."""
    cfg = validate(spec)
    refuse_incompatible_checkpoint(spec, cfg)
    run = RunDir(spec.run_dir).create()
    # Started by hand, the launcher is the run's supervisor (one per run directory); under
    # `trainwatch run` or `alerts receive` their lock covers it. The nodes of a multi-node
    # job may share one run directory, so they hold none.
    lock = hold(run, "trainwatch train") if spec.nnodes == 1 and under_holder(run) is None \
        else None
    try:
        return _launch(spec, run, cfg)
    finally:
        if lock is not None:
            lock.release()


def _launch(spec: LaunchSpec, run: RunDir, cfg: Config) -> int:
    cmd = torchrun_command(spec, run)
    if spec.node_rank in (None, 0):
        _record(RUN_FILE, lambda: write_run_info(spec, run, cfg, cmd))
    _record("launcher_started", lambda: run.append_event(
        "launcher_started", "launcher", host=spec.node, pid=os.getpid(),
        node_rank=spec.node_rank, nproc_per_node=spec.nproc_per_node, nnodes=spec.nnodes,
        max_restarts=spec.max_restarts, monitor_interval=spec.monitor_interval,
        config_digest=cfg.digest()))

    proc = subprocess.Popen(cmd, env=torchrun_env(spec, run), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent())  # torchrun is never orphaned
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        # The first signal only: torchrun's handler raises inside its own shutdown on a
        # second one and hangs there with its ranks unreaped, and a killed supervisor's
        # PR_SET_PDEATHSIG comes once for each thread it had.
        if not received:
            proc.send_signal(signum)
        received.append(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    assert proc.stdout is not None, "torchrun's output is a pipe"
    output = _TorchrunOutput(run.logs_dir / TORCHRUN_LOG)
    pump = OutputPump(os.dup(proc.stdout.fileno()), output.write, name="tw-torchrun-output")
    proc.stdout.close()
    pump.start()
    try:
        returncode = proc.wait()
        pump.drain(timeout=5)
        output.close(timeout=5)
    finally:
        for signum, handler in previous.items():
            # A stop under way ignores its repeats to the end: a Python handler would be
            # reset to the default one as the interpreter exits, and a late copy of a
            # killed supervisor's PDEATHSIG would then kill the launcher (-15, not 143).
            signal.signal(signum, signal.SIG_IGN if received else handler)
    if received:
        exit_code = 128 + received[0]
    elif returncode < 0:
        exit_code = 128 - returncode
    else:
        exit_code = 0 if returncode == 0 else 1
    _record("launcher_exited", lambda: run.append_event(
        "launcher_exited", "launcher", host=spec.node, exit_code=exit_code,
        torchrun_returncode=returncode, log_dropped_bytes=output.dropped_bytes,
        signal=signal.Signals(received[0]).name if received else None))
    return exit_code
