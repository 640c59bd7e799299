"""The checkpoint format as readers see it: names, the manifest, the catalog of a directory,
resume compatibility and `trainwatch checkpoint`. Torch-free, so the controller, diagnose
and the CLI read checkpoints without the reference trainer (docs/checkpoints.md)."""
