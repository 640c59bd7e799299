"""What ``trainwatch run`` checks before it starts anything.

A launch that would be rejected must be rejected here, in this process, within a
second or two and before the run directory is touched: otherwise the agent and the
engine start, the job fails seconds later with exit 2, and the rejected launch is
journaled as if it had been an attempt (``report`` would count its seconds, ``diagnose``
would look at it). torch is imported only to check a dataset the config names.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwatch.agent.config import load_config as load_agent_config
from trainwatch.contract.env import FAULT_ENV
from trainwatch.contract.layout import AGENT_LOG, JOB_LOG, RunLayout
from trainwatch.contract.stall import default_options
from trainwatch.control.command import resolve
from trainwatch.errors import ConfigError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.trainer.config import Config, check_world_size, load_config


@dataclass
class LaunchPlan:
    """The validated trainer config of a launch, and what the run directory already holds."""

    config: Config
    target_steps: int
    resume_step: int | None          # steps done by the newest complete checkpoint, if any
    agent_stall: dict[str, Any] = field(default_factory=default_options)  # recorded with the run

    @property
    def already_complete(self) -> bool:
        return self.resume_step is not None and self.resume_step >= self.target_steps


def refuse_rehearsal_dir(run: RunLayout) -> None:
    """A rehearsal's directory is no run's: its command's checkpoints would be resumed as
    if they were the run's own, and the time since the rehearsal booked as downtime."""
    if run.rehearsal_dir.is_dir():
        raise ConfigError("trainwatch rehearse used this directory (its checkpoints, status and "
                          f"{run.rehearsal_dir.name}/ are here); give the run a new one",
                          file=str(run.root), key="--run-dir")


def check_launch(run: RunDir, *, nproc_per_node: int, config: str | None,
                 overrides: list[str], steps: int | None,
                 agent_config: str | None, nnodes: int = 1) -> LaunchPlan:
    """Every check of a launch; ConfigError (exit 2) naming the input at fault."""
    if nproc_per_node < 1:
        raise ConfigError(f"must be at least 1, got {nproc_per_node}", key="--nproc-per-node")
    check_run_dir(run)
    cfg = _trainer_config(config, overrides, steps)
    check_world_size(cfg.parallel, nnodes * nproc_per_node)
    if os.environ.get(FAULT_ENV):  # drills only: parsing them imports torch
        from trainwatch.trainer.faults import parse_faults
        parse_faults(os.environ[FAULT_ENV])
    if cfg.data.path is not None:  # a given dataset: its manifest and checksums (imports torch)
        from trainwatch.trainer.data import load_dataset
        load_dataset(cfg.data.path)
    # The agent's config too, or a bad file would make the agent die unseen; its stall
    # options are recorded with the run, so report and diagnose judge stalls as it did.
    agent = load_agent_config(agent_config, run_dirs=[str(run.root)])
    return LaunchPlan(cfg, cfg.train.steps, _resume_step(run, cfg, nnodes * nproc_per_node),
                      agent.stall)


def check_command(run: RunLayout, command: list[str], *, nproc_per_node, steps, config,
                  overrides, max_restarts, agent_config, rendezvous=(None, None, None)) -> dict:
    """The checks of a ``-- COMMAND`` launch (the trainer's options do not apply); the
    agent's stall options. ConfigError (exit 2) before anything starts."""
    given = [name for name, value in (("--nproc-per-node", nproc_per_node), ("--steps", steps),
                                      ("--config", config), ("--set", overrides),
                                      ("--max-restarts", max_restarts),
                                      ("--rdzv-endpoint", rendezvous[0]),
                                      ("--local-addr", rendezvous[1]),
                                      ("--min-nnodes", rendezvous[2] if len(rendezvous) > 2
                                       else None)) if value]
    if given:
        verb = "configures" if len(given) == 1 else "configure"
        raise ConfigError(f"{', '.join(given)} {verb} the reference trainer; with a COMMAND "
                          "put your job's own options in the command", key=given[0])
    check_run_dir(run)
    resolve(command)
    agent = load_agent_config(agent_config, run_dirs=[str(run.root)])  # else it dies unseen
    return agent.stall


def check_run_dir(run: RunLayout) -> None:
    """The run directory, if ``trainwatch run`` can keep its state there: a directory (or
    none yet) whose journal, run.json and logs, where present, are regular files (a
    directory or FIFO there would fail the supervisor after it started the agent)."""
    root = run.root
    if root.exists() and not root.is_dir():
        raise ConfigError("exists and is not a directory", file=str(root), key="--run-dir")
    for path in (run.journal_file, run.run_file, run.logs_dir / AGENT_LOG,
                 run.logs_dir / JOB_LOG):
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ConfigError(f"cannot be checked: {exc.strerror or exc}", file=str(path)) \
                from None
        if not stat.S_ISREG(mode):
            raise ConfigError("is not a regular file (a directory, FIFO or device): "
                              "trainwatch run writes to it; move it away",
                              file=str(path))


def _trainer_config(config: str | None, overrides: list[str], steps: int | None) -> Config:
    """The trainer's own validation (file, line and key), without importing torch."""
    return load_config(config, [*overrides, *([f"train.steps={steps}"] if steps else [])])


def _resume_step(run: RunDir, cfg: Config, world_size: int) -> int | None:
    """The step the newest usable checkpoint would resume from (None: a fresh start, there
    is none). Checkpoints that exist but of which none has all its files at their sizes
    (the quick half of the ranks' verification; they also check the digests) are refused
    (exit 2), as the ranks would: the run must not quietly start over from step 0. So is
    a checkpoint of another experiment, or one whose global batch this world size cannot
    split (trainer/step_shape.py)."""
    if not run.root.is_dir():
        return None
    ck = cfg.checkpoint
    if not ck.enabled or ck.resume == "never":
        return None
    from trainwatch.checkpoint_format.catalog import scan
    from trainwatch.checkpoint_format.compat import check_compatible, config_changes
    from trainwatch.checkpoint_format.manifest import verify
    from trainwatch.trainer.step_shape import check_resumable

    folders = run.configured_checkpoint_folders(ck.dir, ck.mirror_dir)
    found = sorted(((e.step, -order, e) for order, folder in enumerate(folders)
                    for e in scan(folder) if e.step is not None),
                   key=lambda found: found[:2], reverse=True)
    refused: list[tuple[Path, str]] = []
    for step, _, entry in found:
        if entry.state == "complete":
            checked = verify(entry.path, full=False)
            if checked.ok and entry.manifest is not None:
                recorded = (run.run_info() or {}).get("config")
                check_compatible(entry.manifest, entry.path, config_hash=cfg.training_digest(),
                                 changes=config_changes(recorded, cfg.to_dict()),
                                 sharded=cfg.parallel.mode != "ddp")
                check_resumable(entry.manifest, world_size, cfg.train.batch_size,
                                cfg.optim.grad_accum, file=str(entry.path))
                return step
            refused.append((entry.path, checked.reason))
        else:
            refused.append((entry.path, entry.reason))
    if refused:
        newest, why = refused[0]
        raise ConfigError(f"no checkpoint verifies ({len(refused)} found, newest {newest.name}: "
                          f"{why}); refusing to start over them from step 0: move them away "
                          "or set checkpoint.resume: never", file=str(newest.parent))
    return None
