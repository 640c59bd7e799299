"""The run-directory reader against hostile files: each costs that one file, with a reason,
and none blocks, reads past its cap or raises."""

from __future__ import annotations

import os
import time

import pytest

from rundir_helpers import hostile
from trainwatch.rundir.safe_read import (SKIP_REASONS, RunFolder, SkippedFile, read_run_file, read_run_file_tail)
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.jsonl import read_jsonl

pytestmark = pytest.mark.timeout(60)  # a reader that blocks on a FIFO fails here, not hangs


def write_status(run: RunDir, rank: int, **extra) -> None:
    now = time.time()
    run.write_status(rank, {"rank": rank, "pid": os.getpid(), "state": "running",
                            "heartbeat_at": now, "step": 1, **extra})



def test_each_hostile_status_file_is_skipped_with_its_reason_and_the_rest_served(tmp_path):
    run = RunDir(tmp_path / "run").create()
    write_status(run, 0)
    write_status(run, 1)
    expected = hostile(run, tmp_path)
    result = run.statuses()
    assert [r["rank"] for r in result.records] == [0, 1]
    got = {os.path.basename(s.path): s.code for s in result.skipped}
    assert got == expected
    assert set(got.values()) <= set(SKIP_REASONS)


def test_a_link_inside_the_run_directory_is_followed(tmp_path):
    run = RunDir(tmp_path / "run").create()
    write_status(run, 0)
    os.replace(run.status_file(0), run.tmp_dir / "real.json")
    os.symlink("../tmp/real.json", run.status_file(0))
    assert [r["rank"] for r in run.statuses().records] == [0]


def test_journal_and_metrics_readers_refuse_special_files_and_overlong_lines(tmp_path):
    run = RunDir(tmp_path / "run").create()
    os.mkfifo(run.journal_file)
    assert [s.code for s in run.journal().skipped] == ["special_file"]
    run.metrics_file(0).write_bytes(b'{"v":1,"step":1}\n' + b"x" * 5000 + b"\n"
                                    + b"[" * 50_000 + b"\n" + b'{"v":1,"step":2}\n')
    result = read_jsonl(run.metrics_file(0), run.root, max_line_bytes=4096)
    assert [r["step"] for r in result.records] == [1, 2]
    assert [(s.line, s.code) for s in result.skipped] == [(2, "too_large"), (3, "too_large")]
    result = read_jsonl(run.metrics_file(0), run.root)
    assert [(s.line, s.code) for s in result.skipped] == [(2, "not_json"), (3, "too_deep")]


def test_whole_file_readers_never_block_or_read_past_the_cap(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(SkippedFile) as info:
        read_run_file(tmp_path / "fifo")
    assert info.value.reason == "special_file"
    with pytest.raises(SkippedFile) as info:
        read_run_file_tail("/dev/zero")
    assert info.value.reason == "special_file"
    (tmp_path / "big").write_bytes(b"x" * 100)
    with pytest.raises(SkippedFile) as info:
        read_run_file(tmp_path / "big", max_bytes=99)
    assert info.value.reason == "too_large"
    assert read_run_file_tail(tmp_path / "big", max_bytes=10) == b"x" * 10


def test_a_linked_folder_is_checked_like_a_linked_file(tmp_path):
    """The status folder itself may be a link: followed inside the run directory, refused
    out of it (a file read through it is checked where it really is)."""
    run = RunDir(tmp_path / "run").create()
    write_status(run, 0)
    os.rename(run.status_dir, run.tmp_dir / "status")
    os.symlink("tmp/status", run.status_dir)
    assert [r["rank"] for r in run.statuses().records] == [0]
    os.unlink(run.status_dir)
    os.rename(run.tmp_dir / "status", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", run.status_dir)
    result = run.statuses()
    assert result.records == []
    assert [s.code for s in result.skipped] == ["outside_run_dir"]
    assert read_run_file(run.status_file(0))  # without a root, any place is fine
    with pytest.raises(SkippedFile) as info:
        read_run_file(run.root / "status" / ".." / "status" / "rank-00000.json", run.root)
    assert info.value.reason == "outside_run_dir"


def test_a_folder_read_checks_files_swapped_after_its_listing(tmp_path):
    """RunFolder trusts the listing's file type only to skip a stat: a file replaced
    by a link or a FIFO after the listing is refused when read, as read_run_file would."""
    run = RunDir(tmp_path / "run").create()
    for rank in (0, 1, 2):
        write_status(run, rank)
    (tmp_path / "outside.json").write_bytes(run.status_file(0).read_bytes())
    with RunFolder(run.status_dir, run.root) as folder:
        assert folder.read("rank-00000.json").startswith(b"{")
        os.unlink(run.status_file(1))
        os.symlink(tmp_path / "outside.json", run.status_file(1))
        os.unlink(run.status_file(2))
        os.mkfifo(run.status_file(2))
        with pytest.raises(SkippedFile) as info:
            folder.read("rank-00001.json")
        assert info.value.reason == "outside_run_dir"
        with pytest.raises(SkippedFile) as info:
            folder.read("rank-00002.json")
        assert info.value.reason == "special_file"
        with pytest.raises(FileNotFoundError):
            folder.read("rank-00003.json")  # not listed
