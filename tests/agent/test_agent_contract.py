"""The agent and the metrics contract agree: every name the agent code exports is
declared, and every declared agent-side name is produced somewhere in agent/."""

import re
from pathlib import Path

from trainwatch.contract.metrics import METRICS

AGENT = Path(__file__).resolve().parents[2] / "trainwatch" / "agent"
# Subsystems only the agent exports (train_/rank_ names may also come from other components).
AGENT_SUBSYSTEMS = ("gpu", "nccl", "storage", "network", "process", "straggler", "collector",
                    "versions", "alert", "replica")
NAME = re.compile(r'"(trainwatch_[a-z0-9_]+)"')


def _names_in_agent() -> set[str]:
    names = set()
    for path in AGENT.rglob("*.py"):
        names |= set(NAME.findall(path.read_text()))
    return names


def test_agent_exports_only_declared_names():
    assert _names_in_agent() - set(METRICS) == set()


def test_every_declared_agent_name_is_produced_by_the_agent():
    owned = {n for n in METRICS if n.split("_")[1] in AGENT_SUBSYSTEMS}
    assert len(owned) > 60
    assert owned - _names_in_agent() == set()
