"""A snapshot every step reads numpy's RNG state only when it moved (memory_snapshots/
rng_watch.py): what it captures must always be the generator's state, exactly."""

import random

import numpy as np
import pytest
import torch

from trainwatch.rank.checkpoint import rng
from trainwatch.rank.memory_snapshots.rng_watch import RngWatch


@pytest.fixture
def global_rngs():
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


def _numpy(state):
    kind, key, pos, has_gauss, gauss = state
    return kind, key.tolist(), pos, has_gauss, gauss


def test_numpys_state_is_read_again_whenever_it_moved(global_rngs):
    watch = RngWatch()
    np.random.seed(1)
    first = watch.capture_raw()
    assert watch.capture_raw()[1] is first[1]  # unmoved: the last full read, as it was
    draws = [lambda: np.random.rand(), lambda: np.random.randn(), lambda: np.random.randn(),
             lambda: np.random.randint(5), lambda: np.random.seed(2), lambda: None]
    for draw in draws:  # the second randn uses the cached Gaussian: the key does not move
        draw()
        assert _numpy(watch.capture_raw()[1]) == _numpy(np.random.get_state())
    restored = rng.from_raw(watch.capture_raw())
    expected = np.random.randn(3)
    np.random.seed(7)
    rng.restore(restored)
    assert np.array_equal(np.random.randn(3), expected)
