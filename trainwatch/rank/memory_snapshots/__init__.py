"""In-memory snapshots of a rank's training state, so a failure costs at most one step.

Each rank keeps its newest whole state in host memory that outlives its process (files
under /dev/shm), and a copy of another node's rank's, so a restart resumes from the newest
step every rank still has instead of from the durable checkpoint (docs/memory-snapshots.md).
"""
