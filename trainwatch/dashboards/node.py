"""Node health: the hardware and software a job's ranks depend on, per node."""

from __future__ import annotations

from trainwatch.dashboards.panels import Board, flags, match, target

GPU = "{{node}} GPU {{gpu}}"
DIR = "{{node}} {{mountpoint}} ({{role}})"
NIC = "{{node}} {{device}}"
PORT = "{{node}} {{device}}/{{port}}"


def build(runbook_base: str, limits: dict) -> dict:
    b = Board("node-health", "trainwatch / Node health",
              "GPUs, storage, network, NCCL and software versions of the nodes.",
              ("node", "run"), runbook_base)

    _gpu(b)
    _storage(b, limits)
    _network(b)
    _nccl(b)
    _software(b)
    return b.to_json()


def _gpu(b: Board) -> None:
    """The GPUs: utilisation, memory, heat, power, clocks and errors."""
    b.row("GPU")
    b.timeseries("GPU utilisation", target(b.sel("trainwatch_gpu_utilization_ratio"), GPU),
                 unit="percentunit", min_=0, max_=1,
                 description="Share of the sample period a kernel was running.")
    b.timeseries("GPU memory used",
                 target(f"{b.sel('trainwatch_gpu_memory_used_bytes')} / "
                        f"{b.sel('trainwatch_gpu_memory_total_bytes')}", GPU),
                 unit="percentunit", min_=0, max_=1,
                 description="Framebuffer memory in use / installed.")
    b.timeseries("GPU temperature", target(b.sel("trainwatch_gpu_temperature_celsius"), GPU),
                 unit="celsius", description="Core temperature.",
                 alerts=("GPUThermalThrottling",))
    b.timeseries("GPU power",
                 target(b.sel("trainwatch_gpu_power_watts"), GPU),
                 target(b.sel("trainwatch_gpu_power_limit_watts"), "limit " + GPU),
                 unit="watt", description="Power draw and the enforced limit.",
                 alerts=("GPUPowerThrottling",))
    b.timeseries("SM clock",
                 target(b.sel("trainwatch_gpu_sm_clock_hertz"), GPU),
                 target(b.sel("trainwatch_gpu_sm_clock_max_hertz"), "max " + GPU),
                 unit="hertz", description="Current and maximum SM clock; a gap under load "
                                           "means throttling (see the reasons).")
    throttling = b.sel("trainwatch_gpu_clock_event_active", match("reason", "gpu_idle", "!="))
    b.state_timeline("Throttle reasons", target(f"{throttling} == 1", GPU + " {{reason}}"),
                     mappings=flags("", "active", "orange"),
                     description="Active clock-event reasons (gpu_idle left out): "
                                 "sw_thermal/hw_thermal = heat, sw_power_cap/hw_power_brake = "
                                 "power.", alerts=("GPUThermalThrottling", "GPUPowerThrottling"),
                     w=8)
    b.timeseries("XID events (recent window)",
                 target(b.sel("trainwatch_gpu_xid_events_recent"), GPU + " XID {{xid}}"),
                 description="XID events in the agent's xid window; returns to 0 when they "
                             "stop.", alerts=("GPUXidErrors",))
    b.timeseries("ECC errors",
                 target(b.increase("trainwatch_gpu_ecc_errors_total"), GPU + " {{type}}"),
                 description="New volatile ECC errors; uncorrected ones mean the GPU's results "
                             "cannot be trusted.", alerts=("GPUUncorrectableECC",))
    b.timeseries("Remapped rows and retired pages",
                 target(b.sel("trainwatch_gpu_remapped_rows"), GPU + " remapped {{type}}"),
                 target(b.sel("trainwatch_gpu_remapped_rows_pending"), GPU + " remap pending"),
                 target(b.sel("trainwatch_gpu_remapped_rows_failed"), GPU + " remap failed"),
                 target(b.sel("trainwatch_gpu_retired_pages"), GPU + " retired {{cause}}"),
                 target(b.sel("trainwatch_gpu_retired_pages_pending"),
                        GPU + " retirement pending"),
                 description="Memory repairs; 'pending' needs a GPU reset, 'failed' means the "
                             "GPU should be replaced.", alerts=("GPUUncorrectableECC",))
    b.timeseries("NVLink errors",
                 target(f"sum by (node, gpu, type) "
                        f"({b.increase('trainwatch_gpu_nvlink_errors_total')})",
                        GPU + " {{type}}"),
                 description="New NVLink replay, recovery and CRC errors, all links summed.")
    b.timeseries("PCIe replays", target(b.increase("trainwatch_gpu_pcie_replay_total"), GPU),
                 description="New PCIe replays: a bad riser, slot or link.")
    b.table("GPUs", target(f"{b.sel('trainwatch_gpu_info')} == 1", table=True),
            description="Model and UUID of each GPU.", w=8)


def _storage(b: Board, limits: dict) -> None:
    """The run's storage: free space, probes and I/O."""
    b.row("Storage")
    free_ratio = (f"{b.sel('trainwatch_storage_free_bytes')} / "
                  f"{b.sel('trainwatch_storage_size_bytes')}")
    b.timeseries("Free space", target(free_ratio, DIR), unit="percentunit", min_=0, max_=1,
                 limit=limits["storage_full_free_ratio"],
                 description="Free share of the run, checkpoint and data directories' "
                             "filesystems.", alerts=("StorageFull", "StorageFillingUp"))
    b.timeseries("Free bytes", target(b.sel("trainwatch_storage_free_bytes"), DIR),
                 unit="bytes", description="Bytes available to unprivileged users.")
    b.timeseries("Free inodes",
                 target(f"{b.sel('trainwatch_storage_files_free')} / "
                        f"{b.sel('trainwatch_storage_files')}", DIR),
                 unit="percentunit", min_=0, max_=1,
                 description="Free share of inodes; at 0 no file can be created.")
    b.timeseries("Probe latency",
                 target(b.sel("trainwatch_storage_probe_duration_seconds"), DIR),
                 unit="s", limit=limits["storage_probe_slow_seconds"],
                 description="Duration of a small write+fsync+read in the directory.",
                 alerts=("StorageProbeSlow",))
    b.timeseries("Time to full",
                 target(b.sel("trainwatch_storage_time_to_full_seconds"), DIR),
                 unit="s", description="At the recent fill rate (+Inf when not filling).",
                 alerts=("StorageFillingUp",))
    b.state_timeline("Probe and mount",
                     target(f"1 - {b.sel('trainwatch_storage_probe_success')}",
                            "probe " + DIR),
                     target(b.sel("trainwatch_storage_readonly"), "read-only " + DIR),
                     mappings=flags("ok", "failing"),
                     description="Probe not finishing within its timeout, or the filesystem "
                                 "mounted read-only.", alerts=("StorageProbeSlow",), w=8)
    b.timeseries("Disk throughput",
                 target(b.rate("trainwatch_storage_read_bytes_total"), "read {{node}} {{device}}"),
                 target(b.rate("trainwatch_storage_written_bytes_total"),
                        "write {{node}} {{device}}"),
                 unit="Bps", description="Block device bytes read and written per second.", w=12)
    b.timeseries("Disk busy",
                 target(b.rate("trainwatch_storage_io_time_seconds_total"),
                        "{{node}} {{device}}"),
                 unit="percentunit", min_=0, max_=1,
                 description="Share of time the block device was busy with I/O.", w=12)


def _network(b: Board) -> None:
    """The network interfaces and InfiniBand ports."""
    b.row("Network")
    b.timeseries("NIC throughput",
                 target(b.rate("trainwatch_network_receive_bytes_total"), "rx " + NIC),
                 target(b.rate("trainwatch_network_transmit_bytes_total"), "tx " + NIC),
                 unit="Bps", description="Bytes per second per interface.")
    b.timeseries("NIC errors and drops",
                 target(b.increase("trainwatch_network_receive_errors_total"), "rx errors " + NIC),
                 target(b.increase("trainwatch_network_transmit_errors_total"),
                        "tx errors " + NIC),
                 target(b.increase("trainwatch_network_receive_drops_total"), "rx drops " + NIC),
                 target(b.increase("trainwatch_network_transmit_drops_total"), "tx drops " + NIC),
                 description="New errors and drops per interface.",
                 alerts=("NetworkInterfaceErrors",))
    b.timeseries("Link flaps",
                 target(b.increase("trainwatch_network_carrier_changes_total"), NIC),
                 target(b.increase("trainwatch_network_ib_errors_total",
                                   match("counter", "link_downed")), "IB " + PORT),
                 description="Carrier changes (Ethernet) and link_downed (InfiniBand).",
                 alerts=("NetworkLinkFlapping",))
    b.state_timeline("Links up",
                     target(b.sel("trainwatch_network_up"), NIC),
                     target(b.sel("trainwatch_network_ib_port_active"), "IB " + PORT),
                     mappings=flags("down", "up"),
                     description="Interface operstate up; InfiniBand/RoCE port ACTIVE.", w=8)
    b.timeseries("InfiniBand throughput",
                 target(b.rate("trainwatch_network_ib_receive_bytes_total"), "rx " + PORT),
                 target(b.rate("trainwatch_network_ib_transmit_bytes_total"), "tx " + PORT),
                 target(b.sel("trainwatch_network_ib_rate_bytes_per_second"), "rate " + PORT),
                 unit="Bps", description="Bytes per second per port, and its negotiated rate.")
    ib_errors = b.increase("trainwatch_network_ib_errors_total",
                           match("counter", "link_downed", "!="))
    b.timeseries("InfiniBand errors",
                 target(f"sum by (node, device, port, counter) ({ib_errors})",
                        PORT + " {{counter}}"),
                 description="New port error counters (symbol errors, receive errors, "
                             "discards, ...).", alerts=("NetworkInterfaceErrors",))
    b.timeseries("Peer TCP connect time",
                 target(b.sel("trainwatch_network_peer_connect_seconds"),
                        "{{node}} -> {{peer}} ({{role}})"),
                 unit="s", description="Last successful TCP connect to the job's master and "
                                       "configured peers; a jump means a congested or "
                                       "failing path.")
    b.timeseries("Link RTT to peers (the ranks' connections)",
                 target(b.sel("trainwatch_link_rtt_seconds"), "{{node}} -> {{peer}} {{run}}"),
                 target(b.sel("trainwatch_link_min_rtt_seconds"),
                        "best {{node}} -> {{peer}} {{run}}"),
                 unit="s", description="Round-trip time the kernel measures on the ranks' "
                                       "own TCP connections to each peer address, and the "
                                       "link's best; far above its best while steps slow: "
                                       "the job waits on the link.",
                 alerts=("TrainingNetworkLinkSlow",))
    b.timeseries("Retransmissions to peers",
                 target(b.increase("trainwatch_link_retransmits_total"),
                        "{{node}} -> {{peer}} {{run}}"),
                 description="TCP segments the ranks retransmitted to each peer address: "
                             "loss on the path.")
    b.state_timeline("Peers reachable",
                     target(b.sel("trainwatch_network_peer_up"),
                            "{{node}} -> {{peer}} ({{role}})"),
                     mappings=flags("unreachable", "ok"),
                     description="Whether the last TCP connect to the peer succeeded.", w=8)
    b.table("InfiniBand ports", target(f"{b.sel('trainwatch_network_ib_port_info')} == 1",
                                       table=True),
            description="State, physical state and link layer of each port.", w=8)


def _nccl(b: Board) -> None:
    """NCCL's errors and its RAS view of the peers."""
    b.row("NCCL")
    b.state_timeline("NCCL RAS endpoint", target(b.sel("trainwatch_nccl_ras_up"),
                                                 "{{node}} {{run}}"),
                     mappings=flags("no answer", "up", "green"),
                     description="NCCL's RAS endpoint answered; absent for jobs without NCCL.",
                     w=8)
    b.timeseries("NCCL RAS",
                 target(b.sel("trainwatch_nccl_ras_communicators"), "communicators {{node}}"),
                 target(b.sel("trainwatch_nccl_ras_ranks_missing"), "missing ranks {{node}}"),
                 target(b.sel("trainwatch_nccl_ras_errors"), "errors {{node}}"),
                 description="What the RAS endpoint reports: missing ranks time out every "
                             "collective.", alerts=("NCCLPeerUnresponsive", "NCCLErrors"))
    b.timeseries("NCCL warnings and env",
                 target(b.increase("trainwatch_nccl_log_warnings_total"), "WARN lines {{node}}"),
                 target(b.sel("trainwatch_nccl_env_mismatches"), "env mismatches {{node}}"),
                 target(f"1 - {b.sel('trainwatch_nccl_env_consistent')}",
                        "env inconsistent {{node}}"),
                 description="New NCCL WARN log lines; NCCL_*/TORCH_* variables that differ "
                             "across the node's ranks.", alerts=("NCCLErrors",))


def _software(b: Board) -> None:
    """Which versions run where."""
    b.row("Software")
    b.table("Versions", target(f"{b.sel('trainwatch_versions_info')} == 1", table=True),
            description="Driver, CUDA, torch, NCCL, Python and trainwatch on each node; "
                        "rows that differ are skew.", alerts=("TrainwatchVersionSkew",), w=24)
