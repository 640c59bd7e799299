"""``python -m trainwatch.trainer``: one rank of the reference trainer (run it under torchrun)."""

import logging
import os
import sys
import traceback

from trainwatch.trainer.train import main

try:
    code = main()
except (SystemExit, KeyboardInterrupt):
    raise
except BaseException:  # main() has closed the checkpointer (its dying gasp) and the
    # telemetry, and journaled the failure: say what failed, then leave as below
    traceback.print_exc()
    code = 1
# main() has closed the checkpoint writer, the telemetry and the process group. Skip the
# interpreter's teardown of torch (about a second per rank on a CPU VM; 7-13 s for a
# survivor of a dead peer at load ~40), which every restart would otherwise wait for too:
# torchrun restarts only when all workers are gone.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
