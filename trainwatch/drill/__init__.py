"""``trainwatch drill``: inject a real failure into a real run and score how the safety net
(alerts, agent findings, torchrun and the controller) detected it and recovered."""
