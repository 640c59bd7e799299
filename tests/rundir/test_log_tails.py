"""Log tails are read by the safe reader (trainwatch.rundir) with a size cap: a job log of
gigabytes is not read whole, and a link out of the run directory puts nothing in a bundle."""

from __future__ import annotations

import tarfile
import time
import tracemalloc

from trainwatch.control.launch_log import JOB_LOG_TAIL_BYTES, new_lines as _new_lines
from trainwatch.contract.layout import JOB_LOG
from trainwatch.diagnose import bundle
from trainwatch.diagnose.model import Evidence
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import read_run_file_tail


def test_the_tail_starts_no_earlier_than_asked(tmp_path):
    log = tmp_path / "x.log"
    log.write_bytes(b"old\nnew\n")
    assert read_run_file_tail(log, tmp_path, max_bytes=100, start=4) == b"new\n"
    assert read_run_file_tail(log, tmp_path, max_bytes=2, start=4) == b"w\n"
    assert read_run_file_tail(log, tmp_path, max_bytes=100, start=99) == b""


def test_a_huge_job_log_is_quoted_from_its_end_only(tmp_path):
    run = RunDir(tmp_path)
    run.logs_dir.mkdir()
    log = run.logs_dir / JOB_LOG
    log.write_bytes(b"before this launch\n")
    start = log.stat().st_size
    with open(log, "ab") as fh:  # 256 MiB (sparse), then the lines that matter
        fh.truncate(start + (256 << 20))
        fh.seek(0, 2)
        fh.write(b"\n".join(b"line %d" % i for i in range(30)) + b"\n")
    tracemalloc.start()
    try:
        text = _new_lines(run, start, n=20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert text.splitlines()[1:] == [f"  line {i}" for i in range(10, 30)]
    assert peak < 4 * JOB_LOG_TAIL_BYTES


def test_a_link_out_of_the_run_directory_is_not_bundled(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2-not-for-the-bundle\n")
    run = RunDir(tmp_path / "exp")
    run.logs_dir.mkdir(parents=True)
    (run.logs_dir / "job.log").write_text("a line\n")
    (run.logs_dir / "innocent.log").symlink_to(secret)
    ev = Evidence(run_dir=str(run.root), collected_at=time.time(), host="h")
    path = bundle.write(tmp_path / "b.tar.gz", run, ev, {}, "report")
    with tarfile.open(path) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar}
    assert members["logs/job.log"] == "a line\n"
    assert "hunter2" not in members["logs/innocent.log"]
    assert members["logs/innocent.log"].startswith("(not read: ")
