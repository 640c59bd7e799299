"""A user's loop with a misspelt Checkpoints setting (every_step for every_steps)."""

import torch.distributed as dist

from trainwatch import Checkpoints, Telemetry

dist.init_process_group("gloo")
tel = Telemetry.from_env().start()
ckpt = Checkpoints.from_env(every_step=20)
