"""A kept status is compact (``agent/compact_record.py``): equal to the parsed record,
its keys and words shared between ranks."""

import json

from trainwatch.agent.compact_record import compact


def test_a_compact_record_is_equal_and_shares_its_keys_and_words():
    text = json.dumps({"state": "running", "rank": 3, "metrics": {"loss": -0.0, "nan": None},
                       "timing": {"job": {"middle": [0.1, 0.2]}, "recent": [[10, 1.0, 0.5]]},
                       "last_error": "x" * 100, "list": ["a", {"b": 1}]})
    one, two = compact(json.loads(text)), compact(json.loads(text))
    assert one == json.loads(text) and json.dumps(one) == text
    keys_one = {k: k for k in one["metrics"]}
    assert all(k is next(j for j in two["metrics"] if j == k) for k in keys_one)
    assert one["state"] is two["state"] and one["list"][0] is two["list"][0]
    assert one["last_error"] is not two["last_error"]  # a long text is left its own


def test_nesting_past_its_depth_is_left_as_parsed():
    deep: dict = {}
    node = deep
    for _ in range(200):
        node["a"] = {}
        node = node["a"]
    assert compact(deep) == deep
