"""The trainer's configuration: typed sections, read from YAML plus ``--set`` overrides.

Everything is validated before a single process starts: an unknown key, a value of
the wrong type or an impossible combination raises ``ConfigError`` naming the file
(or ``--set``) and the dotted key, which the CLI turns into exit code 2.

    model:   {layers: 2, width: 64, heads: 4, context: 64}
    optim:   {lr: 3.0e-3, warmup_steps: 10}
    train:   {steps: 200, batch_size: 8}

Defaults are tiny on purpose: four CPU ranks run a step in well under a second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwatch.checkpoint_format.compat import NOT_TRAINING
from trainwatch.config.yamlfile import load_yaml_mapping, parse_override
from trainwatch.errors import ConfigError
from trainwatch.rank.checkpoint.config import CheckpointConfig
from trainwatch.rank.config import TelemetryConfig


@dataclass
class ModelConfig:
    """A small GPT: byte-level vocabulary (256), learned positions, pre-norm blocks."""

    layers: int = 2
    width: int = 64
    heads: int = 4
    context: int = 64
    dropout: float = 0.0


@dataclass
class DataConfig:
    """Where tokens come from; ``path: null`` prepares the built-in corpus into RUN_DIR/data."""

    path: str | None = None
    corpus_bytes: int = 1_000_000
    corpus_seed: int = 1234
    val_fraction: float = 0.1
    shuffle_seed: int = 0


@dataclass
class OptimConfig:
    """AdamW with linear warmup, then (optionally) cosine decay to ``lr·min_lr_ratio``."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    cosine: bool = True
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1


@dataclass
class TrainConfig:
    """Loop length, per-rank micro-batch, evaluation and journal cadence."""

    steps: int = 200
    batch_size: int = 8
    eval_interval: int = 50
    eval_batches: int = 4
    seed: int = 0
    milestone_interval: int = 50
    device: str = "auto"


PARALLEL_MODES = ("ddp", "fsdp", "hsdp")


@dataclass
class ParallelConfig:
    """How the ranks share the model (docs/trainer.md, "Sharded training"): ``ddp`` (each
    rank a whole replica, gradients all-reduced), ``fsdp`` (FSDP2 ``fully_shard`` over a
    1-D device mesh: each rank holds 1/world of the weights, gradients and optimizer state;
    checkpoints are DCP, written by every rank and resumable at another world size) or
    ``hsdp`` (replicas x shards: each group of ``shard_size`` ranks holds one copy of the
    model sharded over it, and the copies are replicas of each other)."""

    mode: str = "ddp"
    shard_size: int | None = None  # hsdp: ranks one copy of the model is sharded over


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """A short hash of the whole resolved config (``config_digest`` in run.json, status
        files and the journal): tells two runs' configs apart, whatever section changed."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def training_digest(self) -> str:
        """A hash of what decides the weights (not ``checkpoint``/``telemetry``, nor
        ``parallel``: how the ranks share the model, which the checkpoint's own layout
        records and resume checks; ``weights_config_digest`` in run.json, manifests and
        reports): a checkpoint is resumed only by a run with the same one."""
        text = json.dumps({k: v for k, v in self.to_dict().items()
                           if k not in NOT_TRAINING}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def check_world_size(cfg: ParallelConfig, world_size: int) -> None:
    """HSDP's shard size must divide the world size (the launcher asks before starting
    anything; the ranks again, for a job started by other means)."""
    if cfg.mode == "hsdp" and cfg.shard_size is not None and world_size % cfg.shard_size:
        raise ConfigError(f"{cfg.shard_size} does not divide the world size {world_size}: "
                          "every replica needs a whole set of shards; give a divisor, or "
                          "change the number of ranks", key="parallel.shard_size")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
                ) -> Config:
    """Defaults, then the YAML file, then each ``--set key=value``; then cross-checks."""
    config = Config()
    if path is not None:
        data = load_yaml_mapping(path)
        _apply_mapping(config, data, source=str(path), prefix="")
    for text in overrides:
        key, value = parse_override(text)
        _apply_value(config, key.split("."), value, source="--set", dotted=key)
    validate(config, source=str(path) if path is not None else "--set")
    return config


def _apply_mapping(obj: Any, data: dict[str, Any], *, source: str, prefix: str) -> None:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if not isinstance(key, str):
            raise ConfigError("keys must be strings", file=source, key=dotted)
        _apply_value(obj, [key], value, source=source, dotted=dotted)


def _apply_value(obj: Any, parts: list[str], value: Any, *, source: str, dotted: str) -> None:
    name = parts[0]
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        known = ", ".join(sorted(fields)) or "none yet"
        raise ConfigError(f"unknown key (known here: {known})", file=source, key=dotted)
    hint = typing.get_type_hints(type(obj))[name]
    if dataclasses.is_dataclass(hint):
        section = getattr(obj, name)
        if len(parts) > 1:
            _apply_value(section, parts[1:], value, source=source, dotted=dotted)
        elif isinstance(value, dict):
            _apply_mapping(section, value, source=source, prefix=f"{dotted}.")
        elif value is not None:  # an empty section ("checkpoint:") is fine
            raise ConfigError(f"must be a mapping, got {_type_name(value)}", file=source,
                              key=dotted)
        return
    if len(parts) > 1:
        raise ConfigError(f"'{name}' is a value, not a section", file=source, key=dotted)
    setattr(obj, name, _coerce(value, hint, source=source, key=dotted))


def _coerce(value: Any, hint: Any, *, source: str, key: str) -> Any:
    """Check ``value`` against a field's annotation; ints are accepted for floats."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"must be {_hint_name(hint)}, got null", file=source, key=key)
    for kind in allowed:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            if abs(value) >= 1 << 62:  # torch, numpy and the file formats stop at 64 bits
                raise ConfigError(f"{value} is out of range", file=source, key=key)
            return value
        if kind is float and not isinstance(value, bool):
            number = None
            if isinstance(value, (int, float)):
                number = float(value) if abs(value) < 1e300 else math.inf
            elif isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
                try:
                    number = float(value)
                except ValueError:
                    pass
            if number is not None:
                if not math.isfinite(number):
                    raise ConfigError(f"must be a finite number, got {value!r}", file=source,
                                      key=key)
                return number
        if kind is str and isinstance(value, str):
            return value
        if kind is str and value is False:  # YAML 1.1 reads `off` (and `no`) as false
            return "off"
    raise ConfigError(f"must be {_hint_name(hint)}, got {_type_name(value)} {value!r}",
                      file=source, key=key)


def _hint_name(hint: Any) -> str:
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    names = ["null" if kind is type(None) else kind.__name__ for kind in allowed]
    return " or ".join(names)


def _type_name(value: Any) -> str:
    names: dict[type, str] = {dict: "mapping", list: "list"}
    return names.get(type(value), type(value).__name__)


def validate(config: Config, *, source: str) -> None:
    """Combinations and ranges a type check cannot catch."""
    def need(ok: bool, key: str, problem: str) -> None:
        if not ok:
            raise ConfigError(problem, file=source, key=key)

    m, d, o, t, tel = config.model, config.data, config.optim, config.train, config.telemetry
    for key, value in (("model.layers", m.layers), ("model.width", m.width),
                       ("model.heads", m.heads), ("model.context", m.context),
                       ("data.corpus_bytes", d.corpus_bytes), ("optim.grad_accum", o.grad_accum),
                       ("train.steps", t.steps), ("train.batch_size", t.batch_size),
                       ("train.eval_batches", t.eval_batches)):
        need(value >= 1, key, f"must be at least 1, got {value}")
    # numpy seeds are 0 .. 2**32-1, and each rank seeds train.seed + 1 + rank
    for key, value in (("train.seed", t.seed), ("data.corpus_seed", d.corpus_seed),
                       ("data.shuffle_seed", d.shuffle_seed)):
        need(0 <= value < (1 << 32) - (1 << 20), key,
             f"must be between 0 and {(1 << 32) - (1 << 20) - 1}, got {value}")
    need(m.width % m.heads == 0, "model.heads",
         f"model.width ({m.width}) must be divisible by model.heads ({m.heads})")
    need(0.0 <= m.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {m.dropout}")
    need(0.0 < d.val_fraction < 1.0, "data.val_fraction",
         f"must be between 0 and 1, got {d.val_fraction}")
    need(o.lr > 0, "optim.lr", f"must be positive, got {o.lr}")
    need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio",
         f"must be in [0, 1], got {o.min_lr_ratio}")
    need(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    need(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    need(0 <= o.beta1 < 1, "optim.beta1", f"must be in [0, 1), got {o.beta1}")
    need(0 <= o.beta2 < 1, "optim.beta2", f"must be in [0, 1), got {o.beta2}")
    need(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 disables), got {o.grad_clip}")
    need(t.eval_interval >= 0, "train.eval_interval",
         f"must be >= 0 (0 disables), got {t.eval_interval}")
    need(t.milestone_interval >= 0, "train.milestone_interval",
         f"must be >= 0 (0 disables), got {t.milestone_interval}")
    need(t.device in ("auto", "cpu", "cuda"), "train.device",
         f"must be auto, cpu or cuda, got {t.device!r}")
    par = config.parallel
    need(par.mode in PARALLEL_MODES, "parallel.mode",
         f"must be {', '.join(PARALLEL_MODES[:-1])} or {PARALLEL_MODES[-1]}, got {par.mode!r}")
    need(par.mode != "hsdp" or par.shard_size is not None, "parallel.shard_size",
         "parallel.mode: hsdp needs it: the ranks one copy of the model is sharded over "
         "(e.g. the ranks of a node)")
    need(par.shard_size is None or par.mode == "hsdp", "parallel.shard_size",
         f"only for parallel.mode: hsdp (this is {par.mode}); leave it out")
    need(par.shard_size is None or par.shard_size >= 1, "parallel.shard_size",
         f"must be at least 1, got {par.shard_size}")
    need(tel.heartbeat_interval > 0, "telemetry.heartbeat_interval",
         f"must be positive, got {tel.heartbeat_interval}")
    need(tel.exchange_every >= 0, "telemetry.exchange_every",
         f"must be >= 0 (0 disables), got {tel.exchange_every}")
    need(tel.replica_every >= 0, "telemetry.replica_every",
         f"must be >= 0 (0 disables), got {tel.replica_every}")
    need(tel.reduction_every >= 0, "telemetry.reduction_every",
         f"must be >= 0 (0 disables), got {tel.reduction_every}")
    need(tel.peak_flops is None or tel.peak_flops > 0, "telemetry.peak_flops",
         f"must be positive or null, got {tel.peak_flops}")
    need(tel.metrics_port is None or 1 <= tel.metrics_port <= 65535, "telemetry.metrics_port",
         f"must be a port number (1-65535) or null, got {tel.metrics_port}")
    need(isinstance(tel.metrics_host, str) and bool(tel.metrics_host.strip()),
         "telemetry.metrics_host", f"must be an address to listen on, got {tel.metrics_host!r}")
    config.checkpoint.validate(file=source)
