"""The Hugging Face callback's memory snapshots are off, with the reason, for a Trainer
whose state is not a whole replica per rank (FSDP, DeepSpeed): a rank's snapshot there
would be a shard (or need collectives to gather), which the Trainer's resume does not load."""

import pytest


def test_fsdp_names_itself_as_the_reason_and_ddp_takes_snapshots(tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from trainwatch.integrations.transformers_snapshots import sharding

    def args(**kw):
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)

    assert sharding(args()) is None
    why = sharding(args(fsdp=True, fsdp_config={"fsdp_version": 2}))
    assert why is not None and why.startswith("FSDP shards") and "DDP" in why
