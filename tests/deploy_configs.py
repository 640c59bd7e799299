"""The shipped Prometheus and Alertmanager configs (deploy/), pointed at a test's processes.

Only addresses, file paths and timings change; scrape and routing settings (scrape job
names, default label handling, grouping, inhibition) stay as shipped, so the end-to-end
tests prove the files an operator copies.
"""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = REPO / "deploy" / "alertmanager" / "alertmanager.yml"


def prometheus_config(path: Path, rules: Path, targets: dict[str, list[str]],
                      alertmanager: str | None = None, interval: str = "1s") -> Path:
    """deploy/prometheus/prometheus.yml with ``targets`` per scrape job name (others are
    dropped), the rules file, and this test's Alertmanager (or none)."""
    doc = yaml.safe_load(PROMETHEUS_YML.read_text())
    doc["global"].update(scrape_interval=interval, evaluation_interval=interval)
    doc["rule_files"] = [str(rules)]
    if alertmanager:
        doc["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
    else:
        doc.pop("alerting")
    jobs = [job for job in doc["scrape_configs"] if job["job_name"] in targets]
    assert {job["job_name"] for job in jobs} == set(targets), "unknown scrape job"
    for job in jobs:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    doc["scrape_configs"] = jobs
    path.write_text(yaml.safe_dump(doc))
    return path


def alertmanager_config(path: Path, receiver_url: str, token_file: Path,
                        repeat_interval: str = "3s") -> Path:
    """deploy/alertmanager/alertmanager.yml sending to this test's receiver, with short
    group and repeat intervals; the people-facing receivers are dropped."""
    doc = yaml.safe_load(ALERTMANAGER_YML.read_text())
    doc["route"].update(group_wait="1s", group_interval="1s", repeat_interval=repeat_interval)
    doc["route"]["routes"] = [r for r in doc["route"]["routes"]
                              if r["receiver"] == "trainwatch-actions"]
    for route in doc["route"]["routes"]:  # the actions route repeats on its own clock
        if "repeat_interval" in route:
            route["repeat_interval"] = repeat_interval
    doc["receivers"] = [r for r in doc["receivers"] if r["name"] == "trainwatch-actions"]
    hook = doc["receivers"][0]["webhook_configs"][0]
    hook["url"] = receiver_url.rstrip("/") + "/webhook"
    hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
    path.write_text(yaml.safe_dump(doc))
    return path


SYSTEMD_UNIT = REPO / "deploy" / "systemd" / "trainwatch-agent.service"


def unit_service_settings(path: Path = SYSTEMD_UNIT) -> dict[str, str]:
    """The [Service] settings of a systemd unit (last assignment wins, as in systemd)."""
    settings: dict[str, str] = {}
    section = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service" and "=" in line:
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def unit_setpriv(path: Path = SYSTEMD_UNIT) -> list[str]:
    """A setpriv prefix that runs a command as the unit would: its User and Group, their
    supplementary groups, its ambient capabilities within its bounding set, and
    NoNewPrivileges (what systemd applies before exec; the sandboxing is not emulated)."""
    unit = unit_service_settings(path)
    caps = [c.lower().removeprefix("cap_") for c in unit.get("AmbientCapabilities", "").split()]
    bounding = [c.lower().removeprefix("cap_")
                for c in unit.get("CapabilityBoundingSet", "").split()]
    cmd = ["setpriv", f"--reuid={unit['User']}", f"--regid={unit.get('Group', unit['User'])}",
           "--init-groups",
           "--inh-caps=-all" + "".join(f",+{c}" for c in caps),
           "--ambient-caps=-all" + "".join(f",+{c}" for c in caps),
           "--bounding-set=-all" + "".join(f",+{c}" for c in bounding)]
    if unit.get("NoNewPrivileges", "no") in ("yes", "true", "1"):
        cmd.append("--no-new-privs")
    return cmd + ["--"]
