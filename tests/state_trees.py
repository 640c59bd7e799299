"""Two state trees (a state_dict, a snapshot read back) equal leaf for leaf, or the path of
the first difference in the assertion."""

from __future__ import annotations

from typing import Any

import torch


def assert_same_tree(a: Any, b: Any, where: str = "", *, same_types: bool = False) -> None:
    """Tensors of the same dtype, shape and values; dicts with the same keys in the same
    order; lists and tuples of the same length; other leaves equal. ``same_types``: the
    containers of one type too (a dict is not an OrderedDict, a list not a tuple)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert not same_types or type(a) is type(b), where
        assert list(a) == list(b), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}", same_types=same_types)
    elif isinstance(a, (list, tuple)):
        assert not same_types or type(a) is type(b), where
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]", same_types=same_types)
    else:
        assert a == b, where
