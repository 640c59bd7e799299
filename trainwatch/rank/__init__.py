"""The in-rank library: what runs inside a user's training process.

``Telemetry`` (publishes a rank's progress to the run directory) and ``Checkpoints``
(crash-safe checkpoints and exact resume, ``trainwatch/rank/checkpoint/``). It is apart
from the reference trainer (``trainwatch/trainer/``), which is one of its clients beside
the framework callbacks (``trainwatch/integrations/``) and ``rehearse``: a user's loop
needs the library, never the trainer's model, data or launcher. It imports torch; nothing
here is imported by ``import trainwatch`` (see ``trainwatch/__init__.py``).
"""
