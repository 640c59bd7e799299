"""``trainwatch checkpoint verify`` of a DCP checkpoint: what can be checked without loading it.

DCP records no digests, so this checks what its ``.metadata`` promises: that it parses
(through DCP's own reader, which unpickles it: so this runs here, beside torch, never in
a torch-free reader), that every storage file it names is there, and that each is at least
as long as its items' ``offset + length`` (a truncated shard is BAD). docs/checkpoints.md,
"Declared DCP checkpoints". A trainwatch checkpoint of sharded state (``layout: dcp``) has a
manifest with every file's digest, and is also checked against its ``.metadata`` here
(``verify_checkpoint``): the files it names must all be in the manifest.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from trainwatch.checkpoint_format.dcp import METADATA
from trainwatch.checkpoint_format.manifest import LAYOUT_DCP, Verification, step_of, verify


def read_metadata(directory: Path) -> Any:
    """DCP's ``Metadata`` of ``directory``; ValueError saying what is wrong with the file."""
    path = directory / METADATA
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ValueError("missing (the save did not finish, or it was deleted)") from None
    except OSError as exc:
        raise ValueError(f"unreadable ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the reader, a device never end
        raise ValueError("not a regular file")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # a torn or foreign pickle raises anything
        raise ValueError(f"corrupt or not DCP metadata ({type(exc).__name__}: "
                         f"{str(exc)[:200]})") from None
    if not isinstance(getattr(metadata, "storage_data", None), dict) or not isinstance(
            getattr(metadata, "state_dict_metadata", None), dict):
        raise ValueError(f"not DCP metadata (a {type(metadata).__name__})")
    return metadata


def needed_sizes(metadata: Any) -> dict[str, int]:
    """{storage file: the least size its items need (max offset + length)}; ValueError for
    an entry that names no plain file of the directory."""
    needed: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if (not isinstance(name, str) or not name or "/" in name or name in (".", "..")
                or not isinstance(offset, int) or not isinstance(length, int)):
            raise ValueError(f"bad storage entry for {getattr(index, 'fqn', index)!r}")
        needed[name] = max(needed.get(name, 0), offset + length)
    return needed


def verify_dcp(directory: str | Path, step: int | None = None) -> Verification:
    """OK when ``.metadata`` parses and every file it names is there and long enough;
    ``step``: the declared one (else the directory's name says it)."""
    directory = Path(directory)
    result = Verification(directory, ok=False,
                          step=step if step is not None else step_of(directory.name))
    try:
        needed = needed_sizes(read_metadata(directory))
    except ValueError as exc:
        result.problems.append(f"{METADATA}: {exc}")
        return result
    for name, least in sorted(needed.items()):
        try:
            st = os.stat(directory / name)
        except FileNotFoundError:
            result.problems.append(f"{name}: missing (named by {METADATA})")
            continue
        except OSError as exc:
            result.problems.append(f"{name}: unreadable ({exc.strerror})")
            continue
        if not stat.S_ISREG(st.st_mode):
            result.problems.append(f"{name}: not a regular file")
            continue
        result.bytes += st.st_size
        if st.st_size < least:
            result.problems.append(f"{name}: {st.st_size} bytes, {METADATA} needs at least "
                                   f"{least} (truncated)")
    result.ok = not result.problems
    return result


def covers(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """Problems of a sharded (``layout: dcp``) trainwatch checkpoint beyond its digests:
    the files its ``.metadata`` names that the manifest does not list, or lists shorter
    than the metadata needs (the checkpoint would not hold the whole state)."""
    try:
        needed = needed_sizes(read_metadata(directory))
    except ValueError as exc:
        return [f"{METADATA}: {exc}"]
    files = manifest.get("files") or {}
    problems = []
    for name, least in sorted(needed.items()):
        if name not in files:
            problems.append(f"{name}: named by {METADATA}, not in the manifest")
        elif files[name]["bytes"] < least:
            problems.append(f"{name}: {files[name]['bytes']} bytes, {METADATA} needs {least}")
    return problems


def verify_checkpoint(directory: str | Path, progress: Any = None) -> Verification:
    """A trainwatch checkpoint against its manifest (every file's size and digest), and a
    sharded one also against its ``.metadata`` (``covers``)."""
    result = verify(directory, progress=progress)
    if result.ok and result.manifest and result.manifest.get("layout") == LAYOUT_DCP:
        result.problems += covers(Path(directory), result.manifest)
        result.ok = not result.problems
    return result
