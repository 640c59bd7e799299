"""Serving HTTP: the one bounded server the agent's endpoints and the webhook receiver
share (``httpserver``)."""
