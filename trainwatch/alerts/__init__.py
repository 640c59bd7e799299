"""trainwatch.alerts: one rules source, the embedded engine, exports and automated actions."""
