"""Measure what the reference trainer's state and two steps take (one process, CPU or GPU)
and print it as JSON next to plan's estimate for the same config: tests/plan/test_plan_measured.py."""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from trainwatch.plan.cli import build_spec
from trainwatch.plan.estimate import make_plan
from trainwatch.rehearse.memory import PeakMemory
from trainwatch.trainer.config import load_config
from trainwatch.trainer.data import Dataset
from trainwatch.trainer.train import Ranks, autocast, build_training_state

overrides = sys.argv[1:]
cfg = load_config(None, overrides)
device = torch.device("cuda" if cfg.train.device == "cuda" else "cpu")
ranks = Ranks(0, 0, 1, device, False, 0)
rng = np.random.default_rng(0)
data = Dataset(Path("."), {}, rng.integers(0, 256, 1 << 20, dtype=np.uint8),
               rng.integers(0, 256, 1 << 16, dtype=np.uint8))


def steps(state, n):
    for _ in range(n):
        x, y = (t.to(device) for t in next(state.loader))
        with autocast(device):
            _, loss = state.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)


warm = load_config(None, ["model.layers=1", "model.width=32", "model.context=16",
                          "train.batch_size=1", f"train.device={cfg.train.device}"])
steps(build_training_state(warm, data, ranks), 1)  # every lazy import and kernel, small
probe = PeakMemory(device)
steps(build_training_state(cfg, data, ranks), 2)
estimate = make_plan(build_spec(None, tuple(overrides), {
    "device_type": "cpu" if device.type == "cpu" else "h100", "devices": 1}))
print(json.dumps({"measured": probe.peak_bytes(), "kind": probe.kind,
                  "estimate": estimate["memory"]}))
