"""Host probes shared by the agent and preflight: NVML, /proc, sysfs, bounded waits."""
