"""The ``checkpoint`` section of the trainer config: what to save, when, and what to keep."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from trainwatch.errors import ConfigError

MODES = ("async", "sync")
WHEN_BUSY = ("wait", "skip")
RESUME = ("auto", "never")
NONFINITE = ("skip", "halt", "off")
MEMORY_SNAPSHOTS = ("auto", "every_step", "off")  # memory_snapshots/snapshotter.py MODES
PEER_COPIES = ("ring", "clique", "off")  # memory_snapshots/peer_ring.py RING, CLIQUE
PEER_NODES = ("names", "blocks")         # memory_snapshots/peer_ring.py BY_NAMES, BY_BLOCKS


@dataclass
class CheckpointConfig:
    """Checkpoint settings; every field is documented in docs/checkpoints.md."""

    # Choices that include "off": YAML 1.1 reads an unquoted `off` as false, so a false here
    # is that word (docs/checkpoints.md writes `nonfinite: off`, unquoted).
    READS_OFF: ClassVar[tuple[str, ...]] = ("nonfinite", "memory_snapshots", "peer_copies")

    enabled: bool = True
    dir: str | None = None            # default: RUN_DIR/checkpoints
    every_steps: int = 100            # 0: only on request, on SIGTERM and at the end
    mode: str = "async"               # async: the loop blocks only to copy state to host memory
    when_busy: str = "wait"           # a save due while one is in flight: wait for it, or skip
    keep_last: int = 3                # newest N verified checkpoints kept
    keep_best: int = 0                # plus the K with the lowest validation loss
    mirror_dir: str | None = None     # redundant copy (another disk or mount)
    resume: str = "auto"              # auto: continue from the newest verified checkpoint
    save_final: bool = True           # save after the last step
    nonfinite: str = "skip"           # NaN/Inf loss or gradient: skip the step, halt, or off
    fsync: bool = True                # fsync files and directories (turn off only for tests)
    memory_snapshots: str = "auto"    # every step (or every K: <= 1 % of step time) to /dev/shm
    memory_snapshots_every: int = 0   # 0: as memory_snapshots says; K: every K steps, pinned
    memory_snapshots_dir: str | None = None  # default: /dev/shm/trainwatch-<uid>/<run id>
    peer_copies: str = "ring"         # each snapshot also kept on another node: ring, clique, off
    peer_copies_offset: int = 1       # ring: the copy goes this many nodes on
    peer_copies_clique_size: int = 2  # clique: nodes that keep each other's copies
    peer_copies_nodes: str = "names"  # which ranks share a node: node names, or torchrun's blocks

    @classmethod
    def from_mapping(cls, data: dict[str, Any] | None, *, file: str | None = None,
                     prefix: str = "checkpoint") -> "CheckpointConfig":
        """Build from a config mapping; unknown keys and bad values name the file and key."""
        data = dict(data or {})
        known = {f.name: f for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(f"unknown setting (known: {', '.join(sorted(known))})",
                                  file=file, key=f"{prefix}.{key}")
        data.update({key: "off" for key in cls.READS_OFF if data.get(key) is False})
        cfg = cls(**data)
        cfg.validate(file=file, prefix=prefix)
        return cfg

    def validate(self, *, file: str | None = None, prefix: str = "checkpoint") -> None:
        def bad(key: str, problem: str) -> ConfigError:
            return ConfigError(problem, file=file, key=f"{prefix}.{key}")

        for key in ("enabled", "save_final", "fsync"):
            if not isinstance(getattr(self, key), bool):
                raise bad(key, f"must be true or false, got {getattr(self, key)!r}")
        for key in ("every_steps", "keep_last", "keep_best", "memory_snapshots_every"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(key, f"must be an integer >= 0, got {value!r}")
        if self.keep_last < 1:
            raise bad("keep_last", "must be at least 1 (the newest checkpoint is always kept)")
        for key, choices in (("mode", MODES), ("when_busy", WHEN_BUSY), ("resume", RESUME),
                             ("nonfinite", NONFINITE),
                             ("memory_snapshots", MEMORY_SNAPSHOTS),
                             ("peer_copies", PEER_COPIES), ("peer_copies_nodes", PEER_NODES)):
            if getattr(self, key) not in choices:
                raise bad(key, f"must be one of {', '.join(choices)}, got {getattr(self, key)!r}")
        for key, least in (("peer_copies_offset", 1), ("peer_copies_clique_size", 2)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise bad(key, f"must be an integer >= {least}, got {value!r}")
        for key in ("dir", "mirror_dir", "memory_snapshots_dir"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(key, f"must be a path, got {value!r}")
