"""A data-parallel checkpoint at another world size: the replicas' trees need no
resharding, so it resumes as a sharded one does (rank 0's data position on every rank, a
rank's own RNGs where it existed, derived ones where not, ``checkpoint_resharded``)."""

import torch

from trainwatch.checkpoint_format.compat import check_compatible
from trainwatch.checkpoint_format.manifest import read_manifest
from trainwatch.rank.checkpoint import resume as resume_mod, rng
from trainwatch.rank.checkpoint.writer import Payload, write_checkpoint


def _two_rank_checkpoint(folder):
    ranks = []
    for rank in range(2):
        torch.manual_seed(100 + rank)
        ranks.append({"rng": rng.capture(), "data": {"consumed": 40, "rank_wrote": rank}})
    model = {"w": torch.arange(6.0)}
    return write_checkpoint(folder, Payload(4, {"model": model}, ranks), fsync=False).path


def test_a_data_parallel_checkpoint_of_2_ranks_resumes_at_1_and_at_3(tmp_path):
    path = _two_rank_checkpoint(tmp_path)
    manifest = read_manifest(path)
    assert manifest["world_size"] == 2
    check_compatible(manifest, path, config_hash=None, sharded=False)

    alone = resume_mod.load(path, manifest, rank=0, world_size=1)
    assert torch.equal(alone.shared["model"]["w"], torch.arange(6.0))
    assert alone.data == {"consumed": 40, "rank_wrote": 0}
    assert alone.resharded == {"from_world_size": 2, "to_world_size": 1,
                               "data": "rank 0's position, on every rank", "rng_reseeded": None}

    kept = resume_mod.load(path, manifest, rank=1, world_size=3)
    new = resume_mod.load(path, manifest, rank=2, world_size=3)
    again = resume_mod.load(path, manifest, rank=2, world_size=3)
    assert kept.data == new.data == {"consumed": 40, "rank_wrote": 0}  # the job's position
    assert new.resharded["rng_reseeded"] == [2]
    torch.manual_seed(101)
    assert torch.equal(kept.rank_state["rng"]["torch"], torch.get_rng_state())  # its own
    assert torch.equal(new.rank_state["rng"]["torch"], again.rank_state["rng"]["torch"])
    assert not torch.equal(new.rank_state["rng"]["torch"], kept.rank_state["rng"]["torch"])
    assert torch.equal(new.shared["model"]["w"], torch.arange(6.0))
