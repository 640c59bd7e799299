"""Software checks: versions (torch, its CUDA and NCCL, driver, Python, trainwatch),
pins from --expect-version, and the NCCL_/TORCH_ environment (secret-looking values
redacted).

torch is imported in a child process of the job's interpreter (``--python``, default
this one), with a timeout: what matters is the torch the job will load, a broken CUDA
install can hang an import, and preflight itself should stay small.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from typing import Any

from trainwatch import __version__
from trainwatch.redact import redact_env
from trainwatch.preflight.gpu import GpuProbe
from trainwatch.preflight.model import Check

# Runs in the job's interpreter, which may not have trainwatch: stdlib and torch only.
_TORCH_PROBE = r"""
import json, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
else:
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda or ""
    out["nccl_available"] = bool(torch.distributed.is_available()
                                 and torch.distributed.is_nccl_available())
    if out["nccl_available"]:
        version = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
print(json.dumps(out))
"""


def probe_torch(python: str | None, timeout: float) -> dict[str, Any]:
    """What the job's interpreter reports; ``error`` set when it could not say."""
    python = python or sys.executable
    try:
        done = subprocess.run([python, "-c", _TORCH_PROBE], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"importing torch in {python} took over {timeout:g} s"}
    except OSError as exc:
        return {"error": f"cannot run {python}: {exc.strerror or exc}"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"{python} exited {done.returncode}: {tail}"}


def versions_check(python: str | None, gpu: GpuProbe, cfg: dict[str, Any]
                   ) -> tuple[Check, dict[str, str]]:
    info = probe_torch(python, float(cfg["import_timeout_seconds"]))
    gpu_up = gpu.open()
    versions = {
        "torch": info.get("torch", ""), "torch_cuda": info.get("torch_cuda", ""),
        "nccl": info.get("nccl", ""), "cuda": gpu.cuda, "driver": gpu.driver,
        "python": info.get("python", platform.python_version() if python is None else ""),
        "trainwatch": __version__,
    }
    evidence = {"versions": versions, "python_executable": info.get("executable", python),
                "nccl_in_torch": info.get("nccl_available"),
                "gpu": "NVML" if gpu_up else f"absent: {gpu.reason}"}
    problem = info.get("error") or info.get("torch_error")
    if problem:
        evidence["error"] = problem
        return Check("software.versions", "fail", f"torch unusable: {problem}", evidence), versions
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    missing = [k for k, v in versions.items() if not v]
    return Check("software.versions", "ok", shown + (f" (not found: {', '.join(missing)})"
                                                     if missing else ""), evidence), versions


def version_matches(actual: str, expected: str) -> bool:
    """``2.13.0`` matches 2.13.0, 2.13.0+cu128 and (as a prefix) ``2.13``; not 2.13.1."""
    return actual == expected or actual.startswith((expected + "+", expected + "."))


def pin_checks(versions: dict[str, str], pins: dict[str, str]) -> list[Check]:
    if not pins:
        return [Check("software.pins", "skipped", "no versions pinned (--expect-version)")]
    checks = []
    for name, expected in sorted(pins.items()):
        actual = versions.get(name, "")
        evidence = {"name": name, "expected": expected, "actual": actual}
        if not actual:
            checks.append(Check(f"software.pin.{name}", "fail", f"{name}: expected {expected}, "
                                "not found on this node", evidence, runbook="TrainwatchVersionSkew"))
        elif not version_matches(actual, expected):
            checks.append(Check(f"software.pin.{name}", "fail", f"{name} {actual}, expected "
                                f"{expected}", evidence, runbook="TrainwatchVersionSkew"))
        else:
            checks.append(Check(f"software.pin.{name}", "ok", f"{name} {actual}", evidence))
    return checks


def env_check(environ: dict[str, str], cfg: dict[str, Any]) -> Check:
    prefixes = tuple(cfg["env_prefixes"])
    seen = {k: v for k, v in sorted(environ.items()) if k.startswith(prefixes)}
    expected = cfg["expect_env"]
    wrong = sorted(k for k, v in expected.items() if environ.get(k) != v)
    actual = redact_env({k: environ[k] for k in wrong if k in environ})
    wanted = redact_env({k: expected[k] for k in wrong})
    evidence = {"variables": redact_env(seen), "mismatches": {
        k: {"expected": wanted[k], "actual": actual.get(k)} for k in wrong}}
    if wrong:
        text = ", ".join(f"{k}={actual[k]} (expected {wanted[k]})" if k in actual
                         else f"{k} unset (expected {wanted[k]})" for k in wrong)
        return Check("software.env", "fail", text, evidence)
    shown = f"{len(seen)} {'/'.join(prefixes)}* variable(s) set" if prefixes else "not listed"
    return Check("software.env", "ok", shown + (f"; {len(expected)} as expected"
                                                if expected else ""), evidence)
