"""How diagnose words what a stuck process waits for, on real blocked processes: the words
must match what the process does (the on-call engineer acts on them)."""

from diagnose_helpers import blocked_python

from trainwatch.diagnose import causes
from trainwatch.host.procinfo import thread_waits

SELF_DEADLOCK = """\
import threading

_EMA_LOCK = threading.Lock()


def update_ema():
    with _EMA_LOCK:
        refresh()


def refresh():
    with _EMA_LOCK:
        pass


update_ema()
"""


def _cause(child, dump):
    return causes.rank_cause({"pid": child.pid, "process": {
        "thread_waits": thread_waits(child.pid)}}, dump)


def test_a_thread_taking_a_lock_it_holds_is_a_deadlock(tmp_path):
    child, dump = blocked_python(SELF_DEADLOCK, "futex", tmp_path)
    try:
        cause = _cause(child, dump)
    finally:
        child.kill()
        child.wait()
    assert cause["kind"] == "deadlock" and cause["runbook"] == "TrainingStalled#deadlock"
    text = causes.describe(cause)
    assert text == (f"deadlock: thread MainThread (tid {child.pid}) waits for lock _EMA_LOCK "
                    f"({tmp_path / 'job.py'}:12) that it holds itself (taken at "
                    f"{tmp_path / 'job.py'}:7)"), text
    assert "no thread" not in text
