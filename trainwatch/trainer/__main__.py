"""``python -m trainwatch.trainer``: one rank of the reference trainer (run it under torchrun)."""

import logging
import os
import sys

from trainwatch.trainer.train import main

code = main()
# main() has closed the checkpoint writer, the telemetry and the process group. Skip the
# interpreter's teardown of torch (about a second per rank on a CPU VM), which every
# restart would otherwise wait for too: torchrun restarts only when all workers are gone.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
