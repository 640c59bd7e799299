"""trainwatch.agent: the per-node daemon that collects health and detects stalls and stragglers."""
