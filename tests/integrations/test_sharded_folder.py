"""What the framework callbacks cannot seal is bad input naming the way out, not a crash:
a Lightning strategy that saves a folder of folders (DeepSpeed) and a Hugging Face FSDP
checkpoint saved with SHARDED_STATE_DICT (folders inside ``checkpoint-N``) raised a bare
ValueError, and the job was restarted into the same crash. A DCP save missing a rank's
shard is never sealed."""

import pytest

from trainwatch.errors import ConfigError
from trainwatch.integrations.sealed import seal
from trainwatch.integrations.sharded_folder import checkpoint_in, flatten


def test_a_folder_of_folders_from_a_strategy_is_refused_naming_it(tmp_path):
    saved = tmp_path / ".tmp-step-00000005-lightning" / "lightning.ckpt"
    (saved / "checkpoint").mkdir(parents=True)
    (saved / "latest").write_text("checkpoint")
    with pytest.raises(ConfigError) as refused:
        flatten(saved, "DeepSpeedStrategy")
    assert refused.value.key == "strategy"
    assert "DeepSpeedStrategy saved a checkpoint trainwatch cannot seal" in str(refused.value)
    assert "ModelParallelStrategy" in str(refused.value)


def test_a_sharded_lightning_folder_becomes_the_step_folder(tmp_path):
    step = tmp_path / "step-00000005"
    (step / "lightning.ckpt").mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"):
        (step / "lightning.ckpt" / name).write_bytes(b"x")
    flatten(step / "lightning.ckpt", "ModelParallelStrategy")
    assert sorted(p.name for p in step.iterdir()) == [".metadata", "__0_0.distcp",
                                                      "__1_0.distcp", "meta.pt"]
    assert checkpoint_in(step, "lightning.ckpt") == step


def test_hugging_face_sharded_state_dict_folders_are_refused_with_the_fix(tmp_path):
    pytest.importorskip("transformers")
    from trainwatch.integrations.transformers import SHARDED_FIX

    folder = tmp_path / "checkpoint-5"
    (folder / "pytorch_model_fsdp_0").mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError) as refused:
        seal(folder, 5, world_size=2, framework="transformers", folders=SHARDED_FIX,
             key="fsdp_config")
    assert refused.value.key == "fsdp_config"
    assert "pytorch_model_fsdp_0" in str(refused.value)
    assert "FULL_STATE_DICT" in str(refused.value)


def test_a_dcp_save_missing_a_shard_is_not_sealed(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "step-00000005"
    dcp.save({"w": torch.arange(8.0)}, checkpoint_id=str(folder), no_dist=True)
    (folder / "meta.pt").write_bytes(b"x")
    seal(folder, 5, world_size=1, framework="lightning")  # whole: sealed, layout dcp
    (folder / "manifest.json").unlink()
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:4])  # a truncated shard
    with pytest.raises(RuntimeError, match="incomplete, not sealed"):
        seal(folder, 5, world_size=1, framework="lightning")
    assert not (folder / "manifest.json").exists()
