"""A rank's beat carries where it is in each process group's collectives (``collectives``),
named as on every rank, which the agent's stall incident decides by (issue #36, item 1)."""

import pickle

import torch
import torch.distributed as dist

from agent_helpers import wait_for
from trainwatch.rank.collective_progress import CollectiveProgress
from trainwatch.rank.telemetry import Telemetry
from trainwatch.rundir.beat import beat_path, read_beat


def test_the_beat_carries_each_groups_collective_counters_by_name(tmp_path, group):
    """A real gloo group: the default group and a side group, each named as ``new_group``
    named it (the name every rank agrees on), with [enqueued, completed]."""
    side = dist.new_group([0])
    for _ in range(5):
        dist.all_reduce(torch.ones(1), group=side)
    dist.all_reduce(torch.ones(1))
    tel = Telemetry(tmp_path, heartbeat_interval=0.05, exchange_every=0).start()
    try:
        def collectives():
            beat = read_beat(beat_path(tel.run.status_dir, 0)) or {}
            found = beat.get("collectives") or {}
            # gloo marks a collective completed a moment after it returns: wait for it
            return found if found.get(side.group_name) == [5, 5] else None
        found = wait_for(collectives, 30, interval=0.05,
                         what="the side group's 5 collectives, enqueued and completed")
    finally:
        tel.close()
    assert found[side.group_name] == [5, 5], found
    enqueued, completed = found[dist.group.WORLD.group_name]
    assert enqueued >= 1 and completed == enqueued, found


def fake_dump(status, entries):
    """A flight-recorder dump as torch pickles it: ``pg_status`` by this process's group
    counter, and entries naming each group."""
    def dump(with_entries, stacks, only_active):
        calls.append(with_entries)
        raw = {"version": "2.10", "pg_status": {
            uid: {"last_enqueued_collective": e, "last_started_collective": -1,
                  "last_completed_collective": c} for uid, (e, c) in status.items()}}
        if with_entries:
            raw["entries"] = [{"pg_id": int(uid), "process_group": (name, "undefined")}
                              for uid, name in entries.items()]
        return pickle.dumps(raw)
    calls: list[bool] = []
    return dump, calls


def test_groups_are_named_from_the_entries_only_while_the_counters_stand_still():
    """Counter 1 is group "2" on this rank (it is not in group "1"): the beat names groups
    as every rank does. The costly dump with entries is taken only once the counters stood
    still, and once; the group the rank waits in comes first."""
    status = {"0": (40, 40), "1": (7, 6), "2": (3, 3)}
    dump, calls = fake_dump(status, {"0": "0", "1": "2", "2": "5"})
    progress = CollectiveProgress([(dump, "")])
    assert progress.read() is None and calls == [False]  # nothing named yet, no entries read
    assert progress.read() == {"2": [7, 6], "0": [40, 40], "5": [3, 3]}
    assert calls == [False, False, True]
    progress.read()
    assert calls == [False, False, True, False]  # named once, not again
