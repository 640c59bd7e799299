"""One rank's snapshots on host memory that outlives its process: files under /dev/shm.

A snapshot is ONE file, ``<root>/rank-NNNNN/step-<step>.snap``: a fixed-size header
(rank, step, world size, the digest of the payload and its algorithm, its bytes, the config
hash, when it was sealed) and the payload (the rank's state: payload.py's raw tensors and
small index; opaque bytes to whoever copies the file). It is written as a hidden
temporary file and renamed into place only when whole
(``seal``), so a rank killed mid-write leaves the previous snapshot as it was; a file whose
payload does not hash to its header's digest is rejected (``verify``).

At most two snapshots per rank exist at once (double buffering): the newest one every rank
has sealed, kept until a newer one is, and the one being written (``retain``).

For peer copies (peer_ring.py, peer_store.py): ``sealed(folder)`` lists the snapshots of
any folder as ``Sealed(rank, step, digest, path)`` from their headers alone, ``verify`` checks
one whole, and ``held_folder`` is where the copies a rank keeps for another rank go.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import xxhash

from trainwatch.contract.layout import file_safe, rank_file_name

FORMAT = "trainwatch.memory-snapshot"
VERSION = 3                  # 3: payload.py's raw tensors (2: torch.save, xxh3; 1: sha256)
TORCH_SAVED = 2              # a torch.save'd payload: the dying gasp's and the rank parts'
MAGIC = b"TWSNAP01"
HEADER_BYTES = 1024          # magic + JSON header, padded: the payload starts here
SUFFIX = ".snap"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
OWNER_FILE = "run-dir"       # <root>/run-dir: the run directory the snapshots belong to
HELD_DIR = "held"            # <root>/held/rank-NNNNN/: copies kept for other ranks (peers)
SHM = Path("/dev/shm")
FILE_MODE = 0o600
DIR_MODE = 0o700
_CHUNK = 8 << 20
# The payload's digest catches a torn or altered file, not an attacker (peer copies carry
# their own HMAC): xxh3-128 hashes at memory speed, sha256 took as long as serializing the
# state (300 MB: ~0.24 s of the writer's ~0.47 s of CPU on the 2-core CI VM).
DIGEST = "xxh3_128"
_DIGESTS: dict[str, Callable[[], Any]] = {DIGEST: xxhash.xxh3_128, "sha256": hashlib.sha256}


class Rejected(ValueError):
    """A snapshot file that is not whole or not this job's: the reason is the message."""


class Full(OSError):
    """The tmpfs has no room for the snapshot: skipped, counted, never the job's problem."""


@dataclass(frozen=True)
class Sealed:
    """A sealed snapshot, as its header says (``verify`` checks the payload against it)."""

    rank: int
    step: int
    digest: str
    path: Path
    bytes: int = 0
    world_size: int | None = None
    config_hash: str | None = None
    sealed_at: float | None = None


def default_root(run_dir: str | Path, shm: Path = SHM) -> tuple[Path | None, str | None]:
    """``/dev/shm/trainwatch-<uid>/<run id>``, or (None, why not): the run id is the run
    directory's name and a digest of its absolute path (the same at every restart, another
    for another run); the uid keeps users of one node apart."""
    if not shm.is_dir():
        return None, f"{shm} is absent (no tmpfs to keep snapshots in)"
    if not os.access(shm, os.W_OK | os.X_OK):
        return None, f"{shm} is not writable"
    resolved = Path(run_dir).resolve()
    run_id = f"{file_safe(resolved.name)}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}"
    return shm / f"trainwatch-{os.geteuid()}" / run_id, None


def rank_folder(root: Path, rank: int) -> Path:
    return root / rank_file_name(rank, "")


def held_folder(root: Path, rank: int) -> Path:
    """Where copies of ``rank``'s snapshots kept by another rank go (peer copies)."""
    return root / HELD_DIR / rank_file_name(rank, "")


def snapshot_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:012d}{SUFFIX}"


def make_folder(folder: Path) -> Path:
    """Create a rank's ``folder`` in the run's root, both 0700 and owned by us (and the
    ``trainwatch-<uid>`` folder above a default root); refuse a symlink or a folder of
    another user, where another user's process could read or swap snapshots."""
    folder.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    ours = [folder, folder.parent]
    if folder.parent.parent.name == f"trainwatch-{os.geteuid()}":
        ours.append(folder.parent.parent)
    for path in ours:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            raise PermissionError(errno.EPERM, "not a plain folder", str(path))
        if info.st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, f"owned by uid {info.st_uid}", str(path))
        os.chmod(path, DIR_MODE)
    return folder


def claim(root: Path, run_dir: Path) -> None:
    """Note in ``root`` which run directory its snapshots belong to (``sweep`` reads it)."""
    path = root / OWNER_FILE
    if not path.exists():
        tmp = root / f"{TMP_PREFIX}{OWNER_FILE}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
        with os.fdopen(fd, "w") as f:
            f.write(str(Path(run_dir).resolve()))
        os.replace(tmp, path)


def sweep(parent: Path) -> list[Path]:
    """Remove the snapshot roots in ``parent`` whose run directory is gone (deleted, as a
    test's or a finished experiment's is): what a run that never finished left in memory.
    Only a run directory that is certainly absent (ENOENT) counts: an unreachable shared
    file system is not a reason to drop a live run's snapshots."""
    gone: list[Path] = []
    try:
        roots = [p for p in parent.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return gone
    for root in roots:
        try:  # a root not claimed yet (a rank between make_folder and claim) is skipped
            owner = (root / OWNER_FILE).read_text().strip()
        except (OSError, ValueError):
            continue
        try:
            os.stat(owner)
        except FileNotFoundError:
            shutil.rmtree(root, ignore_errors=True)
            gone.append(root)
        except (OSError, ValueError):
            continue
    return gone


def sweep_aside(parent: Path) -> threading.Thread | None:
    """``sweep`` on a daemon thread, by the node's first rank only (``LOCAL_RANK`` 0, or
    none set): the ranks of a node share ``parent``, and reading every root's owner there
    (~80 on a busy machine: 2-6 ms) held up the resume that prepares the snapshots on
    every rank. Nothing waits for it: it removes only roots whose run directory is gone."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    thread = threading.Thread(target=sweep, args=(parent,), daemon=True,
                              name="trainwatch-snapshot-sweep")
    thread.start()
    return thread


# --------------------------------------------------------------------------- reading

def read_header(path: Path) -> dict[str, Any]:
    """The header of a snapshot file; Rejected when it is not one (a plain file only)."""
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode):
            raise Rejected("not a plain file (a link or a special file)")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as exc:
        raise Rejected(f"unreadable: {exc.strerror or exc}") from None
    if len(head) < HEADER_BYTES or not head.startswith(MAGIC):
        raise Rejected("not a trainwatch memory snapshot (no header)")
    try:
        header = json.loads(head[len(MAGIC):].decode())
    except (UnicodeDecodeError, ValueError):
        raise Rejected("unreadable header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise Rejected("not a trainwatch memory snapshot header")
    for key in ("rank", "step", "bytes"):
        if isinstance(header.get(key), bool) or not isinstance(header.get(key), int):
            raise Rejected(f"header has no integer {key}")
    if not isinstance(header.get("digest"), str):
        raise Rejected("header has no digest")
    if header.get("digest_algorithm", "sha256") not in _DIGESTS:
        raise Rejected(f"unknown digest algorithm {header.get('digest_algorithm')!r}")
    if info.st_size != HEADER_BYTES + header["bytes"]:
        raise Rejected(f"torn: {info.st_size - HEADER_BYTES} payload bytes, the header says "
                       f"{header['bytes']}")
    return header


def _sealed(path: Path, header: dict[str, Any]) -> Sealed:
    return Sealed(header["rank"], header["step"], header["digest"], path, header["bytes"],
                  header.get("world_size"), header.get("config_hash"), header.get("sealed_at"))


def sealed_file(path: Path) -> Sealed:
    """One snapshot file as its header says (no payload read); Rejected when it is not one."""
    return _sealed(path, read_header(path))


def sealed(folder: Path) -> list[Sealed]:
    """The sealed snapshots in ``folder``, newest step first, from their headers (no payload
    read); temporary files, links, special files and files that are not snapshots are
    skipped. Any folder: a rank's own, or one of ``held_folder``'s."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    out = []
    for name in names:
        if not (name.startswith(STEP_PREFIX) and name.endswith(SUFFIX)):
            continue
        try:
            out.append(_sealed(folder / name, read_header(folder / name)))
        except Rejected:
            continue
    return sorted(out, key=lambda s: s.step, reverse=True)


def hasher(header: dict[str, Any]) -> Any:
    """A fresh hash object of the algorithm ``header`` names (``read_header`` checked it);
    snapshots of version 1 name none and are sha256."""
    return _DIGESTS[header.get("digest_algorithm", "sha256")]()


def verify(path: Path) -> Sealed:
    """The snapshot at ``path`` when its payload hashes to its header's digest; else Rejected."""
    header = read_header(path)
    digest = hasher(header)
    try:
        with open(path, "rb") as f:
            f.seek(HEADER_BYTES)
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        raise Rejected(f"unreadable: {exc.strerror or exc}") from None
    if digest.hexdigest() != header["digest"]:
        raise Rejected("digest mismatch: the payload is not what was sealed")
    return _sealed(path, header)


def payload(path: Path) -> bytearray:
    """The payload bytes of a snapshot, in one writable buffer that the tensors read back
    are views of (no second copy); ``verify`` it, or hash it, first."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size - HEADER_BYTES
        data = bytearray(max(0, size))
        f.seek(HEADER_BYTES)
        got = f.readinto(data)
    if got != len(data):
        raise Rejected(f"torn: {got} payload bytes read of {len(data)}")
    return data


# --------------------------------------------------------------------------- writing

class _Hashing:
    """A file that hashes what is written to it, so the digest costs no second read. Both
    the hash (xxhash) and the write (FileIO) release the GIL over a large buffer: the
    payload's arena goes through in one call each while the loop's thread runs."""

    def __init__(self, f: BinaryIO):
        self.f, self.digest, self.bytes = f, _DIGESTS[DIGEST](), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.bytes += len(view)
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def free_bytes(folder: Path) -> int:
    vfs = os.statvfs(folder)
    return vfs.f_bavail * vfs.f_frsize


def seal(folder: Path, *, rank: int, step: int, world_size: int, config_hash: str | None,
         write: Callable[[Any], None], need: int = 0, reserve: int = 0,
         version: int = VERSION) -> Sealed:
    """Write a snapshot of ``step`` into ``folder`` with ``write(file)``, then rename it into
    place. Full when the tmpfs would keep less than ``reserve`` bytes free after ``need``
    more (checked first), or ran out while writing; the temporary file is removed either way.
    ``version`` says how ``write`` encodes the payload (VERSION, or TORCH_SAVED)."""
    if need and free_bytes(folder) - need < reserve:
        raise Full(errno.ENOSPC, f"{need} bytes would leave less than {reserve} free",
                   str(folder))
    final = folder / snapshot_name(step)
    tmp = folder / f"{TMP_PREFIX}{snapshot_name(step)}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * HEADER_BYTES)
            hashing = _Hashing(f)
            write(hashing)
            header = {"format": FORMAT, "version": version, "rank": rank, "step": step,
                      "world_size": world_size, "digest": hashing.digest.hexdigest(),
                      "digest_algorithm": DIGEST,
                      "bytes": hashing.bytes, "config_hash": config_hash,
                      "sealed_at": time.time(), "pid": os.getpid()}
            text = MAGIC + json.dumps(header).encode()
            if len(text) > HEADER_BYTES:
                raise ValueError(f"snapshot header over {HEADER_BYTES} bytes")
            f.seek(0)
            f.write(text.ljust(HEADER_BYTES, b" "))
        os.replace(tmp, final)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise Full(exc.errno, exc.strerror, str(folder)) from None
        raise
    return _sealed(final, header)


def retain(folder: Path, keep: set[int]) -> list[Path]:
    """Remove the sealed snapshots whose step is not in ``keep``, and temporary files left by
    a writer that is gone (another pid: a killed rank's torn write); returns what went."""
    removed: list[Path] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    mine = f".{os.getpid()}"
    for name in names:
        path = folder / name
        if name.startswith(TMP_PREFIX) and not name.endswith(mine):
            pass
        elif name.startswith(STEP_PREFIX) and name.endswith(SUFFIX):
            step = name[len(STEP_PREFIX):-len(SUFFIX)]
            if not step.isdigit() or int(step) in keep:
                continue
        else:
            continue
        try:
            if stat.S_ISREG(os.lstat(path).st_mode) or os.path.islink(path):
                path.unlink()
                removed.append(path)
        except OSError:
            continue
    return removed
