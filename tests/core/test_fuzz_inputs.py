"""Property-based fuzzing (hypothesis) of everything that reads outside input.

Property for every target: no uncaught exception. A reader of the run directory skips what
it cannot use and says why (a SKIP_REASONS code); a config, rules, thresholds or test-file
loader raises ConfigError naming the file (exit 2); the dashboards and checkpoint commands
report a file or name it, on any dashboard JSON or manifest; the payload parser raises PayloadError
(400); an HTTP server answers every request and keeps serving. Examples per target are in
``EXAMPLES`` (a few seconds each); ``TRAINWATCH_FUZZ_SCALE=10`` runs ten times as many.
"""

from __future__ import annotations

import json
import os
import socket
import string
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainwatch.errors import ConfigError
from trainwatch.rundir.safe_read import SKIP_REASONS
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.jsonl import read_jsonl

SCALE = float(os.environ.get("TRAINWATCH_FUZZ_SCALE", "1"))
EXAMPLES = {"status": 100, "jsonl": 100, "journal_collector": 40, "trainer_config": 100,
            "overrides": 200, "agent_config": 100, "rules": 60, "thresholds": 100,
            "test_file": 60, "payload": 200, "receiver_http": 40, "agent_http": 40,
            "dashboard": 100, "manifest": 100, "cost_config": 100, "preflight_config": 100}


def fuzz(target: str):
    return settings(max_examples=max(1, int(EXAMPLES[target] * SCALE)), deadline=None,
                    suppress_health_check=list(HealthCheck), database=None)


# --------------------------------------------------------------------------- strategies
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def documents(keys: list[str]):
    """Bytes a loader may meet: random bytes, random text, deep nesting, and YAML/JSON
    mappings over the loader's own keys (so the fuzz gets past the top level)."""
    known = st.dictionaries(st.sampled_from(keys), json_values, max_size=5)
    structured = st.recursive(
        known, lambda inner: st.dictionaries(st.sampled_from(keys), inner, max_size=3),
        max_leaves=6)
    return st.one_of(
        st.binary(max_size=300),
        st.text(max_size=200).map(str.encode),
        st.integers(1, 1200).map(lambda d: ("a: " + nested(d)).encode()),
        structured.map(lambda d: yaml.safe_dump(d, allow_unicode=True).encode()),
        structured.map(lambda d: json.dumps(d, default=str).encode()),
        st.sampled_from([b"a: 2001-02-30\n", b"\xff\xfe\x00", b"a: !!python/object:os.system",
                         b"&a [*a]", b"{" * 1200, b"- " * 1200 + b"x"]))


def loaded_or_config_error(tmp_path_factory, name: str, data: bytes, load) -> None:
    """Write ``data`` as a fresh file ``name`` and ``load(path)`` it: it loads, or raises a
    ConfigError naming that file."""
    path = tmp_path_factory.mktemp("f") / name
    path.write_bytes(data)
    try:
        load(path)
    except ConfigError as exc:
        assert exc.file and (str(path) in str(exc.file) or exc.file == "--set"), exc


# --------------------------------------------------------------------------- run directory
@fuzz("status")
@given(data=st.one_of(
    st.binary(max_size=500),
    st.fixed_dictionaries({"format": st.just("trainwatch.status"), "version": st.just(1)},
                          optional={"rank": json_values, "pid": json_values,
                                    "heartbeat_at": json_values, "state": json_values,
                                    "metrics": json_values, "phase_budgets": json_values,
                                    "timing": json_values, "counters": json_values}
                          ).map(lambda d: json.dumps(d, default=str).encode())))
def test_status_reader_skips_with_a_reason_or_serves(tmp_path_factory, data):
    run = RunDir(tmp_path_factory.mktemp("s")).create()
    run.status_file(3).write_bytes(data)
    result = run.statuses()
    assert len(result.records) + len(result.skipped) == 1
    for s in result.skipped:
        assert s.code in SKIP_REASONS
    for r in result.records:
        assert r["rank"] == 3


@fuzz("status")
@given(data=st.binary(max_size=300))
def test_ranks_collector_and_status_document_survive_any_status_bytes(tmp_path_factory, data):
    from agent_helpers import collector, make_ctx, write_status
    run = RunDir(tmp_path_factory.mktemp("c")).create()
    write_status(run, 0, os.getpid())
    run.status_file(1).write_bytes(data)
    (run.status_dir / "rank-00001.beat").write_bytes(data)
    result = collector(make_ctx([run.root]), "ranks").collect()
    assert [r["rank"] for r in result.data["jobs"][0]["ranks"]][:1] == [0]


@fuzz("jsonl")
@given(lines=st.lists(st.one_of(st.binary(max_size=200),
                                json_values.map(lambda v: json.dumps(v).encode()),
                                st.integers(1, 1200).map(lambda d: nested(d).encode())),
                      max_size=10))
def test_metrics_and_journal_reader_skip_lines_with_a_reason(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("j") / "journal.jsonl"
    path.write_bytes(b"\n".join(lines))
    result = read_jsonl(path, path.parent, max_line_bytes=4096)
    assert all(isinstance(r, dict) for r in result.records)
    assert all(s.code in SKIP_REASONS for s in result.skipped)


@fuzz("journal_collector")
@given(lines=st.lists(st.one_of(
    st.binary(max_size=100),
    st.fixed_dictionaries({"v": st.just(1), "event": st.sampled_from(
        ["alert_firing", "action_taken", "action_skipped", "job_started", "checkpoint_saved",
         "restarted"])}, optional={"severity": json_values, "alert": json_values,
                                   "action": json_values, "attempt": json_values,
                                   "time": json_values, "write_seconds": json_values}
    ).map(lambda d: json.dumps(d, default=str).encode())), max_size=8))
def test_journal_collector_counts_or_skips_any_journal(tmp_path_factory, lines):
    from agent_helpers import collector, make_ctx
    run = RunDir(tmp_path_factory.mktemp("jc")).create()
    run.journal_file.write_bytes(b"\n".join(lines) + b"\n")
    result = collector(make_ctx([run.root]), "journal").collect()
    assert result.state in ("ok", "absent")


# --------------------------------------------------------------------------- config files
TRAINER_KEYS = ["model", "data", "optim", "train", "checkpoint", "telemetry", "layers", "lr",
                "seed", "steps", "dir", "every_steps", "metrics_port", "width", "heads"]


@fuzz("trainer_config")
@given(data=documents(TRAINER_KEYS))
def test_trainer_config_any_bytes_is_loaded_or_a_config_error(tmp_path_factory, data):
    from trainwatch.trainer.config import load_config
    loaded_or_config_error(tmp_path_factory, "train.yaml", data, load_config)


@fuzz("cost_config")
@given(data=documents(["gpu_hour_price", "gpus", "accelerators_per_rank", "price"]))
def test_report_cost_config_any_bytes_is_loaded_or_a_config_error(tmp_path_factory, data):
    from trainwatch.report.cost import load_settings
    loaded_or_config_error(tmp_path_factory, "cost.yaml", data, load_settings)


@fuzz("preflight_config")
@given(data=documents(["gpu", "storage", "host", "network", "software", "sys_root",
                       "proc_root", "paths", "min_free_bytes", "min_free_gib", "timeout"]))
def test_preflight_config_any_bytes_is_loaded_or_a_config_error(tmp_path_factory, data):
    from trainwatch.preflight.settings import load_settings
    loaded_or_config_error(tmp_path_factory, "preflight.yaml", data, load_settings)


@fuzz("overrides")
@given(key=st.one_of(st.sampled_from(["train.seed", "optim.lr", "model.layers",
                                      "checkpoint.every_steps", "data.shuffle_seed",
                                      "telemetry.metrics_port"]), st.text(max_size=20)),
       value=st.one_of(st.text(max_size=40), st.integers().map(str), st.floats().map(str),
                       st.integers(1, 1200).map(nested)))
def test_set_overrides_are_applied_or_refused(key, value):
    from trainwatch.trainer.config import load_config
    try:
        config = load_config(None, [f"{key}={value}"])
    except ConfigError as exc:
        assert exc.file == "--set"
        return
    assert 0 <= config.train.seed and config.optim.lr > 0


AGENT_KEYS = ["listen", "node", "run_dirs", "discover", "collectors", "stall", "straggler",
              "ranks", "interval", "timeout", "enabled", "floor_seconds", "phase_budgets",
              "eval", "k", "ratio", "windows"]


@fuzz("agent_config")
@given(data=documents(AGENT_KEYS))
def test_agent_config_any_bytes_is_loaded_or_a_config_error(tmp_path_factory, data):
    from trainwatch.agent.config import load_config
    loaded_or_config_error(tmp_path_factory, "agent.yaml", data,
                           lambda path: load_config(str(path)))


RULE_KEYS = ["groups", "name", "rules", "alert", "expr", "for", "severity", "action",
             "summary", "description", "keep_firing_for", "labels"]


@fuzz("rules")
@given(data=documents(RULE_KEYS))
def test_rules_file_any_bytes_is_loaded_or_a_config_error(tmp_path_factory, data):
    from trainwatch.alerts.rules import load_rules
    loaded_or_config_error(tmp_path_factory, "rules.yaml", data, load_rules)


@fuzz("thresholds")
@given(data=documents(["stall_for", "evaluation_interval", "stall_min_seconds",
                       "action_min_interval_seconds", "loss_spike_factor", "x"]))
def test_thresholds_any_bytes_are_loaded_or_a_config_error(tmp_path_factory, data):
    from trainwatch.alerts.rules import load_rules
    loaded_or_config_error(tmp_path_factory, "thresholds.yaml", data,
                           lambda path: load_rules(thresholds_file=path))


@fuzz("test_file")
@given(data=documents(["tests", "rule_files", "evaluation_interval", "interval",
                       "input_series", "series", "values", "alert_rule_test", "eval_time",
                       "alertname", "exp_alerts", "exp_labels", "name"]))
def test_alert_test_files_replay_or_raise_a_config_error(tmp_path_factory, data):
    from trainwatch.alerts.replay import replay_file
    from trainwatch.alerts.rules import load_rules
    loaded_or_config_error(tmp_path_factory, "alerts.test.yaml", data,
                           lambda path: replay_file(load_rules(), path))


def _paths(doc, prefix=()):
    """Every place in a JSON document, as a tuple of keys and indexes."""
    yield prefix
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) \
        else ()
    for key, value in items:
        yield from _paths(value, prefix + (key,))


@fuzz("dashboard")
@given(data=st.data())
def test_dashboard_check_any_json_is_checked_or_a_config_error(tmp_path_factory, data):
    """A shipped dashboard with a few values swapped for any JSON: `dashboards check`
    reports problems (0/1) or names the file and key (2), never a traceback."""
    import copy
    from click.testing import CliRunner
    from trainwatch.alerts.rules import DEFAULT_RUNBOOK_BASE
    from trainwatch.dashboards.cli import dashboards
    from trainwatch.dashboards.generate import build_all
    doc = copy.deepcopy(data.draw(st.sampled_from(build_all(DEFAULT_RUNBOOK_BASE))))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from([p for p in _paths(doc) if p]))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = data.draw(json_values)
    file = tmp_path_factory.mktemp("dash") / "board.json"
    file.write_text(json.dumps(doc))
    done = CliRunner().invoke(dashboards, ["check", "--json", str(file)])
    crashed = done.exception is not None and not isinstance(done.exception,
                                                            (SystemExit, ConfigError))
    assert not crashed, (done.output, done.exception)


@fuzz("manifest")
@given(manifest=st.one_of(
    st.binary(max_size=300),
    st.fixed_dictionaries(
        {"format": st.just("trainwatch.checkpoint"), "version": st.just(1)},
        optional={"step": st.one_of(st.just(10), json_values),
                  "files": st.one_of(st.just({"model.pt": {"sha256": "0" * 64, "bytes": 3}}),
                                     json_values),
                  "shared": json_values, "world_size": json_values,
                  "created_at": json_values, "config_hash": json_values,
                  "reason": json_values}).map(lambda d: json.dumps(d).encode())))
def test_checkpoint_commands_read_any_manifest(tmp_path_factory, manifest):
    """A checkpoint folder whose manifest.json holds any bytes: list, verify and digest
    report it (0/1) or name it (2), never a traceback."""
    from click.testing import CliRunner
    from trainwatch.rank.checkpoint.cli import checkpoint
    folder = tmp_path_factory.mktemp("ckpt")
    step = folder / "step-00000010"
    step.mkdir()
    (step / "model.pt").write_bytes(b"abc")
    (step / "manifest.json").write_bytes(manifest)
    for command in ("list", "verify", "digest"):
        done = CliRunner().invoke(checkpoint, [command, "--json", str(folder)])
        crashed = done.exception is not None and not isinstance(done.exception,
                                                                (SystemExit, ConfigError))
        assert not crashed, (command, done.output, done.exception)


def test_a_fifo_as_any_config_file_is_an_error_not_a_hang(tmp_path):
    """Through the CLI, as users meet it: exit 2 and the file named, at once."""
    from click.testing import CliRunner
    from trainwatch.cli import cli
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    for args in (["alerts", "check", "--rules", str(fifo)],
                 ["alerts", "check", "--thresholds", str(fifo)],
                 ["alerts", "test", str(fifo)],
                 ["agent", "--check-config", "--config", str(fifo)]):
        result = CliRunner().invoke(cli, args, standalone_mode=False)
        assert isinstance(result.exception, ConfigError), (args, result.exception)
        assert str(fifo) in str(result.exception) and "FIFO" in str(result.exception)
    from trainwatch.trainer.config import load_config
    with pytest.raises(ConfigError, match="FIFO"):
        load_config(fifo)
    with pytest.raises(ConfigError, match="train.seed"):
        load_config(None, ["train.seed=-5"])


# --------------------------------------------------------------------------- Alertmanager
alert_objects = st.fixed_dictionaries(
    {"status": st.sampled_from(["firing", "resolved", "x"]),
     "labels": st.one_of(st.dictionaries(st.sampled_from(["alertname", "job", "rank"]),
                                         st.text(max_size=10), max_size=3), json_values),
     "fingerprint": json_values,
     "startsAt": st.one_of(st.just("2026-12-02T10:00:00Z"), json_values)},
    optional={"annotations": json_values})


@fuzz("payload")
@given(body=st.one_of(
    st.binary(max_size=300),
    st.fixed_dictionaries({"version": st.sampled_from(["4", 4, "3"]),
                           "alerts": st.one_of(st.lists(alert_objects, max_size=3),
                                               json_values)}).map(
        lambda d: json.dumps(d, default=str).encode()),
    st.integers(1, 3000).map(lambda d: b'{"version":"4","alerts":' + nested(d).encode()
                                + b"}")))
def test_payload_parser_accepts_or_raises_payload_error(body):
    from trainwatch.control.receiver import PayloadError, parse_payload
    try:
        alerts = parse_payload(body)
    except PayloadError:
        return
    for alert in alerts:
        assert isinstance(alert["labels"]["alertname"], str)


# --------------------------------------------------------------------------- HTTP handlers
http_tokens = st.text(alphabet=string.printable.replace("\r", "").replace("\n", ""),
                      max_size=30)
requests = st.builds(
    lambda method, path, headers, body: (
        f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
        + "\r\n").encode("latin-1", "replace") + body,
    st.sampled_from(["GET", "POST", "PUT", "HEAD", "BREW", ""]),
    st.one_of(st.sampled_from(["/webhook", "/metrics", "/status", "/healthz", "/", "*"]),
              http_tokens),
    st.lists(st.tuples(st.sampled_from(["Content-Length", "Content-Type", "Authorization",
                                        "Transfer-Encoding", "X"]),
                       st.one_of(http_tokens, st.sampled_from(
                           ["-1", "0", "99999999999", "application/json", "Bearer t0k"]))),
             max_size=4),
    st.binary(max_size=200))


def _exchange(address, raw: bytes) -> bytes:
    with socket.create_connection(address, timeout=10) as s:
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)  # end of request: a short body is answered at once
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        except (ConnectionResetError, BrokenPipeError):
            return b""
    return data


@pytest.fixture(scope="module")
def receiver_server(tmp_path_factory):
    from trainwatch.control.actions import ActionRunner, Policy
    from trainwatch.control.receiver import Receiver
    from trainwatch.alerts.rules import load_rules
    runner = ActionRunner(tmp_path_factory.mktemp("rx") / "exp1", None, Policy(dry_run=True))
    rec = Receiver(load_rules(), runner, "t0k").start()
    yield rec
    rec.stop()


@fuzz("receiver_http")
@given(raw=requests)
def test_receiver_answers_any_request_and_keeps_serving(receiver_server, capfd, raw):
    address = receiver_server.server.server_address[:2]
    answer = _exchange(address, raw)
    assert b" 500 " not in answer[:20]
    assert _exchange(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
        b"HTTP/1.1 200")
    assert "Traceback" not in capfd.readouterr().err


@pytest.fixture(scope="module")
def agent_server():
    from trainwatch.agent.server import AgentHTTPServer
    server = AgentHTTPServer(("127.0.0.1", 0), lambda: b"m 1\n", lambda: {"ok": True},
                             lambda: True)
    server.serve_in_thread()
    yield server
    server.shutdown()
    server.server_close()


@fuzz("agent_http")
@given(raw=requests)
def test_agent_answers_any_request_and_keeps_serving(agent_server, capfd, raw):
    address = agent_server.server_address[:2]
    _exchange(address, raw)
    assert _exchange(address, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").startswith(
        b"HTTP/1.1 200")
    assert "Traceback" not in capfd.readouterr().err


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
