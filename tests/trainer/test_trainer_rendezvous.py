"""One node's torchrun rendezvous on loopback, not on what the hostname resolves to (#34).

The launcher's own torchrun and the rehearsal's get an explicit loopback rendezvous and
MASTER_ADDR; a user's `torchrun --standalone` under `trainwatch run` or `rehearse --
COMMAND` gets loopback through torchrun's PET_LOCAL_ADDR. The whole job, on a host
whose name resolves elsewhere or nowhere, is tests/trainer/test_trainer_hostname.py.
"""

from __future__ import annotations

import pytest

from trainwatch.contract.env import TORCHRUN_LOCAL_ADDR_ENV
from trainwatch.trainer.rendezvous import one_node_args, pin_standalone


def test_one_node_is_hosted_and_advertised_on_the_given_address():
    assert one_node_args("job") == ["--nnodes=1", "--rdzv-backend=c10d",
                                    "--rdzv-endpoint=127.0.0.1:0", "--rdzv-id=job",
                                    "--local-addr=127.0.0.1"]
    assert "--rdzv-endpoint=[::1]:0" in one_node_args("job", "::1")


@pytest.mark.parametrize("command,pinned", [
    (["torchrun", "--standalone", "--nproc-per-node", "2", "train.py"], True),
    (["python", "-m", "torch.distributed.run", "--standalone", "train.py", "--lr", "1"], True),
    # the user names an address: theirs
    (["torchrun", "--standalone", "--local-addr", "10.0.0.2", "train.py"], False),
    (["torchrun", "--standalone", "--local_addr=10.0.0.2", "train.py"], False),
    # several nodes advertise their own address; the script's own flag is not torchrun's
    (["torchrun", "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400", "train.py",
      "--standalone"], False),
    (["python", "train.py"], False),
])
def test_a_users_standalone_torchrun_gets_loopback_through_the_environment(command, pinned):
    env: dict[str, str] = {}
    pin_standalone(command, env)
    assert env == ({TORCHRUN_LOCAL_ADDR_ENV: "127.0.0.1"} if pinned else {})
    mine = {TORCHRUN_LOCAL_ADDR_ENV: "10.1.1.1"}
    pin_standalone(command, mine)  # a value the user set wins
    assert mine == {TORCHRUN_LOCAL_ADDR_ENV: "10.1.1.1"}

