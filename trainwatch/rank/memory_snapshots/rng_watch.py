"""The RNG states for a snapshot every step, without reading numpy's when it did not move.

``np.random.get_state()`` builds its 624-word key element by element: 40 µs of the loop's
thread on a quiet core, 100-160 µs loaded, at every snapshot, for a generator most training
loops never draw from. Its MT19937 state (key and position) lies in one C struct whose
address numpy gives (``bit_generator.ctypes.state_address``): 2,500 bytes read in one call
say whether it moved since the last full read. The legacy generator's cached Gaussian
(``has_gauss``) lives outside that struct and is used up without moving the key: so the
last full state is reused only when it had no cached Gaussian (then every draw moves the
key). The struct's layout is checked once against ``get_state``; where it does not match
(another numpy), every snapshot reads the state in full.

Python's ``random.getstate()`` builds a tuple of 625 ints: 13-17 µs hot, ~40 µs after a
real step. Its Mersenne Twister lies in the ``Random`` object itself (CPython's
``RandomObject``: the object's header, ``int index``, ``uint32_t state[624]``), so it is
watched the same way: the struct's bytes read in one call, the last tuple reused while they
and ``gauss_next`` did not move; the layout checked once against ``getstate``.
"""

from __future__ import annotations

import ctypes
import random
import sys
from typing import Any

import numpy as np
import torch

_KEY_WORDS = 624
_STRUCT_BYTES = _KEY_WORDS * 4 + 4  # uint32_t key[624]; int pos
_PY_OFFSET = 2 * ctypes.sizeof(ctypes.c_void_p)  # PyObject_HEAD: refcount, type


class RngWatch:
    """``capture_raw`` as checkpoint/rng.py's, numpy's state reused while unmoved."""

    def __init__(self) -> None:
        self._generator: Any = None   # the global RandomState the watch was set up for
        self._address = 0             # its MT19937 struct; 0: read in full every time
        self._raw = b""               # the struct's bytes at the last full read
        self._state: Any = None       # that full read (legacy tuple), no cached Gaussian
        self._py: Any = None          # random's global Random the watch was set up for
        self._py_ok = True            # its struct reads as expected (checked once)
        self._py_raw = b""            # its struct's bytes at the last full read
        self._py_state: Any = None    # that read's getstate()

    def capture_raw(self) -> tuple[Any, ...]:
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state_all()
        return self._python(), self._numpy(), torch.get_rng_state(), cuda

    def _python(self) -> Any:
        inst = getattr(random, "_inst", None)
        if type(inst) is not random.Random or not self._py_ok:
            return random.getstate()
        if inst is not self._py:
            self._py, self._py_state = inst, None
        raw = ctypes.string_at(id(inst) + _PY_OFFSET, _STRUCT_BYTES)
        state = self._py_state
        if state is not None and raw == self._py_raw and getattr(inst, "gauss_next", None) is state[2]:
            return state
        state = random.getstate()
        if self._py_state is None and raw != _python_expected(state):  # never guess
            self._py_ok = False
            return state
        self._py_raw, self._py_state = raw, state
        return state
    def _numpy(self) -> Any:
        generator = np.random.mtrand._rand
        if generator is not self._generator:
            self._generator, self._address, self._state = generator, _address(generator), None
        if self._address and self._state is not None:
            if ctypes.string_at(self._address, _STRUCT_BYTES) == self._raw:
                return self._state
        state: Any = np.random.get_state(legacy=True)  # legacy=True: the tuple
        if self._address:
            raw = ctypes.string_at(self._address, _STRUCT_BYTES)
            if raw != _expected(state):  # not the layout this reads: never guess
                self._address = 0
            else:
                self._raw = raw
        self._state = state if self._address and not state[3] else None
        return state


def _address(generator: Any) -> int:
    try:
        bits = generator._bit_generator
        if type(bits).__name__ != "MT19937":
            return 0
        return int(bits.ctypes.state_address)
    except Exception:  # another numpy: read in full
        return 0


def _expected(state: Any) -> bytes:
    """The struct's bytes for a legacy ``get_state`` tuple (native byte order)."""
    _, key, pos, _, _ = state
    return np.asarray(key, dtype=np.uint32).tobytes() + int(pos).to_bytes(4, sys.byteorder, signed=True)


def _python_expected(state: Any) -> bytes:
    """The ``RandomObject`` bytes after its header for a ``getstate`` tuple: index, key."""
    _, words, _ = state
    return (int(words[-1]).to_bytes(4, sys.byteorder, signed=True)
            + np.asarray(words[:-1], dtype=np.uint32).tobytes())
