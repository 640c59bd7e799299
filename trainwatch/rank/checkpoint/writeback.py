"""Start the kernel writing a file's dirty pages back now, without waiting for them.

A checkpoint's final fsync then waits only for the tail instead of the whole file (the
same idea as RocksDB's ``bytes_per_sync``). Linux has ``sync_file_range(2)`` for this and
Python does not wrap it, so it is called through ctypes; elsewhere (or if the call is
refused) nothing happens and fsync does all the work, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages in the range


def _load():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_sync_file_range = _load()


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Ask for ``length`` bytes at ``offset`` to be written back; False when not possible."""
    if _sync_file_range is None or length <= 0:
        return False
    return _sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE) == 0
