"""What a rank imports to start: a data-parallel job's ranks (own loop or the reference
trainer) never load DCP, DTensor, sympy or dynamo. Each had cost ~1.3 s of every rank's
start, restarts included (the time from a failure to the first resumed step): DCP came
in through the sharded save's hashing writer, needed only once a sharded state is saved."""

import json
import subprocess
import sys

from conftest import REPO

HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "sympy", "torch._dynamo")


def test_the_in_rank_api_and_the_reference_trainer_import_no_sharding_machinery():
    code = ("import json, sys, torch\n"
            "from trainwatch import Checkpoints, Telemetry\n"
            "import trainwatch.trainer.train\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
