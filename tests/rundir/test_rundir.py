"""The run-directory contract: atomic writes and readers that never crash."""

import errno
import json
import os

import pytest

from trainwatch.errors import ConfigError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.atomic import atomic_write_json
from trainwatch.rundir.jsonl import read_jsonl


def test_status_roundtrip_and_bad_files_are_skipped(tmp_path):
    run = RunDir(tmp_path / "run").create()
    run.write_status(0, {"rank": 0, "step": 3})
    (run.status_dir / "rank-00001.json").write_text('{"format": "trainwatch.status", "ver')
    (run.status_dir / "rank-00002.json").write_text("")
    (run.status_dir / "rank-00003.json").write_text(json.dumps({"format": "other", "version": 1}))
    (run.status_dir / "rank-00004.json").write_text(
        json.dumps({"format": "trainwatch.status", "version": 99}))
    (run.status_dir / "rank-00005.json").write_bytes(b"\xff\xfe\x00garbage")
    result = run.statuses()
    assert [r["rank"] for r in result.records] == [0]
    reasons = {os.path.basename(s.path): s.reason for s in result.skipped}
    assert set(reasons) == {f"rank-0000{i}.json" for i in range(1, 6)}
    assert "torn" in reasons["rank-00001.json"]
    assert "empty" in reasons["rank-00002.json"]
    assert "not a trainwatch.status" in reasons["rank-00003.json"]
    assert "version 99" in reasons["rank-00004.json"]


def test_journal_skips_torn_and_future_lines(tmp_path):
    run = RunDir(tmp_path).create()
    run.append_event("run_started", "cli", world_size=2)
    with open(run.journal_file, "a") as fh:
        fh.write('{"v": 1, "event": "checkpoint_sa')  # a crash mid-append
        fh.write("\n[1, 2]\n")
        fh.write(json.dumps({"v": 7, "event": "from_the_future"}) + "\n")
    run.append_event("finished", "cli")
    result = run.journal()
    assert [r["event"] for r in result.records] == ["run_started", "finished"]
    assert [s.line for s in result.skipped] == [2, 3, 4]


def test_atomic_write_leaves_no_temp_files(tmp_path):
    for i in range(5):
        atomic_write_json(tmp_path / "doc.json", {"i": i})
    assert json.loads((tmp_path / "doc.json").read_text()) == {"i": 4}
    assert os.listdir(tmp_path) == ["doc.json"]


def test_missing_jsonl_reads_empty(tmp_path):
    assert read_jsonl(tmp_path / "nope.jsonl").records == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_run_dir_is_a_config_error(tmp_path):
    tmp_path.chmod(0o500)
    with pytest.raises(ConfigError, match="not writable"):
        RunDir(tmp_path / "run").create()


def test_run_dir_under_a_file_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not writable"):
        RunDir(tmp_path / "file" / "run").create()


def test_every_journal_event_written_in_the_code_is_listed_in_EVENTS():
    """Names passed to append_event / Telemetry.event / JobController.journal / the checkpointer's _journal,
    grepped from the source, must all be in the contract (f-strings as patterns)."""
    import re
    from pathlib import Path

    from trainwatch.rundir.run_dir import EVENTS

    repo = Path(__file__).resolve().parents[2]
    call = re.compile(r"(?:append_event|\.event|_journal|\.journal)\(\s*(f?)\"([^\"]+)\"")
    found: dict[str, str] = {}
    for folder in ("trainer", "agent", "alerts", "trainwatch", "runbooks", "dashboards"):
        for path in (repo / folder).rglob("*.py"):
            for is_f, name in call.findall(path.read_text()):
                found[name if not is_f else "f:" + name] = str(path.relative_to(repo))
    # Writers the alerts controller and the launcher own must have been found at all.
    assert {"job_started", "job_exited", "controller_started", "launcher_started",
            "checkpoint_saved", "rank_started"} <= set(found), sorted(found)
    missing = []
    for name, where in found.items():
        if name.startswith("f:"):
            pattern = re.sub(r"\\\{[^}]*\\\}", "[a-z_]+", re.escape(name[2:]))
            if not any(re.fullmatch(pattern, e) for e in EVENTS):
                missing.append((name, where))
        elif name not in EVENTS:
            missing.append((name, where))
    assert not missing, f"journal events not in trainwatch.rundir.run_dir.EVENTS: {missing}"


def test_a_journal_line_on_a_full_disk_is_all_or_nothing(tmp_path):
    """A real tmpfs filled to the brim: an append that only partly fits (the slack of the
    journal's last page) is taken back, never left torn to glue the next line to itself."""
    from conftest import fill_to_the_brim, tmpfs_mount
    with tmpfs_mount(tmp_path / "disk", "1m") as disk:
        run = RunDir(disk / "run").create()
        run.append_event("run_started", "cli")
        fill_to_the_brim(disk)
        before = run.journal_file.read_bytes()
        with pytest.raises(OSError) as raised:
            run.append_event("checkpoint_failed", "rank0", error="x" * 6000)  # > one page
        assert raised.value.errno == errno.ENOSPC
        assert run.journal_file.read_bytes() == before  # taken back, byte for byte
        (disk / "filler").unlink()
        run.append_event("finished", "cli")
        result = run.journal()
    assert [r["event"] for r in result.records] == ["run_started", "finished"]
    assert result.skipped == []


def test_a_torn_fragment_costs_itself_not_the_line_glued_to_it(tmp_path):
    """What an older writer left on a full disk: half a line, then a whole one glued on."""
    run = RunDir(tmp_path).create()
    run.append_event("run_started", "cli")
    with open(run.journal_file, "ab") as fh:
        fh.write(b'{"v":1,"time":1.0,"event":"checkpoint_fai')
    run.append_event("finished", "cli", nested={"v": 1})
    result = run.journal()
    assert [r["event"] for r in result.records] == ["run_started", "finished"]
    assert [(s.line, s.code) for s in result.skipped] == [(2, "not_json")]
