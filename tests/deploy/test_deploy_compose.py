"""deploy/compose/compose.yaml, checked the way `docker compose config` would, without Docker:
the three services, pinned images, every bind-mounted file present in the repository, the
provisioning paths agreeing with the files they mount, and loopback-only listeners."""

import re
from pathlib import Path

import yaml

from conftest import REPO

COMPOSE = REPO / "deploy" / "compose" / "compose.yaml"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _binds(service: dict) -> list[tuple[Path, str]]:
    """(host path resolved against the compose file's folder, container path) of bind mounts."""
    out = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            out.append(((COMPOSE.parent / source).resolve(), target))
    return out


def test_services_and_pinned_images():
    services = _compose()["services"]
    assert set(services) == {"prometheus", "alertmanager", "grafana"}
    for name, service in services.items():
        image = service["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"{name}: unpinned {image}"


def test_every_bind_mount_exists_in_the_repository():
    compose = _compose()
    for name, service in compose["services"].items():
        for source, target in _binds(service):
            assert source.exists(), f"{name}: {source} (for {target}) is missing"
            assert REPO in source.parents, f"{name}: {source} is outside the repository"
        named = [v.split(":")[0] for v in service.get("volumes", [])
                 if not v.startswith((".", "/"))]
        assert set(named) <= set(compose.get("volumes") or {}), name
    for secret in compose.get("secrets", {}).values():
        # The token is created by the user, never committed.
        path = (COMPOSE.parent / secret["file"]).resolve()
        assert str(path.relative_to(REPO)) in (REPO / ".gitignore").read_text()


def test_provisioning_paths_agree_with_the_mounted_files():
    services = _compose()["services"]
    prom = dict((t, s) for s, t in _binds(services["prometheus"]))
    config = yaml.safe_load(prom["/etc/prometheus/prometheus.yml"].read_text())
    for rule_file in config["rule_files"]:
        assert rule_file in prom, f"prometheus.yml loads {rule_file}, which is not mounted"
        assert yaml.safe_load(prom[rule_file].read_text())["groups"]
    alertmanagers = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert "127.0.0.1:9093" in alertmanagers
    assert "--web.listen-address=127.0.0.1:9090" in services["prometheus"]["command"]

    am = dict((t, s) for s, t in _binds(services["alertmanager"]))
    am_config = yaml.safe_load(am["/etc/alertmanager/alertmanager.yml"].read_text())
    token_files = {c["http_config"]["authorization"]["credentials_file"]
                   for r in am_config["receivers"] for c in r.get("webhook_configs", [])
                   if "http_config" in c}
    secrets = {s["target"] for s in services["alertmanager"]["secrets"]}
    assert token_files <= secrets
    assert "--web.listen-address=127.0.0.1:9093" in services["alertmanager"]["command"]

    gf = dict((t, s) for s, t in _binds(services["grafana"]))
    datasource = yaml.safe_load(
        gf["/etc/grafana/provisioning/datasources/prometheus.yaml"].read_text())
    assert datasource["datasources"][0]["url"] == "http://127.0.0.1:9090"
    provider = yaml.safe_load(
        gf["/etc/grafana/provisioning/dashboards/trainwatch.yaml"].read_text())
    dash_path = provider["providers"][0]["options"]["path"]
    assert dash_path in gf and sorted(gf[dash_path].glob("*.json")), dash_path
    assert services["grafana"]["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"


def test_every_service_uses_the_host_network_so_shipped_addresses_work():
    for name, service in _compose()["services"].items():
        assert service.get("network_mode") == "host", name
        assert "ports" not in service, name
