"""Moved to ``trainwatch.rank.telemetry`` (trainwatch/rank/telemetry.py), the in-rank
library; this alias keeps the documented ``from trainwatch.trainer.telemetry import
Telemetry`` working for users. trainwatch's own code imports the new path."""

from trainwatch.rank.telemetry import StepRecorder, Telemetry, current

__all__ = ["StepRecorder", "Telemetry", "current"]
