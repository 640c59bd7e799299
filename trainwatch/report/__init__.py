"""``trainwatch report``: where a run's wall-clock time (and money) went.

journal + rank 0's metrics log -> ``timeline`` (attempts, steps, evaluations, saves)
-> ``goodput`` (time categories that sum to the wall time, incidents) -> ``cost``
-> ``render`` (human, JSON) and ``prom`` (node_exporter textfile). See docs/report.md.
"""
