"""A snapshot's payload: the state's tensors as their raw bytes, the rest pickled small.

``torch.save`` of the whole state held the GIL while it pickled and wrote every tensor
through a Python callback: the writer thread took the loop's thread's time (x1.77 step
time at the reference model, x2.55 at 289 MB: docs/benchmarks.md). Here the tensors are
the host copy's arena (capture.py), written and hashed in one call each, calls that
release the GIL; only an index is pickled. Layout, after store.py's header:

    8 bytes   the index's length L (little-endian)
    L bytes   the index, ``torch.save``'d: {"format", "tree": the payload with each arena
              tensor replaced by None, "tensors": [[path, dtype, shape, offset, bytes]...],
              "arena": its bytes}; what is not in the arena (RNG states, rare layouts)
              stays in the tree, pickled
    padding   to a multiple of 64 bytes
    the arena

``decode`` reads it back with views of one buffer for the arena's tensors; anything that
does not add up is Rejected with the reason.
"""

from __future__ import annotations

import collections
import io
import pickle
import time
from typing import Any, Callable

import torch

from trainwatch.rank.memory_snapshots.capture import HostCopy, aligned
from trainwatch.rank.memory_snapshots.store import Rejected

FORMAT = "trainwatch.snapshot-payload/1"
_LENGTH = 8
_DTYPES = {str(d): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool, *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16",
                                               "uint32", "uint64") if hasattr(torch, n)))}

Path = tuple[Any, ...]
_NESTED = (dict, list, tuple, torch.Tensor)
_FLAT = {int, float, bool, str, bytes, complex, type(None)}  # never nested: no walk needed
_SAVED = "torch.save"  # a tensor of a rare layout (sparse, quantized), torch.save'd
_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict, ("torch", "Size"): torch.Size,
    ("builtins", "complex"): complex, ("builtins", "slice"): slice,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset}


def _children(obj: Any, path: Path, walk: Callable[[Any, Path], Any],
              skip_flat: bool = False) -> Any:
    """``obj`` with ``walk`` applied to each child of a dict, list or tuple (as capture.py
    walks them); any other value as it is. ``skip_flat``: a list or tuple holding no
    container or tensor (e.g. an RNG's 624 ints) as it is, unwalked."""
    if isinstance(obj, dict):
        if hasattr(obj, "_metadata"):  # nn.Module.state_dict's: kept by the pickle
            out = type(obj)((k, walk(v, (*path, k))) for k, v in obj.items())
            out._metadata = obj._metadata  # type: ignore[attr-defined]
            return out
        return type(obj)((k, walk(v, (*path, k))) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        if skip_flat and (not set(map(type, obj)) - _FLAT  # C speed: an RNG's 624 ints
                          or not any(isinstance(v, _NESTED) for v in obj)):
            return obj
        return type(obj)(walk(v, (*path, i)) for i, v in enumerate(obj))
    return obj


def index(tree: Any, host: HostCopy) -> bytes:
    """The index of ``tree`` whose arena tensors are ``host``'s: length, pickle, padding
    (the writer thread, holding the GIL: small, no arena bytes, and pickled by the C
    pickler; ``torch.save`` called a Python hook per object, 9 ms for the reference
    model's RNG lists)."""
    entries: list[list[Any]] = []

    def walk(obj: Any, path: Path, into: list[list[Any]]) -> Any:
        if isinstance(obj, torch.Tensor):
            slot = host.slots.get(id(obj))
            if slot is not None:
                into.append([list(path), str(obj.dtype), list(obj.shape), *slot])
            else:  # not in the arena (an RNG state, a rare layout): its bytes here
                into.append([list(path), *_loose(obj)])
            return None
        if id(obj) in host.frozen:  # kept as it was since the layout (rewalk.py): once
            part = host.index_memo.get((id(obj), path))
            if part is None:
                mine: list[list[Any]] = []
                part = host.index_memo[id(obj), path] = (_children(
                    obj, path, lambda v, p: walk(v, p, mine), skip_flat=True), mine)
            if hasattr(obj, "_metadata"):
                part[0]._metadata = obj._metadata
            into.extend(part[1])
            return part[0]
        return _children(obj, path, lambda v, p: walk(v, p, into), skip_flat=True)

    skeleton = walk(tree, (), entries)
    raw = pickle.dumps({"format": FORMAT, "tree": skeleton, "tensors": entries,
                        "arena": host.arena.numel()}, protocol=5)
    head = len(raw).to_bytes(_LENGTH, "little") + raw
    return head.ljust(aligned(len(head)), b"\0")


def _loose(tensor: torch.Tensor) -> list[Any]:
    """A tensor outside the arena as [dtype, shape, bytes], or ["torch.save", bytes]."""
    tensor = tensor.detach()
    if (tensor.layout == torch.strided and not tensor.is_quantized
            and str(tensor.dtype) in _DTYPES):
        flat = tensor.to("cpu").contiguous().reshape(-1)
        return [str(tensor.dtype), list(tensor.shape), flat.view(torch.uint8).numpy().tobytes()
                if flat.numel() else b""]
    buf = io.BytesIO()
    torch.save(tensor.to("cpu"), buf)
    return [_SAVED, buf.getvalue()]


class _Unpickler(pickle.Unpickler):
    """Plain containers and values only (what ``index`` writes), as ``torch.load``'s
    ``weights_only`` allows: never a class a file could name to run code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and str(getattr(torch, name, None)) in _DTYPES:
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a snapshot index")


def write(f: Any, tree: Any, host: HostCopy) -> float:
    """Write ``tree``'s payload to ``f`` (store.py's hashing file): the index, then the
    arena in one write. Returns the thread's CPU seconds building the index: the part that
    holds the GIL, which the loop's thread waits for (cadence.py counts it)."""
    cpu = time.thread_time()
    head = index(tree, host)
    gil = time.thread_time() - cpu
    f.write(head)
    if host.arena.numel():
        f.write(host.arena.numpy())
    return gil


def decode(data: bytearray) -> Any:
    """The payload's tree, its arena tensors views of ``data``; Rejected when it is not a
    whole payload of this format."""
    if len(data) < _LENGTH:
        raise Rejected("payload shorter than its index length")
    length = int.from_bytes(data[:_LENGTH], "little")
    if length > len(data) - _LENGTH:
        raise Rejected(f"payload index of {length} bytes past the payload's end")
    try:
        doc = _Unpickler(io.BytesIO(memoryview(data)[_LENGTH:_LENGTH + length])).load()
    except Exception as exc:
        raise Rejected(f"unreadable payload index: {type(exc).__name__}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise Rejected("not a trainwatch snapshot payload")
    start = aligned(_LENGTH + length)
    if not isinstance(doc.get("arena"), int) or start + doc["arena"] != len(data):
        raise Rejected(f"payload of {len(data)} bytes, its index says {start} + "
                       f"{doc.get('arena')!r}")
    whole = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    table = {}
    for entry in doc.get("tensors") or []:
        path, tensor = _tensor(entry, whole, start)
        table[path] = tensor

    placed: list[Path] = []
    above = {path[:i] for path in table for i in range(len(path))}

    def walk(obj: Any, path: Path) -> Any:
        if path in table:
            placed.append(path)
            return table[path]
        return _children(obj, path, walk) if path in above else obj

    tree = walk(doc["tree"], ())
    if len(placed) != len(table):
        raise Rejected("the payload index names tensors its tree has no place for")
    return tree


def _tensor(entry: Any, whole: torch.Tensor, start: int) -> tuple[Path, torch.Tensor]:
    if isinstance(entry, list) and len(entry) in (3, 4) and isinstance(entry[0], list):
        return tuple(entry[0]), _loose_tensor(entry)
    try:
        path, dtype_name, shape, offset, size = entry
        dtype = _DTYPES[dtype_name]
        shape = [int(n) for n in shape]
        numel = 1
        for n in shape:
            numel *= n
        ok = (isinstance(path, list) and all(isinstance(n, int) and n >= 0 for n in shape)
              and isinstance(offset, int) and isinstance(size, int) and offset >= 0
              and offset % 64 == 0 and numel * dtype.itemsize == size
              and start + offset + size <= whole.numel())
    except (TypeError, ValueError, KeyError):
        ok = False
    if not ok:
        raise Rejected(f"payload index entry out of bounds or of an unknown type: "
                       f"{str(entry)[:120]}")
    if size == 0:
        return tuple(path), torch.empty(shape, dtype=dtype)
    raw = whole[start + offset:start + offset + size]
    return tuple(path), raw.view(dtype).view(shape)


def _loose_tensor(entry: list[Any]) -> torch.Tensor:
    try:
        if entry[1] == _SAVED and isinstance(entry[2], bytes):
            out = torch.load(io.BytesIO(entry[2]), map_location="cpu", weights_only=True)
            if isinstance(out, torch.Tensor):
                return out
        else:
            _, dtype_name, shape, data = entry
            dtype = _DTYPES[dtype_name]
            if isinstance(data, bytes) and all(isinstance(n, int) and n >= 0 for n in shape):
                if not data:
                    return torch.empty(shape, dtype=dtype)
                return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
    except Exception:
        pass
    raise Rejected(f"payload index entry not a tensor: {str(entry)[:120]}")
