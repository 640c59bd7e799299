"""Run the preflight check groups in order, each isolated: a group that crashes becomes
one failed check (``<group>.error``) and the others still run."""

from __future__ import annotations

import os
from typing import Any, Callable

from trainwatch.host.nvml import NvmlBackend
from trainwatch.redact import redact
from trainwatch.node import node_name
from trainwatch.preflight import gpu, host, network, software, storage, suspects
from trainwatch.preflight.model import GROUPS, Check, Request


def run_checks(request: Request, settings: dict[str, Any], *,
               gpu_backend: Callable[[], Any] = NvmlBackend,
               progress: Callable[[str], None] | None = None,
               environ: dict[str, str] | None = None) -> list[Check]:
    """Every check of the requested groups; evidence redacted (it may hold command lines)."""
    probe = gpu.GpuProbe(gpu_backend)
    environ = dict(os.environ) if environ is None else environ
    steps: dict[str, Callable[[], list[Check]]] = {
        "gpu": lambda: gpu.check_gpus(probe, settings["gpu"]),
        "sdc": lambda: [suspects.check_suspects(request, settings["sdc"], node_name())],
        "storage": lambda: storage.check_storage(request, settings["storage"],
                                                 settings["proc_root"]),
        "host": lambda: host.check_host(settings["host"], settings["sys_root"]),
        "network": lambda: network.check_network(request, settings["network"],
                                                 settings["sys_root"]),
        "software": lambda: _software(request, settings["software"], probe, environ),
    }
    checks: list[Check] = []
    try:
        for group in GROUPS:
            if group not in request.groups:
                checks.append(Check(f"{group}.all", "skipped", "group not selected "
                                    "(--only / --skip)"))
                continue
            if progress:
                progress(group)
            try:
                checks += steps[group]()
            except Exception as exc:  # one group's crash is its own failure
                checks.append(Check(f"{group}.error", "fail", f"the {group} checks crashed: "
                                    f"{type(exc).__name__}: {exc}"))
    finally:
        probe.close()
    for check in checks:
        check.evidence = redact(check.evidence)
        check.message = redact(check.message)
    return checks


def _software(request: Request, cfg: dict[str, Any], probe: gpu.GpuProbe,
              environ: dict[str, str]) -> list[Check]:
    versions_check, versions = software.versions_check(request.python, probe, cfg)
    return [versions_check, *software.pin_checks(versions, cfg["expect_versions"]),
            software.env_check(environ, cfg)]
