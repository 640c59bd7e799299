"""A run-directory log on a real full disk: writes are dropped and counted, never raised, and
the log resumes, saying how much is missing and quoting its end, once space returns."""

from __future__ import annotations

from conftest import fill_to_the_brim, tmpfs_mount
from trainwatch.rundir.best_effort_log import GAP_LINE, KEPT_LINE, BestEffortLog


def test_a_full_disk_costs_the_lines_and_the_log_resumes_with_a_gap_line(tmp_path):
    disk = tmp_path / "disk"
    with tmpfs_mount(disk, "1m"):
        fill_to_the_brim(disk)
        failing: list[str] = []
        log = BestEffortLog(disk / "job.log", retry_seconds=0, on_failing=failing.append)
        assert [log.write(b"x" * 3000) for _ in range(3)] == [False] * 3
        assert not log.write(b"y" * 2999 + b"\n")  # the end of what went missing
        assert log.dropped_bytes == 12000 and log.failing
        assert failing == ["No space left on device"]  # once per spell, not per line
        (disk / "filler").unlink()
        assert log.write(b"after\n")
        log.close()
        text = (disk / "job.log").read_bytes()
    gap = GAP_LINE.format(dropped=12000, error="No space left on device").encode()
    kept = KEPT_LINE.format(kept=12000).encode() + b"x" * 9000 + b"y" * 2999 + b"\n"
    assert text == gap + kept + b"after\n"
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


def test_output_a_writer_dropped_is_a_gap_too_and_its_end_is_kept(tmp_path):
    """What a queue in front of the log dropped (its disk fell behind) is marked where it
    went missing, with its end, and counted by the queue, not the log."""
    log = BestEffortLog(tmp_path / "job.log")
    log.write(b"before\n")
    log.skip(5000, b"Traceback...\nOSError: the last words\n", "its writer fell behind")
    assert log.failing and log.dropped_bytes == 0
    assert log.settle()  # at the job's end: now, not with a next write
    log.close()
    text = (tmp_path / "job.log").read_text()
    assert text == ("before\n" + GAP_LINE.format(dropped=5000, error="its writer fell behind")
                    + KEPT_LINE.format(kept=37) + "Traceback...\nOSError: the last words\n")
