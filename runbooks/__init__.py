"""trainwatch.runbooks: one Markdown runbook per alert, shipped inside the package."""
