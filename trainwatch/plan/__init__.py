"""``trainwatch plan``: size a training run before asking for it.

Memory per device, compute, time and cost, storage, and expected interruptions with the
checkpoint interval that minimises their cost, each with its formula and inputs. Pure
arithmetic on a run description: no torch, no GPU, nothing measured here
(``trainwatch rehearse`` measures and compares).
"""
