"""What every collector may use: config, node name, run dirs, roots of /sys and /proc,
and the other collectors' last values."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainwatch.agent.config import AgentConfig
from trainwatch.agent.state import StateStore
from trainwatch.rundir.run_dir import RunDir, iter_run_dirs


@dataclass
class AgentContext:
    config: AgentConfig
    store: StateStore = field(default_factory=StateStore)
    started_at: float = field(default_factory=time.time)
    # Builds the GPU backend (agent/nvml.py); tests substitute a fake.
    gpu_backend: Callable[[], Any] | None = None

    @property
    def node(self) -> str:
        return self.config.node

    def sys_path(self, *parts: str) -> Path:
        return Path(self.config.sys_root, *parts)

    def proc_path(self, *parts: str) -> Path:
        return Path(self.config.proc_root, *parts)

    def run_dirs(self) -> list[RunDir]:
        """Configured run dirs plus those found in the discover folders (re-scanned each call)."""
        seen: dict[Path, RunDir] = {}
        for path in self.config.run_dirs:
            run = RunDir(path)
            seen.setdefault(run.root.resolve(), run)
        for folder in self.config.discover:
            for run in iter_run_dirs(folder):
                seen.setdefault(run.root.resolve(), run)
        return list(seen.values())
