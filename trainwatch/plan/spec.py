"""What a plan is computed from: the model, the batch, the parallel layout, the run.

Two sources: the reference trainer's config (``--config FILE`` / ``--set``, or its
defaults when nothing describes a model), or a described model (``--params N`` or
``--layers/--hidden/--seq``). Everything is checked here, so the arithmetic never sees
an impossible layout: a bad value is a ConfigError naming the option (exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwatch.errors import ConfigError

PRECISIONS = ("fp32", "amp-bf16", "bf16-mixed", "bf16")
OPTIMIZERS = ("adamw", "adam", "sgd-momentum", "sgd")
SHARDING = ("none", "optimizer", "gradients", "full")  # ZeRO stages 0-3 / FSDP FULL_SHARD
RECOMPUTE = ("none", "selective", "full")
REFERENCE_VOCAB = 256
DESCRIBED_VOCAB = 32000  # Llama's; give --vocab for yours
DESCRIBED_SEQ = 4096
CHINCHILLA_TOKENS_PER_PARAM = 20
ASPECT_RATIO = 128       # hidden / layers of GPT-3 and Llama models, when only --params is given


@dataclass
class PlanSpec:
    """A run description; ``source`` says where it came from."""

    source: str = "reference trainer defaults"
    reference: bool = True            # the reference GPT: checkpoint size is exact for it
    params: int | None = None         # None: from the architecture
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq: int = 64
    vocab: int = REFERENCE_VOCAB
    ffn: int | None = None            # None: 4 x hidden
    tied_embeddings: bool = True
    learned_positions: bool = True
    dropout: bool = False
    micro_batch: int = 8
    grad_accum: int = 1
    precision: str = "fp32"
    optimizer: str = "adamw"
    devices: int = 1
    tp: int = 1
    pp: int = 1
    sharding: str = "none"
    shard_degree: int | None = None   # None: the whole data-parallel group
    recompute: str = "none"
    flash_attention: bool = True
    steps: int | None = 200
    tokens: float | None = None       # None: steps x tokens per step, or 20 x params
    device_type: str = "h100"
    mfu: float = 0.40
    peak_flops: float | None = None   # None: from the device table
    price_per_device_hour: float | None = None
    data_bytes: float | None = None   # None: tokens x bytes_per_token
    bytes_per_token: float = 2.0
    checkpoints_kept: int = 3
    mirror: bool = False
    checkpoint_async: bool = True     # the reference trainer's async saves copy tied weights apart
    save_seconds: float | None = None  # None: checkpoint bytes / write_bytes_per_second
    write_bytes_per_second: float = 1e9
    device_mtbf_hours: float | None = None  # None: the public figure in reliability.py
    restart_seconds: float = 600.0

    # derived -------------------------------------------------------------------------
    @property
    def ffn_width(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def dp(self) -> int:
        return self.devices // (self.tp * self.pp)

    @property
    def shard_group(self) -> int:
        if self.sharding == "none":
            return 1
        return self.shard_degree if self.shard_degree is not None else self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.seq * self.dp

    @property
    def total_tokens(self) -> float:
        if self.tokens is not None:
            return self.tokens
        assert self.steps is not None, "make_plan sets the tokens of a spec without steps"
        return float(self.steps * self.tokens_per_step)

    @property
    def total_steps(self) -> float:
        return self.total_tokens / self.tokens_per_step

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> "PlanSpec":
        def need(ok: bool, key: str, problem: str) -> None:
            if not ok:
                raise ConfigError(problem, key=key)

        for key in ("layers", "hidden", "heads", "seq", "vocab", "micro_batch", "grad_accum",
                    "devices", "tp", "pp"):
            value = getattr(self, key)
            need(value >= 1, f"--{key.replace('_', '-')}", f"must be at least 1, got {value}")
        need(self.hidden % self.heads == 0, "--heads",
             f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        need(self.params is None or self.params >= 1, "--params",
             f"must be at least 1, got {self.params}")
        need(self.devices % (self.tp * self.pp) == 0, "--devices",
             f"{self.devices} devices cannot be split into tensor {self.tp} x pipeline "
             f"{self.pp} groups")
        need(self.layers % self.pp == 0, "--pp",
             f"{self.layers} layers cannot be split into {self.pp} pipeline stages")
        need(self.heads % self.tp == 0, "--tp",
             f"{self.heads} heads cannot be split over tensor-parallel degree {self.tp}")
        need(self.sharding != "none" or self.shard_degree is None, "--shard-degree",
             "needs --sharding optimizer, gradients or full")
        need(self.shard_degree is None or (self.shard_degree >= 1
                                           and self.dp % self.shard_degree == 0),
             "--shard-degree", f"must divide the data-parallel degree {self.dp}, "
             f"got {self.shard_degree}")
        need(self.checkpoints_kept >= 0, "--keep", f"must be >= 0, got {self.checkpoints_kept}")
        need(0 < self.mfu <= 1, "--mfu", f"must be in (0, 1], got {self.mfu}")
        need(self.steps is None or self.steps > 0, "--steps", f"must be positive, got {self.steps}")
        for key in ("peak_flops", "price_per_device_hour", "data_bytes", "save_seconds",
                    "device_mtbf_hours", "tokens"):
            value = getattr(self, key)
            need(value is None or value > 0, f"--{key.replace('_', '-')}",
                 f"must be positive, got {value}")
        need(self.write_bytes_per_second > 0, "--write-gbps", "must be positive")
        need(self.restart_seconds >= 0, "--restart-seconds", "must be >= 0")
        need(self.bytes_per_token > 0, "--bytes-per-token", "must be positive")
        return self


def from_trainer_config(cfg: Any, source: str, devices: int, device_type: str) -> PlanSpec:
    """The reference trainer's config as a plan: its model, batch, steps, checkpoints and
    ``parallel.mode`` (fsdp is ``--sharding full`` over every rank, hsdp over
    ``--shard-degree`` = ``parallel.shard_size``).

    On a GPU the trainer keeps fp32 weights under bf16 autocast; on CPU it is fp32 throughout.
    """
    m, o, t, c = cfg.model, cfg.optim, cfg.train, cfg.checkpoint
    return PlanSpec(
        source=source, reference=True, layers=m.layers, hidden=m.width, heads=m.heads,
        seq=m.context, vocab=REFERENCE_VOCAB, tied_embeddings=True, learned_positions=True,
        dropout=m.dropout > 0, micro_batch=t.batch_size, grad_accum=o.grad_accum,
        precision="fp32" if device_type == "cpu" else "amp-bf16", optimizer="adamw",
        devices=devices, sharding="none" if cfg.parallel.mode == "ddp" else "full",
        shard_degree=cfg.parallel.shard_size if cfg.parallel.mode == "hsdp" else None,
        steps=t.steps, device_type=device_type,
        data_bytes=float(_dataset_bytes(cfg)), bytes_per_token=1.0,
        checkpoints_kept=c.keep_last + c.keep_best if c.enabled else 0,
        mirror=bool(c.mirror_dir) and c.enabled, checkpoint_async=c.mode == "async")


def trainer_mode(spec: PlanSpec) -> str | None:
    """The reference trainer's ``parallel.mode`` that runs this plan's layout, or None
    where it has none (ZeRO-1/2, tensor or pipeline parallelism)."""
    if not spec.reference or spec.params is not None or spec.tp > 1 or spec.pp > 1:
        return None
    if spec.sharding == "none":
        return "ddp"
    if spec.sharding == "full":
        return "fsdp" if spec.shard_group == spec.dp else "hsdp"
    return None


def _dataset_bytes(cfg: Any) -> int:
    """The dataset's size: its manifest's splits, or the built-in corpus size."""
    if cfg.data.path is None:
        return int(cfg.data.corpus_bytes)
    manifest = Path(cfg.data.path) / "manifest.json"
    try:
        splits = json.loads(manifest.read_text())["splits"]
        return sum(int(s["bytes"]) for s in splits.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError("cannot read the dataset's size from its manifest",
                          file=str(manifest), key="data.path") from None


_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str, key: str) -> float:
    """``7e9``, ``7B``, ``125M``, ``2T``, ``1,000`` -> a number; else ConfigError."""
    match = re.fullmatch(r"\s*([0-9][0-9_,]*\.?[0-9]*(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*",
                         str(text), re.IGNORECASE)
    if not match:
        raise ConfigError(f"not a number: {text!r} (e.g. 7e9, 7B, 125M)", key=key)
    return float(match.group(1).replace(",", "").replace("_", "")) * _SUFFIX[
        match.group(2).lower()]


def layers_for(params: float) -> tuple[int, int]:
    """An architecture for a bare parameter count: ``12·L·h² = N`` with ``h = 128·L``,
    h rounded to a multiple of 1024 (of 128 below that), so 128-wide heads split evenly
    over tensor-parallel degrees up to 8 (7B: 33 layers of 4096)."""
    layers = max(1, round((params / (12 * ASPECT_RATIO ** 2)) ** (1 / 3)))
    hidden = (params / (12 * layers)) ** 0.5
    step = 1024 if hidden >= 1024 else 128
    return layers, max(128, round(hidden / step) * step)
