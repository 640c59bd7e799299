"""``trainwatch rehearse``: a short real run of a configuration before the big one.

Versions on every rank, forward/backward/step, loss falling on one batch, checkpoint
round trip, all-reduce, telemetry to the agent, an alert to its receiver, storage
throughput, and plan's estimates against what was measured: PASS / WARN / FAIL each.
"""
