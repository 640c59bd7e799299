"""What the rehearsal checks from outside the ranks: the checkpoint directory's room and
throughput, the alert receiver, and the agent's view of the ranks."""

from __future__ import annotations

import json
import os
import re
import secrets
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainwatch.contract.layout import REHEARSAL_SCRATCH_PREFIX

CHUNK = 1 << 20
PROBE_MIN, PROBE_MAX = 8 << 20, 256 << 20


def storage_probe(folder: Path, checkpoint_bytes: float, need_bytes: float) -> dict[str, Any]:
    """Free space, then write (fsync) and read back (page cache dropped) a file of about one
    checkpoint (8-256 MiB) in ``folder``; ``error`` says what failed. The file is written only
    when it leaves room for what the run needs twice over: the directory may be shared with
    a live job, and the rehearsal must never be what fills its disk."""
    out: dict[str, Any] = {"path": str(folder)}
    size = int(min(max(checkpoint_bytes, PROBE_MIN), PROBE_MAX))
    out["probe_bytes"] = size
    path = folder / f"{REHEARSAL_SCRATCH_PREFIX}probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        vfs = os.statvfs(folder)
        out["free_bytes"] = vfs.f_bavail * vfs.f_frsize
        if out["free_bytes"] < 2 * (size + need_bytes):
            out["skipped"] = "too little free space to write a probe file safely"
            return out
        chunk = os.urandom(CHUNK)
        started = time.perf_counter()
        with open(path, "wb") as fh:
            for offset in range(0, size, CHUNK):
                fh.write(chunk[:min(CHUNK, size - offset)])
            fh.flush()
            os.fsync(fh.fileno())
        out["write_bytes_per_second"] = size / (time.perf_counter() - started)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read the disk, not the cache
            started = time.perf_counter()
            while os.read(fd, CHUNK):
                pass
            out["read_bytes_per_second"] = size / (time.perf_counter() - started)
        finally:
            os.close(fd)
    except OSError as exc:
        out["error"] = f"{exc.strerror or exc} ({exc.filename or folder})"
    finally:
        try:
            path.unlink()
        except OSError:
            pass
    return out


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def test_alert(run: str, kind: str) -> dict[str, Any]:
    now = time.time()
    return {"labels": {"alertname": "TrainwatchRehearsal", "severity": "info", "run": run},
            "annotations": {"summary": "trainwatch rehearse: a test alert; no action needed"},
            "startsAt": rfc3339(now), "endsAt": rfc3339(now if kind == "resolved" else now + 300),
            "status": kind, "generatorURL": "", "fingerprint": secrets.token_hex(8)}


def send_test_alert(url: str, *, alertmanager: bool, token: str | None, run: str,
                    timeout: float = 10.0) -> dict[str, Any]:
    """POST a firing then a resolved test alert; the HTTP status of each, or the error."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    target = url.rstrip("/") + "/api/v2/alerts" if alertmanager else url
    replies = []
    for kind in ("firing", "resolved"):
        alert = test_alert(run, kind)
        if alertmanager:
            body: Any = [{k: alert[k] for k in ("labels", "annotations", "startsAt", "endsAt",
                                                 "generatorURL")}]
        else:
            body = {"version": "4", "groupKey": "{}:{alertname=\"TrainwatchRehearsal\"}",
                    "truncatedAlerts": 0, "status": kind, "receiver": "trainwatch-rehearse",
                    "groupLabels": {"alertname": "TrainwatchRehearsal"},
                    "commonLabels": alert["labels"], "commonAnnotations": alert["annotations"],
                    "externalURL": "", "alerts": [alert]}
        req = urllib.request.Request(target, data=json.dumps(body).encode(), method="POST",
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                replies.append({"kind": kind, "status": resp.status,
                                "body": resp.read(2000).decode(errors="replace")})
        except urllib.error.HTTPError as exc:
            return {"url": target, "replies": replies,
                    "error": f"HTTP {exc.code}: {exc.read(300).decode(errors='replace')}"}
        except (OSError, ValueError) as exc:
            return {"url": target, "replies": replies, "error": str(getattr(exc, "reason", exc))}
    return {"url": target, "replies": replies}


_STEP = re.compile(r'^trainwatch_rank_steps_total\{([^}]*)\}\s+(\S+)', re.MULTILINE)
_RANK = re.compile(r'(?:^|,)rank="(\d+)"')


def agent_steps(url: str, timeout: float = 5.0) -> dict[int, float]:
    """Steps completed per rank as the agent exports them."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
        text = resp.read().decode(errors="replace")
    steps: dict[int, float] = {}
    for labels, value in _STEP.findall(text):
        match = _RANK.search(labels)
        if match:
            steps[int(match.group(1))] = float(value)
    return steps


def wait_for_agent_steps(url: str, ranks: int, steps: int, timeout: float
                         ) -> tuple[dict[int, float], str | None]:
    """Until the agent shows every rank with ``steps`` done, or ``timeout``: (seen, error)."""
    deadline = time.monotonic() + timeout
    seen: dict[int, float] = {}
    error = None
    while True:
        try:
            seen, error = agent_steps(url), None
        except (OSError, ValueError) as exc:
            error = str(getattr(exc, "reason", exc))
        if len([r for r in range(ranks) if seen.get(r, 0) >= steps]) == ranks:
            return seen, None
        if time.monotonic() > deadline:
            return seen, error
        time.sleep(0.5)
