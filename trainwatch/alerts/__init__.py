"""trainwatch.alerts: one rules source, the embedded engine, its notifiers and exports."""
