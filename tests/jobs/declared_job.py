"""A job that keeps its own checkpoint file and declares each save (tel.checkpoint_saved).

Launches 1-2 train three steps, saving after each, then crash (exit 1): restarts with
progress. Launch 3 saves once, then trains without saving until trainwatch asks for a
checkpoint (control/checkpoint, CheckpointTooOld's action), saves and finishes.
"""

import os
import sys
import time

import torch

from trainwatch import Telemetry

tel = Telemetry.from_env(heartbeat_interval=0.2).start()
run_dir = os.environ["TRAINWATCH_RUN_DIR"]
path = os.path.join(run_dir, "own-ckpt.pt")
launch = int(os.environ["TRAINWATCH_LAUNCH"])
started = time.time()
step = torch.load(path)["step"] if os.path.exists(path) else 0


def save(step: int) -> None:
    torch.save({"step": step}, path + ".tmp")
    os.replace(path + ".tmp", path)
    tel.checkpoint_saved(path, step)


def train_one() -> int:
    with tel.step(step) as s:
        time.sleep(0.05)
        s.record(loss=1.0 / (step + 1))
    return step + 1


if launch <= 2:
    for _ in range(3):
        step = train_one()
        save(step)
    sys.exit(1)

save(step)
request = os.path.join(run_dir, "control", "checkpoint")
deadline = time.time() + 240
while time.time() < deadline:
    try:
        if os.stat(request).st_mtime > started:
            break
    except FileNotFoundError:
        pass
    step = train_one()
save(step)
tel.close()
