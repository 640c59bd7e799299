"""Random number generator state of one rank: python, numpy, torch CPU and CUDA.

Stored as plain lists and tensors so checkpoints load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    return from_raw(capture_raw())


def capture_raw() -> tuple[Any, ...]:
    """The RNG states as the generators give them (~20 µs): what a loop that keeps them
    every step pays; ``from_raw`` turns them into ``capture``'s form later, off the loop."""
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return random.getstate(), np.random.get_state(legacy=True), torch.get_rng_state(), cuda


def from_raw(raw: tuple[Any, ...]) -> dict[str, Any]:
    (version, internal, gauss), legacy, torch_state, cuda = raw
    assert isinstance(legacy, tuple), "the global RandomState's MT19937 state is the legacy tuple"
    kind, keys, pos, has_gauss, cached = legacy
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch_state,
        "cuda": cuda,
    }


def restore(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:  # other device count: this rank's own device is what matters
            device = torch.cuda.current_device()
            torch.cuda.set_rng_state(cuda_states[min(device, len(cuda_states) - 1)], device)
