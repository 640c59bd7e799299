"""The stream DCP writes a sharded checkpoint's files through: hashed as written, and
handed to the kernel's writeback window by window when the files will be fsynced.

Before: each rank read its shards back after dcp.save to hash them, and all of a shard's
writeback waited for DCP's fsync at the end. Now the digest is of the bytes as written
and each finished 8 MiB window is started on its way to disk while DCP goes on."""

import os

import xxhash

from trainwatch.rank.checkpoint import dcp_hashing
from trainwatch.rank.checkpoint.dcp_hashing import HashingFileSystem
from trainwatch.rank.checkpoint.writer import HASH_WINDOW


def test_a_written_file_is_hashed_and_its_windows_start_writeback(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(dcp_hashing, "start_writeback",
                        lambda fd, offset, length: started.append((offset, length)))
    data = os.urandom(2 * HASH_WINDOW + 12345)
    fs = HashingFileSystem(writeback=True)
    with fs.create_stream(tmp_path / "__0_0.distcp.tmp", "wb") as stream:
        for i in range(0, len(data), 3 << 20):  # in pieces, as torch.save writes
            stream.write(memoryview(data)[i:i + (3 << 20)])
    fs.rename(tmp_path / "__0_0.distcp.tmp", tmp_path / "__0_0.distcp")
    assert fs.written == {"__0_0.distcp": {"xxh3_128": xxhash.xxh3_128(data).hexdigest(),
                                           "bytes": len(data)}}
    assert started == [(0, HASH_WINDOW), (HASH_WINDOW, HASH_WINDOW)]  # the tail: fsync's
    assert (tmp_path / "__0_0.distcp").read_bytes() == data


def test_without_fsync_nothing_is_written_back_and_a_failed_file_is_not_recorded(
        tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(dcp_hashing, "start_writeback", lambda *a: started.append(a))
    fs = HashingFileSystem()
    with fs.create_stream(tmp_path / "a", "wb") as stream:
        stream.write(b"x" * (HASH_WINDOW + 1))
    try:
        with fs.create_stream(tmp_path / "b", "wb") as stream:
            stream.write(b"y")
            raise OSError(28, "No space left on device")
    except OSError:
        pass
    assert started == [] and list(fs.written) == ["a"]
