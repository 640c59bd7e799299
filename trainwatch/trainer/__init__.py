"""trainwatch.trainer: the reference distributed trainer and the telemetry any torch loop can use."""
