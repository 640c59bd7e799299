"""Byte-level token datasets: a deterministic built-in corpus, a verified manifest, and
per-rank batches in a seeded order that can be resumed mid-epoch.

A prepared dataset is a directory:

    manifest.json   {"format": "trainwatch.dataset", "version": 1, "tokenizer": "bytes",
                     "splits": {"train": {"file", "sha256", "size_bytes", "tokens"}, "val": ...},
                     "source": {...}}
    train.bin       uint8 tokens (one byte = one token)
    val.bin

The manifest is written last, so a directory without one is an unfinished prepare.
Every load checks sizes and SHA-256 sums; a mismatch is a ConfigError (exit 2).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from trainwatch.errors import ConfigError, FormatError
from trainwatch.contract.layout import FORMAT_VERSION
from trainwatch.rundir.atomic import atomic_write_bytes, atomic_write_json
from trainwatch.rundir.safe_read import read_record

DATASET_FORMAT = "trainwatch.dataset"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


# --------------------------------------------------------------------------- the corpus

_SUBJECTS = ("the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird",
             "the farmer", "our neighbour", "the children", "a tired sailor", "the queen",
             "his brother", "the baker", "a young girl", "the doctor", "every student")
_VERBS = ("sees", "finds", "carries", "likes", "paints", "follows", "watches", "helps",
          "builds", "reads", "cleans", "opens", "remembers", "sells", "draws", "chases")
_OBJECTS = ("the red ball", "a long letter", "the green door", "an old book", "the river",
            "a wooden box", "the morning train", "a warm loaf", "the tall tree",
            "a broken chair", "the blue house", "a quiet song", "the garden", "a paper boat")
_PLACES = ("in the park", "near the market", "at the station", "by the sea", "in the kitchen",
           "on the hill", "under the bridge", "at school", "in the forest", "at home")
_TIMES = ("every morning", "after dinner", "on sunday", "at night", "in the spring",
          "before lunch", "once a week", "in winter")
_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
            "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
            "seventeen", "eighteen")


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.55:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.5:
            s += f" {rng.choice(_PLACES)}"
        if rng.random() < 0.3:
            s += f" {rng.choice(_TIMES)}"
        return s[0].upper() + s[1:] + "."
    if kind < 0.8:
        a, b = rng.randrange(10), rng.randrange(9)
        return f"{_NUMBERS[a].capitalize()} plus {_NUMBERS[b]} is {_NUMBERS[a + b]}."
    s = f"{rng.choice(_TIMES)}, {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return s[0].upper() + s[1:] + "."


def generate_corpus(size_bytes: int, seed: int) -> bytes:
    """Structured English-like text, deterministic in (size, seed): regular enough that a
    tiny model's loss falls clearly within a hundred steps, varied enough not to be trivial."""
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < size_bytes:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) + "\n"
        parts.append(paragraph)
        total += len(paragraph)
    return "".join(parts).encode("ascii")[:size_bytes]


# --------------------------------------------------------------------------- prepare / verify

def _sha256(data: bytes | np.ndarray) -> str:
    # numpy's stubs declare the buffer protocol for Python 3.12 and later only.
    return hashlib.sha256(memoryview(data)).hexdigest()  # type: ignore[arg-type]


def prepare(out: str | Path, text: bytes, *, val_fraction: float,
            source: dict[str, Any]) -> dict[str, Any]:
    """Split ``text`` into train/val token files and write the manifest (last, atomically)."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create dataset directory: {exc.strerror}",
                          file=str(out)) from None
    cut = int(len(text) * (1.0 - val_fraction))
    splits = {}
    for name, chunk in (("train", text[:cut]), ("val", text[cut:])):
        if len(chunk) < 2:
            raise ConfigError(f"{name} split would hold {len(chunk)} tokens; need more text",
                              file=str(out))
        atomic_write_bytes(out / f"{name}.bin", chunk)
        splits[name] = {"file": f"{name}.bin", "sha256": _sha256(chunk),
                        "size_bytes": len(chunk), "tokens": len(chunk)}
    manifest = {"format": DATASET_FORMAT, "version": FORMAT_VERSION, "tokenizer": "bytes",
                "vocab_size": 256, "dtype": "uint8", "source": source, "splits": splits}
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def _generated_source(size_bytes: int, seed: int, val_fraction: float) -> dict[str, Any]:
    return {"kind": "generated", "generator": "english-like-v1", "seed": seed,
            "bytes": size_bytes, "val_fraction": val_fraction}


def prepare_generated(out: str | Path, *, size_bytes: int, seed: int,
                      val_fraction: float) -> dict[str, Any]:
    source = _generated_source(size_bytes, seed, val_fraction)
    return prepare(out, generate_corpus(size_bytes, seed), val_fraction=val_fraction,
                   source=source)


def prepare_text(out: str | Path, text_file: str | Path, *, val_fraction: float
                 ) -> dict[str, Any]:
    try:
        text = Path(text_file).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read corpus: {exc.strerror}", file=str(text_file)) from None
    source = {"kind": "text", "file": str(Path(text_file).resolve()), "bytes": len(text),
              "val_fraction": val_fraction}
    return prepare(out, text, val_fraction=val_fraction, source=source)


@dataclass
class Dataset:
    """A verified prepared dataset; split arrays are read-only memory maps."""

    root: Path
    manifest: dict[str, Any]
    train: np.ndarray
    val: np.ndarray


def read_manifest(root: str | Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.exists():
        raise ConfigError("no prepared dataset here (manifest.json missing); "
                          "run `trainwatch data prepare --out DIR`", file=str(root))
    try:
        manifest = read_record(path, DATASET_FORMAT)
    except FormatError as exc:
        raise ConfigError(str(exc)) from None
    for name in SPLITS:
        entry = manifest.get("splits", {}).get(name)
        if not isinstance(entry, dict) or not {"file", "sha256", "size_bytes"} <= set(entry):
            raise ConfigError(f"manifest has no valid '{name}' split", file=str(path),
                              key=f"splits.{name}")
    return manifest


def load_dataset(root: str | Path, *, checksums: bool = True) -> Dataset:
    """Open a prepared dataset, checking each split's size and SHA-256 against the manifest
    (``checksums=False``: sizes only, for processes whose node already checked the sums)."""
    root = Path(root)
    manifest = read_manifest(root)
    arrays = {}
    for name in SPLITS:
        entry = manifest["splits"][name]
        path = root / entry["file"]
        if not path.exists():
            raise ConfigError(f"{name} split file is missing", file=str(path))
        size = path.stat().st_size
        if size != entry["size_bytes"]:
            raise ConfigError(f"size {size} does not match the manifest ({entry['size_bytes']})",
                              file=str(path))
        tokens = np.memmap(path, dtype=np.uint8, mode="r")
        digest = _sha256(tokens) if checksums else entry["sha256"]
        if digest != entry["sha256"]:
            raise ConfigError(f"sha256 {digest[:16]}... does not match the manifest "
                              f"({entry['sha256'][:16]}...); the file changed or is corrupt",
                              file=str(path))
        arrays[name] = tokens
    return Dataset(root, manifest, arrays["train"], arrays["val"])


def ensure_default_dataset(out: str | Path, *, size_bytes: int, seed: int,
                           val_fraction: float) -> Path:
    """The built-in corpus in ``out``, prepared unless an identical one is already there.

    Preparing is deterministic and every file is replaced atomically, so several
    processes (one per node) doing it at once end with the same files.
    """
    out = Path(out)
    if (out / MANIFEST).exists():
        if read_manifest(out).get("source") == _generated_source(size_bytes, seed, val_fraction):
            return out
    prepare_generated(out, size_bytes=size_bytes, seed=seed, val_fraction=val_fraction)
    return out


def describe(root: str | Path) -> dict[str, Any]:
    """What ``trainwatch data info`` shows: the manifest and whether the files verify."""
    manifest = read_manifest(root)
    load_dataset(root)  # raises on any mismatch
    return {"path": str(Path(root).resolve()), "verified": True, **manifest}


# --------------------------------------------------------------------------- batches

class ShardedBatches:
    """Endless (x, y) batches of ``context``-token windows for one rank.

    The windows of a split are cut at multiples of ``context``; each epoch they are
    permuted with a generator seeded by (seed, epoch), the same on every rank. Each call
    takes the next ``batch_size x world_size`` windows of that order for the whole job,
    and rank r the r-th of every world_size of them, so ranks read disjoint windows and
    the job reads the order front to back. An epoch ends when fewer than that many remain
    (they are dropped). The state is the job's progress, (epoch, windows consumed), the
    same on every rank: a loader of any world size or batch size continues from it
    exactly where the job stopped (docs/checkpoints.md).
    """

    def __init__(self, tokens: np.ndarray, *, context: int, batch_size: int, rank: int,
                 world_size: int, seed: int, shuffle: bool = True):
        self.tokens, self.context, self.batch_size = tokens, context, batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.num_windows = (len(tokens) - 1) // context
        self.global_batch = batch_size * world_size  # windows one call takes, job-wide
        self.batches_per_epoch = self.num_windows // self.global_batch
        if self.batches_per_epoch < 1:
            raise ConfigError(
                f"a split of {len(tokens)} tokens gives {self.num_windows} windows of "
                f"{context}, too few for {world_size} ranks x batch {batch_size}; "
                "prepare more data or lower train.batch_size / model.context")
        self.epoch = 0
        self.consumed = 0  # windows of this epoch's order the job has taken
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    @property
    def position(self) -> int:
        """Batches of this size taken this epoch (what the journal shows)."""
        return self.consumed // self.global_batch

    def _epoch_order(self) -> np.ndarray:
        order = self._order
        if order is None or self._order_epoch != self.epoch:
            order = np.arange(self.num_windows)
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
            self._order, self._order_epoch = order, self.epoch
        return order

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.consumed + self.global_batch > self.num_windows:
            self.epoch += 1
            self.consumed = 0
        start = self.consumed + self.rank
        windows = self._epoch_order()[start:self.consumed + self.global_batch:self.world_size]
        rows = np.stack([self.tokens[w * self.context:w * self.context + self.context + 1]
                         for w in windows]).astype(np.int64)
        self.consumed += self.global_batch
        batch = torch.from_numpy(rows)
        return batch[:, :-1], batch[:, 1:]

    def resized(self, batch_size: int) -> "ShardedBatches":
        """A loader of the same windows and order taking ``batch_size`` per rank a call."""
        return ShardedBatches(self.tokens, context=self.context, batch_size=batch_size,
                              rank=self.rank, world_size=self.world_size, seed=self.seed,
                              shuffle=self.shuffle)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "consumed": self.consumed,
                "seed": self.seed, "world_size": self.world_size,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where ``state`` was taken, at this loader's world size and batch size;
        the order (``seed``) must be the same one."""
        if state.get("seed", self.seed) != self.seed:
            raise ConfigError(f"saved data position has seed={state['seed']}, this run has "
                              f"{self.seed}; the batch order would differ",
                              key="data.shuffle_seed")
        self.epoch = int(state["epoch"])
        self.consumed = consumed_windows(state, self.batch_size, self.world_size)


def consumed_windows(state: dict[str, int], batch_size: int, world_size: int) -> int:
    """The windows of its epoch a saved position had consumed, job-wide. Positions saved
    before ``consumed`` was recorded: batches x their batch size x their world size (the
    given ones where even those are missing)."""
    if "consumed" in state:
        return int(state["consumed"])
    return (int(state["position"]) * int(state.get("batch_size", batch_size))
            * int(state.get("world_size", world_size)))


def manifest_summary(manifest: dict[str, Any]) -> str:
    splits = manifest["splits"]
    return (f"{manifest.get('tokenizer')} tokens: train {splits['train']['size_bytes']:,}, "
            f"val {splits['val']['size_bytes']:,}; source {json.dumps(manifest.get('source'))}")
