"""The checkpoint format: directory names, the manifest, and verification against it.

A checkpoint is a directory ``step-NNNNNNNN`` holding state files and ``manifest.json``
(written last).  The manifest records a digest and the size of every file, so a checkpoint
can be verified without trusting anything else.  docs/checkpoints.md is the contract;
``FORMAT_VERSION`` is its version.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import xxhash

from trainwatch.checkpoint_format.dcp import METADATA as DCP_METADATA
from trainwatch.contract import layout
from trainwatch.contract.layout import LEGACY_WEIGHTS_CONFIG_KEY, WEIGHTS_CONFIG_DIGEST_KEY
from trainwatch.errors import FormatError
from trainwatch.rundir.safe_read import check_format, open_run_file, read_run_file

FORMAT = "trainwatch.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
# The Hugging Face Trainer's own folder, sealed with a manifest by trainwatch's callback
# (trainwatch.integrations.transformers): listed, verified and resumed like ours.
FRAMEWORK_STEP_DIR = re.compile(r"^checkpoint-(\d+)$")
# Prefixes of directories that are never checkpoints: a save in progress (or one a crash
# interrupted) and a checkpoint being replaced.  Readers ignore them; the saver removes them.
INCOMPLETE_PREFIXES = (".tmp-", ".replaced-")
HASH_CHUNK = 8 << 20
READ_CHUNK = 1 << 20  # what digest_file reads at a time: fits the CPU's cache
# The digest new manifests record per file.  xxh3-128 hashes at memory speed (14x sha256
# here: 12 ms for 289 MB against 167), so hashing never paces a save to fast storage or a
# restart's check of the checkpoint it loads; it catches torn and corrupted files (any bit
# flip, a 2^-128 chance to miss other damage), not deliberate tampering.  Manifests that
# record sha256 (written before) still verify.
DIGEST = "xxh3_128"
_DIGESTS: dict[str, Callable[[], Any]] = {DIGEST: xxhash.xxh3_128, "sha256": hashlib.sha256}
# The manifest's ``layout`` of a checkpoint whose shared state is sharded (FSDP2, DTensor):
# torch.distributed.checkpoint files (``.metadata`` and each rank's ``.distcp`` shards)
# instead of ``NAME.pt``; without ``layout`` a checkpoint is data parallel (rank 0's files).
# Older readers refuse such a manifest (its ``.metadata`` entry is a name they reject).
LAYOUT_DCP = "dcp"
# A manifest lists a checkpoint's files (a few per rank): 32 MiB is ~100,000 ranks' entries.
MAX_MANIFEST_BYTES = 32 << 20


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file_name(rank: int) -> str:
    return layout.rank_file_name(rank, ".pt")


def step_of(name: str) -> int | None:
    match = STEP_DIR.match(name) or FRAMEWORK_STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def new_digest(algorithm: str = DIGEST) -> Any:
    """A running hash of ``algorithm`` (a key a manifest entry holds): update(), hexdigest()."""
    return _DIGESTS[algorithm]()


def digest_algorithm(entry: dict[str, Any]) -> str | None:
    """Which digest a manifest's file entry records (None when it holds none we know)."""
    return next((name for name in _DIGESTS if isinstance(entry.get(name), str)), None)


def digest_file(path: Path, algorithm: str = DIGEST,
                progress: Callable[[int], None] | None = None) -> str:
    """The file's digest; SkippedFile (a FormatError) for anything but a regular file, which
    would block (a FIFO) or never end (a device)."""
    digest = new_digest(algorithm)
    fd, _ = open_run_file(path)
    # One small buffer, reused: the hash reads what was just copied while it is still in
    # the CPU's cache, and no fresh 8 MiB is faulted in per chunk (half the CPU time).
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    with os.fdopen(fd, "rb", buffering=0) as fh:
        while count := fh.readinto(buffer):
            digest.update(view[:count])
            if progress:
                progress(count)
    return digest.hexdigest()


def weights_config_digest(manifest: dict[str, Any]) -> str | None:
    """The digest of the config that decided the checkpoint's weights (its older name in
    manifests written before it was renamed)."""
    value = manifest.get(WEIGHTS_CONFIG_DIGEST_KEY, manifest.get(LEGACY_WEIGHTS_CONFIG_KEY))
    return value if isinstance(value, str) else None


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory; FormatError says what is wrong with it.

    Through the safe reader: a FIFO there blocked every reader (list, verify, diagnose, the
    controller's restarts) for ever, and a link to /dev/zero read without end."""
    path = directory / MANIFEST
    try:
        raw = read_run_file(path, max_bytes=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise FormatError(f"{path}: missing (the save did not finish, or it was deleted)") from None
    except OSError as exc:
        raise FormatError(f"{path}: unreadable ({exc.strerror})") from None
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: torn or not JSON ({exc})") from None
    manifest = check_format(obj, FORMAT, str(path))
    files = manifest.get("files")
    if not isinstance(files, dict) or not files or not isinstance(manifest.get("step"), int):
        raise FormatError(f"{path}: no 'files' table or 'step'")
    for name, entry in files.items():
        hidden = name.startswith(".") and not (name == DCP_METADATA
                                               and manifest.get("layout") == LAYOUT_DCP)
        if ("/" in name or hidden or not isinstance(entry, dict)
                or digest_algorithm(entry) is None
                or not isinstance(entry.get("bytes"), int)):
            raise FormatError(f"{path}: bad entry for file {name!r}")
    return manifest


@dataclass
class Verification:
    """The outcome of checking one checkpoint directory against its manifest."""

    path: Path
    ok: bool
    step: int | None = None
    manifest: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)   # "FILE: what is wrong"
    bytes: int = 0

    @property
    def reason(self) -> str:
        return "; ".join(self.problems) if self.problems else "ok"

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "ok": self.ok,
                "bytes": self.bytes, "problems": list(self.problems)}


def verify(directory: str | Path, *, full: bool = True,
           progress: Callable[[int], None] | None = None) -> Verification:
    """Check every file against the manifest: presence and size, and with ``full`` its digest.

    Files in the directory that the manifest does not list are reported too: a checkpoint
    directory is written whole, so a stray file means someone changed it.
    """
    directory = Path(directory)
    result = Verification(directory, ok=False, step=step_of(directory.name))
    try:
        manifest = read_manifest(directory)
    except FormatError as exc:
        result.problems.append(f"{MANIFEST}: {str(exc).split(': ', 1)[-1]}")
        return result
    result.manifest, result.step = manifest, manifest["step"]
    if step_of(directory.name) not in (None, manifest["step"]):
        result.problems.append(f"{MANIFEST}: says step {manifest['step']}, "
                               f"directory name says {step_of(directory.name)}")
    for name, entry in sorted(manifest["files"].items()):
        size, problem = check_file(directory, name, entry, full=full, progress=progress)
        result.bytes += size
        if problem:
            result.problems.append(problem)
    result.problems.extend(layout_problems(manifest))
    listed = set(manifest["files"]) | {MANIFEST}
    try:
        strays = sorted(p.name for p in directory.iterdir() if p.name not in listed)
    except OSError:
        strays = []
    result.problems.extend(f"{name}: not listed in the manifest" for name in strays)
    result.ok = not result.problems
    return result


def check_file(directory: Path, name: str, entry: dict[str, Any], *, full: bool = True,
               progress: Callable[[int], None] | None = None) -> tuple[int, str | None]:
    """One file of a checkpoint against its manifest entry: (its size, 0 when it cannot be
    read; what is wrong, or None). Presence and size, and with ``full`` its digest."""
    path = directory / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0, f"{name}: missing"
    except OSError as exc:
        return 0, f"{name}: unreadable ({exc.strerror})"
    if size != entry["bytes"]:
        return size, f"{name}: size {size} bytes, manifest says {entry['bytes']}"
    if not full:
        return size, None
    algorithm = digest_algorithm(entry)
    assert algorithm is not None  # read_manifest refused entries without one
    try:
        actual = digest_file(path, algorithm, progress)
    except (OSError, FormatError) as exc:
        return size, hash_problem(name, exc)
    if actual != entry[algorithm]:
        return size, digest_mismatch(name, algorithm)
    return size, None


def hash_problem(name: str, exc: OSError | FormatError) -> str:
    """How a file that could not be read through to its digest is worded, wherever it is
    hashed (here, and rank/checkpoint/verified_load.py as it loads)."""
    if isinstance(exc, FormatError):
        return f"{name}: {str(exc).split(': ', 1)[-1]}"
    return f"{name}: unreadable ({exc.strerror})"


def digest_mismatch(name: str, algorithm: str) -> str:
    """A file whose bytes are not those its manifest entry's digest was taken of."""
    return f"{name}: {algorithm} mismatch (content changed or corrupt)"


def layout_problems(manifest: dict[str, Any]) -> list[str]:
    """What a sharded (``layout: dcp``) manifest's own records say is missing from its
    ``files``: the DCP metadata, a shard file the metadata names (``dcp.files``, recorded at
    save time from the metadata), a rank's file. A data-parallel manifest has none."""
    if manifest.get("layout") is None:
        return []
    if manifest.get("layout") != LAYOUT_DCP:
        return [f"{MANIFEST}: unknown layout {manifest.get('layout')!r}"]
    files, sharded = manifest["files"], manifest.get("dcp")
    world = manifest.get("world_size")
    if not isinstance(sharded, dict) or not isinstance(sharded.get("files"), list) or (
            not isinstance(world, int) or world < 1):
        return [f"{MANIFEST}: a dcp layout without its 'dcp' files or world size"]
    # A framework's sharded save (sealed by integrations/) has no per-rank trainwatch files.
    ranks = () if manifest.get("framework") else range(world)
    needed = [DCP_METADATA, *sharded["files"], *(rank_file_name(r) for r in ranks)]
    return [f"{name}: not in the manifest's files (the checkpoint does not hold the whole "
            "state)" for name in dict.fromkeys(needed) if name not in files]
