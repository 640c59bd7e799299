"""``python -m trainwatch.trainer``: one rank of the reference trainer (run it under torchrun)."""

import sys

from trainwatch.trainer.train import main

sys.exit(main())
