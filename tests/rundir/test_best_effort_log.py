"""A run-directory log on a real full disk: writes are dropped and counted, never raised, and
the log resumes, saying how much is missing, once space returns."""

from __future__ import annotations

from conftest import fill_to_the_brim, tmpfs_mount
from trainwatch.rundir.best_effort_log import GAP_LINE, BestEffortLog


def test_a_full_disk_costs_the_lines_and_the_log_resumes_with_a_gap_line(tmp_path):
    disk = tmp_path / "disk"
    with tmpfs_mount(disk, "1m"):
        fill_to_the_brim(disk)
        failing: list[str] = []
        log = BestEffortLog(disk / "job.log", retry_seconds=0, on_failing=failing.append)
        assert [log.write(b"x" * 3000) for _ in range(4)] == [False] * 4
        assert log.dropped_bytes == 12000 and log.failing
        assert failing == ["No space left on device"]  # once per spell, not per line
        (disk / "filler").unlink()
        assert log.write(b"after\n")
        log.close()
        text = (disk / "job.log").read_bytes()
    gap = GAP_LINE.format(dropped=12000, error="No space left on device").encode()
    assert text == gap + b"after\n"
    assert not log.failing and log.dropped_bytes == 12000


def test_the_file_is_tried_again_only_after_the_retry_delay(tmp_path):
    log = BestEffortLog(tmp_path / "no-such-folder" / "job.log", retry_seconds=3600)
    assert not log.write(b"lost\n")
    (tmp_path / "no-such-folder").mkdir()
    assert not log.write(b"also lost\n")  # not tried again yet: no open per line
    log.retry_seconds, log._retry_at = 0, 0.0
    assert log.write(b"kept\n")
    assert (tmp_path / "no-such-folder" / "job.log").read_bytes().endswith(b"kept\n")
    assert log.dropped_bytes == len(b"lost\nalso lost\n")
