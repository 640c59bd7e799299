"""trainwatch.dashboards: Grafana dashboards generated from one source."""
