"""Two gloo ranks started without torchrun (whose teardown would kill the survivor at
once): rank 1 SIGKILLs itself while its timing exchange is in flight, rank 0 trains on
alone (no other collective) and prints its telemetry counters as JSON.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=P WORLD_SIZE=2 RANK=r python dead_peer_job.py RUN_DIR
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from trainwatch.rundir.beat import beat_path, read_beat
from trainwatch.rank.telemetry import Telemetry

dist.init_process_group("gloo")
rank = dist.get_rank()
tel = Telemetry.from_env(sys.argv[1], heartbeat_interval=0.1, exchange_every=1).start()
for step in range(60):
    with tel.step(step) as s:
        time.sleep(0.02)
        s.record(loss=torch.tensor(1.0))
    if rank == 1 and step == 20:  # the exchange of step 20 was just posted
        os.kill(os.getpid(), signal.SIGKILL)
deadline = time.monotonic() + 30  # until a heartbeat has seen the failed exchange too
while tel.snapshot()["counters"]["telemetry_errors_total"] < 2 and time.monotonic() < deadline:
    time.sleep(0.1)
time.sleep(0.5)  # a few more beats
beat = read_beat(beat_path(tel.run.status_dir, rank))
print(json.dumps({"counters": tel.snapshot()["counters"], "beat": beat}), flush=True)
os._exit(0)  # the process group cannot be torn down with a dead peer
