"""diagnose names the reason of the failed checkpoint saves, from the journal's
``checkpoint_failed`` events (``error``) or, where the journal lacks them, from the rank's
status (``last_error``). Before, it read ``error`` and ``step`` from the status, where the
writer puts neither, and counted the status on top of the journal: "3 failed checkpoint
save(s); last: step None: no reason given"."""

from checkpoint_helpers import failed_saves
from diagnose_helpers import diagnose, top

REASON = "saving checkpoint step 4 failed: Not a directory"


def test_diagnose_shows_the_last_failed_saves_reason_from_the_journal(tmp_path):
    run = failed_saves(tmp_path / "run")
    code, report, out = diagnose(run)
    assert code == 1, out
    evidence = top(report, "checkpoint")["evidence"]
    assert evidence[0].startswith("2 failed checkpoint save(s); last: step 4: [Errno 20] "
                                  + REASON), evidence


def test_without_the_journal_diagnose_reads_the_reason_from_the_ranks_status(tmp_path):
    run = failed_saves(tmp_path / "run")
    lines = run.journal_file.read_text().splitlines(keepends=True)
    run.journal_file.write_text("".join(x for x in lines if "checkpoint_failed" not in x))
    code, report, out = diagnose(run)
    assert code == 1, out
    evidence = top(report, "checkpoint")["evidence"]
    assert evidence[0].startswith("2 failed checkpoint save(s); last: step 4: [Errno 20] "
                                  + REASON), evidence
