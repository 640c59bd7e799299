"""A loop whose loss falls from 8 to 0.05 in a few seconds and stays there, that crashes
before it ever saved, and that starts over from step 0 when the supervisor restarts it (no
checkpoint): its new losses, ~8 and falling slowly, are over a hundred times those logged
just before the crash, for the whole new launch.

    trainwatch run --run-dir RUN -- python restart_from_scratch_job.py STATE_DIR

STATE_DIR keeps a marker that the crash happened, so the second launch finishes.
"""

import os
import sys
import time

from trainwatch.rank.telemetry import Telemetry

marker = os.path.join(sys.argv[1], "crashed-once")
first = not os.path.exists(marker)
tel = Telemetry.from_env(heartbeat_interval=0.5).start()
for step in range(60 if first else 40):
    with tel.step(step) as s:
        time.sleep(0.25)
        s.record(loss=max(8.0 * 0.7 ** step, 0.05) if first else 8.0 * 0.995 ** step)
open(marker, "w").close()
if first:
    time.sleep(1.0)  # the heartbeat writes the last steps' lines
    os._exit(1)  # a crash, not a finish: the supervisor restarts the job from scratch
tel.close()
