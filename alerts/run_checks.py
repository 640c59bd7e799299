"""What ``trainwatch run`` checks before it starts anything.

A launch that would be rejected must be rejected here, in this process, within a
second or two and before the run directory is touched: otherwise the agent and the
engine start, the job fails seconds later with exit 2, and the rejected launch is
journaled as if it had been an attempt (``report`` would count its seconds, ``diagnose``
would look at it). torch is imported only to check a dataset the config names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwatch.agent.config import load_config as load_agent_config
from trainwatch.contract.env import FAULT_ENV
from trainwatch.contract.layout import RunLayout
from trainwatch.contract.stall import default_options
from trainwatch.errors import ConfigError
from trainwatch.trainer.config import Config, load_config


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


def refuse_rehearsal_dir(run_dir: str | Path) -> None:
    """A rehearsal's directory is no run's: its command's checkpoints would be resumed as
    if they were the run's own, and the time since the rehearsal booked as downtime."""
    run = RunLayout(run_dir)
    if run.rehearsal_dir.is_dir():
        raise ConfigError("trainwatch rehearse used this directory (its checkpoints, status and "
                          f"{run.rehearsal_dir.name}/ are here); give the run a new one",
                          file=str(run.root), key="--run-dir")


def check_launch(run_dir: str | Path, *, nproc_per_node: int, config: str | None,
                 overrides: list[str], steps: int | None,
                 agent_config: str | None) -> LaunchPlan:
    """Every check of a launch; ConfigError (exit 2) naming the input at fault."""
    if nproc_per_node < 1:
        raise ConfigError(f"must be at least 1, got {nproc_per_node}", key="--nproc-per-node")
    run_root = Path(run_dir)
    if run_root.exists() and not run_root.is_dir():
        raise ConfigError("exists and is not a directory", file=str(run_root), key="--run-dir")
    cfg = _trainer_config(config, overrides, steps)
    if os.environ.get(FAULT_ENV):  # drills only: parsing them imports torch
        from trainwatch.trainer.faults import parse_faults
        parse_faults(os.environ[FAULT_ENV])
    if cfg.data.path is not None:  # a given dataset: its manifest and checksums (imports torch)
        from trainwatch.trainer.data import load_dataset
        load_dataset(cfg.data.path)
    # The agent's config too, or a bad file would make the agent die unseen; its stall
    # options are recorded with the run, so report and diagnose judge stalls as it did.
    agent = load_agent_config(agent_config, run_dirs=[str(run_root)])
    return LaunchPlan(cfg, cfg.train.steps, _resume_step(run_root, cfg, nproc_per_node),
                      agent.stall)


def _trainer_config(config: str | None, overrides: list[str], steps: int | None) -> Config:
    """The trainer's own validation (file, line and key), without importing torch."""
    return load_config(config, [*overrides, *([f"train.steps={steps}"] if steps else [])])


def _resume_step(run_root: Path, cfg: Config, world_size: int) -> int | None:
    """The step the newest complete checkpoint would resume from (None: a fresh start);
    a checkpoint of another experiment or world size is refused here, as the ranks would."""
    if not run_root.is_dir():
        return None
    ck = cfg.checkpoint
    if not ck.enabled or ck.resume == "never":
        return None
    from trainwatch.trainer.checkpoint.catalog import newest_complete
    from trainwatch.trainer.checkpoint.compat import check_compatible, config_changes
    from trainwatch.rundir import RunDir

    folders = RunLayout(run_root).configured_checkpoint_folders(ck.dir, ck.mirror_dir)
    newest = newest_complete(folders)
    if newest is None:
        return None
    step, path, manifest = newest
    recorded = (RunDir(run_root).run_info() or {}).get("config")
    check_compatible(manifest, path, config_hash=cfg.training_digest(), world_size=world_size,
                     changes=config_changes(recorded, cfg.to_dict()))
    return step
