"""The webhook receiver against hostile clients: raw sockets on a real server, a real
controller-less action runner; every answer is a 4xx with a reason, nothing reads past
the cap or waits forever, a disconnect is one log line, and floods are capped."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from agent_helpers import wait_for
from control_helpers import TOKEN, _payload
from trainwatch.control import receiver as receiver_module
from trainwatch.control.actions import ActionRunner, Policy
from trainwatch.control.receiver import Receiver
from trainwatch.alerts.rules import load_rules


@pytest.fixture
def rec(tmp_path, monkeypatch):
    monkeypatch.setattr(receiver_module, "READ_TIMEOUT_SECONDS", 2.0)
    runner = ActionRunner(tmp_path / "exp1", None, Policy(dry_run=True))
    r = Receiver(load_rules(), runner, TOKEN).start()
    yield r
    r.stop()


def _raw(rec, head: str, body: bytes = b"", *, read=True, timeout=10.0) -> tuple[int, dict]:
    host, port = rec.server.server_address[:2]
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        if not read:
            return 0, {}
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data, "no answer"
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1] or b"{}")


def _head(length=None, ctype="application/json", token=TOKEN) -> str:
    lines = ["POST /webhook HTTP/1.1", "Host: x"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    if ctype:
        lines.append(f"Content-Type: {ctype}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return "\n".join(lines) + "\n"


def test_lengths_types_and_nesting_are_refused_with_a_reason(rec):
    body = json.dumps(_payload()).encode()
    assert _raw(rec, _head(-1), body)[0] == 400
    assert _raw(rec, _head("+5"), body)[0] == 400
    assert _raw(rec, _head(None), body)[0] == 411
    # 3 MiB announced: refused before a byte of it is read (the socket is closed on us)
    assert _raw(rec, _head(3 << 20), b"x" * 1000)[0] == 413
    assert _raw(rec, _head(len(body), ctype="text/plain"), body)[0] == 415
    assert _raw(rec, _head(len(body), ctype=None), body)[0] == 415
    deep = b'{"version":"4","alerts":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    code, answer = _raw(rec, _head(len(deep)), deep)
    assert code == 400 and "nested too deeply" in answer["error"]
    started = time.monotonic()  # announces 100 bytes, sends 10, then waits: dropped
    code, answer = _raw(rec, _head(100), b'{"version"')
    assert code == 408 and "not received within 2 s" in answer["error"]
    assert time.monotonic() - started < 10
    assert _raw(rec, _head(len(body), ctype="application/json; charset=utf-8"), body)[0] == 200


def test_a_flood_is_capped_per_payload_and_per_window(rec):
    alerts = []
    for i in range(1500):
        alert = _payload(fingerprint=f"{i:016x}")["alerts"][0]
        alerts.append(alert)
    body = json.dumps({**_payload(), "alerts": alerts}).encode()
    started = time.monotonic()
    code, answer = _raw(rec, _head(len(body)), body)
    assert code == 200
    outcomes = [r["outcome"] for r in answer["results"]]
    assert outcomes[0] == "refused" and answer["results"][0]["count"] == 1400
    handled = [o for o in outcomes[1:] if o != "refused"]
    assert len(handled) == receiver_module.MAX_ACTIONS_PER_WINDOW
    refused = rec.runner.run.events("action_skipped")
    assert [e for e in refused if e.get("count") == 1400]
    assert len([e for e in refused if "action requests in" in e["reason"]]) == 100 - 20
    print(f"1500-alert payload answered in {time.monotonic() - started:.2f} s")


def test_a_client_that_goes_away_is_one_log_line(rec, caplog, capfd):
    caplog.set_level(logging.INFO)
    body = json.dumps(_payload()).encode()
    for _ in range(5):  # send and close at once, without reading the answer
        _raw(rec, _head(len(body)), body, read=False)
    _raw(rec, _head(50), b"{")  # and one that stops mid-body until the read timeout
    time.sleep(0.5)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Traceback" not in caplog.text
    assert _raw(rec, _head(len(body)), body)[0] == 200  # still serving


def _drip(address, text: bytes, seconds: float) -> tuple[float, bytes]:
    """Send ``text`` a byte a second until the server answers or closes; (seconds it took,
    what it said)."""
    started = time.monotonic()
    with socket.create_connection(address, timeout=1.0) as s:
        for byte in text:
            try:
                s.sendall(bytes([byte]))
                answer = s.recv(4096)  # one second per byte: the wait is the drip
                return time.monotonic() - started, answer
            except socket.timeout:
                if time.monotonic() - started > seconds:
                    return time.monotonic() - started, b"still open"
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - started, b""
    return time.monotonic() - started, b"sent it all"


def test_a_client_sending_a_byte_a_second_is_cut_off_at_the_read_timeout(rec):
    """It used to hold a thread for as long as it kept dripping (150 s and more)."""
    body = json.dumps(_payload()).encode()
    request = _head(len(body)).replace("\n", "\r\n").encode() + b"\r\n" + body
    took, answer = _drip(rec.server.server_address[:2], request, seconds=20)
    assert took < 2.0 + 3.0, (took, answer)  # READ_TIMEOUT_SECONDS is 2 s here
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer


@pytest.fixture
def capped(tmp_path, monkeypatch):
    monkeypatch.setattr(receiver_module, "READ_TIMEOUT_SECONDS", 3.0)
    monkeypatch.setattr(receiver_module, "MAX_CONNECTIONS", 4)
    runner = ActionRunner(tmp_path / "exp1", None, Policy(dry_run=True))
    r = Receiver(load_rules(), runner, TOKEN).start()
    yield r
    r.stop()


def test_connections_beyond_the_cap_are_refused_and_webhooks_still_served(capped):
    address = capped.server.server_address[:2]
    body = json.dumps(_payload()).encode()
    slow = [socket.create_connection(address, timeout=5) for _ in range(3)]
    try:
        for s in slow:
            s.sendall(b"POST /webhook HTTP/1.1\r\n")  # and nothing more for now
        assert _raw(capped, _head(len(body)), body)[0] == 200  # the 4th: served meanwhile
        slow.append(socket.create_connection(address, timeout=5))
        slow[-1].sendall(b"P")
        wait_for(lambda: capped.server.open_connections == 4, 10, interval=0.05,
                 what="the 4th open connection")
        with socket.create_connection(address, timeout=5) as fifth:
            started = time.monotonic()
            try:
                refused = fifth.recv(100)  # closed at once, unanswered
            except ConnectionResetError:
                refused = b""
            assert refused == b"" and time.monotonic() - started < 2.0
    finally:
        for s in slow:
            s.close()
    wait_for(lambda: capped.server.open_connections == 0, 10, interval=0.05,
             what="the slow clients gone")
    assert capped.server.refused_connections == 1
    assert _raw(capped, _head(len(body)), body)[0] == 200  # once they are gone
