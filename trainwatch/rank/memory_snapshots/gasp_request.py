"""A rank's answer to the supervisor's request for a dying gasp.

A frozen or hung rank never lets its peers' collective return: they wait in it with the
state of step N, the last step every rank completed, until the supervisor SIGKILLs them,
and a SIGKILL leaves no teardown to gasp in. So before a stall restart kills the ranks the
supervisor writes ``RUN_DIR/control/gasp`` (control/gasp_request.py) and waits a few
seconds. The telemetry thread of each rank whose heartbeat still runs sees it (the loop is
blocked, the heartbeat is not), runs the gasp on a thread of its own (dying_gasp.py: the
lock and the version counters make reading the state from there safe; a rank whose
optimizer already stepped writes nothing) and answers in
``RUN_DIR/control/gasp-answers/rank-NNNNN.json``. The frozen rank cannot answer: its own
part of step N was sealed when the step ended.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from trainwatch.contract.layout import (CONTROL_GASP, FORMAT_VERSION, GASP_ANSWERS_DIR,
                                        GASP_FORMAT, rank_file_name)
from trainwatch.rundir.atomic import atomic_write_json

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 << 10


def answer_path(control_dir: Path, rank: int) -> Path:
    return control_dir / GASP_ANSWERS_DIR / rank_file_name(rank, ".json")


def listen(telemetry: Any, gasp: Any, rank: int) -> None:
    """Answer ``control/gasp`` from this rank's telemetry thread."""
    control_dir = Path(telemetry.run.control_dir)
    telemetry.on_control(CONTROL_GASP,
                         lambda path: _start(path, control_dir, gasp, rank))


def _start(path: Path, control_dir: Path, gasp: Any, rank: int) -> None:
    """Read the request and gasp on a thread: the heartbeat goes on meanwhile."""
    with open(path, "rb") as f:
        request = json.loads(f.read(MAX_REQUEST_BYTES) or b"{}")
    if not isinstance(request, dict) or request.get("format") != GASP_FORMAT:
        raise ValueError(f"{path}: not a {GASP_FORMAT} request")
    threading.Thread(target=_answer, args=(request, control_dir, gasp, rank), daemon=True,
                     name="trainwatch-gasp-request").start()


def _answer(request: dict[str, Any], control_dir: Path, gasp: Any, rank: int) -> None:
    number = request.get("number")
    started = time.perf_counter()
    try:
        facts = gasp.gasp(f"requested by the supervisor (gasp request {number}: "
                          f"{str(request.get('reason'))[:200]})")
    except Exception as exc:  # never raises, but an answer must come either way
        facts = {"written": False, "why_not": f"{type(exc).__name__}: {exc}"}
    answer = {"format": GASP_FORMAT, "version": FORMAT_VERSION, "kind": "answer",
              "number": number, "rank": rank, "time": time.time(),
              "seconds": round(time.perf_counter() - started, 3),
              **{k: facts.get(k) for k in ("step", "written", "why_not")}}
    try:
        path = answer_path(control_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, answer, durable=False)
    except OSError as exc:  # the supervisor waits its bound and goes on
        log.warning("trainwatch: could not answer gasp request %s: %s", number, exc)
