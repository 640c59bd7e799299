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


EVENT_WAIT = """\
import threading


class ShardDataset:
    def __init__(self):
        self.shard_ready = threading.Event()
        self.lock = threading.Lock()

    def __getitem__(self, i):
        self.shard_ready.wait()


class Queue:
    def __init__(self):
        self.lock = threading.Lock()
        self.not_empty = threading.Condition()

    def get(self):
        with self.lock:
            with self.not_empty:
                self.not_empty.wait()


import sys
ShardDataset()[0] if sys.argv[-1] != "condition" else Queue().get()
"""


def test_a_wait_for_an_event_nothing_sets_is_no_lock_wait(tmp_path):
    """Event.wait parks in Condition.wait, which released the condition's lock and blocks
    on a private ``waiter`` lock: the words name the event and its line, and no lock held."""
    child, dump = blocked_python(EVENT_WAIT, "futex", tmp_path)
    try:
        cause = _cause(child, dump)
    finally:
        child.kill()
        child.wait()
    assert cause["kind"] == "event" and cause["runbook"] == "TrainingStalled#event", cause
    text = causes.describe(cause)
    assert text == (f"waits for event self.shard_ready ({tmp_path / 'job.py'}:10) that "
                    "nothing has set, holding no lock"), text


def test_a_condition_wait_names_the_condition_and_only_the_locks_still_held(tmp_path):
    child, dump = blocked_python(EVENT_WAIT, "futex", tmp_path, "condition")
    try:
        cause = _cause(child, dump)
    finally:
        child.kill()
        child.wait()
    assert cause["kind"] == "condition", cause
    assert causes.describe(cause) == (
        f"waits for condition self.not_empty ({tmp_path / 'job.py'}:21) that nothing has "
        "notified, while holding self.lock")
