"""Small objects are gathered in one all-gather, large ones as ``all_gather_object`` does.

Before: every agreement of a resume (memory snapshots, the verdict on the checkpoint) went
through ``dist.all_gather_object``: two all-gathers, the sizes and then the pickles, each a
wake-up of every rank (milliseconds on a busy host). Now a pickle that fits its slot goes
in one (object_gather.py); one that does not is gathered the old way, on every rank alike.
Here one real gloo rank; two ranks gather this way in every sharded resume test."""

import torch.distributed as dist

from trainwatch.rank import object_gather
from trainwatch.rank.object_gather import gather_objects, slot_bytes


def test_a_small_object_takes_one_all_gather(group, monkeypatch):
    def refused(*_a, **_k):
        raise AssertionError("all_gather_object: two all-gathers")

    monkeypatch.setattr(dist, "all_gather_object", refused)
    mine = ([], (["x"], {"path": "/a/step-00000002", "told": None}), ("/a", "f" * 32), None)
    assert gather_objects(mine, dist.group.WORLD) == [mine]
    assert gather_objects(mine, None) == [mine]


def test_one_that_does_not_fit_is_gathered_as_all_gather_object_does(group, monkeypatch):
    calls = []
    real = dist.all_gather_object

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(dist, "all_gather_object", counted)
    big = {"problems": [f"{i}: " + "x" * 100 for i in range(1000)]}  # ~110 KB
    assert gather_objects(big, dist.group.WORLD) == [big] and calls == [1]
    monkeypatch.setattr(object_gather, "slot_bytes", lambda world: 1024)
    edge = "y" * 990  # its pickle fits 1024 less the 8-byte length: one all-gather
    assert gather_objects(edge, dist.group.WORLD) == [edge] and calls == [1]


def test_the_slot_shrinks_in_a_large_world_but_not_below_1_kib():
    assert slot_bytes(2) == 64 << 10
    assert slot_bytes(64) == 16 << 10
    assert slot_bytes(100_000) == 1 << 10
