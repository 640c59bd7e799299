"""``trainwatch preflight``: is this node fit to join a training job?  Checks built from
the agent's pieces (NVML interface, sysfs readers, storage probe with deadlines, network
collector) so a bad node is caught before the job wastes every other node's time."""
