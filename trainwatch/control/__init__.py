"""Supervising a job: the controller, its actions (restart, rollback), the webhook receiver
and `trainwatch run` (docs/alerts.md)."""
