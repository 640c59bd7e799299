"""The goodput accounting paints steps a chunk of columns at a time with numpy; these tests
hold it to the straightforward computation (a Python loop per step, as the report did
before) on varied logs: restarts, rollbacks past earlier resumes, evaluations, saves,
gaps and slow steps, overlapping and empty steps, a pause, a stall alert, and chunk
boundaries anywhere, down to a step per chunk."""

import json
import math
import random
from pathlib import Path

import pytest

from trainwatch.report import goodput, kept_steps, steplog, timeline
from trainwatch.rundir.run_dir import RunDir

T0 = 1_800_000_000.0


def _varied_run(root: Path, seed: int) -> Path:
    """A run of 3-7 attempts of ~1 s steps, each resuming at some earlier step (a crash's
    checkpoint, or a rollback past earlier resumes), with the evidence the report reads."""
    rng = random.Random(seed)
    run = RunDir(root).create()
    run.write_run_info({"job": "varied", "world_size": 1, "nproc_per_node": 1})
    t, step, pid = T0, 0, 10
    journal: list[dict] = []
    lines: list[str] = []

    def event(name: str, source: str, **fields) -> None:
        journal.append({"v": 1, "time": t, "event": name, "source": source, "host": "h",
                        **fields})

    event("launcher_started", "launcher", pid=1)
    attempts = rng.randint(3, 7)
    for attempt in range(attempts):
        t += rng.uniform(0.5, 3.0)
        pid += 1
        event("rank_started", "rank0", rank=0, pid=pid, restart_count=attempt)
        if attempt:
            step = rng.choice([max(0, step - rng.randint(1, 8)), rng.randint(0, step), step])
            event("checkpoint_resumed", "rank0", rank=0, step=step)
        t += rng.uniform(0.1, 1.0)
        for _ in range(rng.randint(4, 40)):
            roll = rng.random()
            seconds = (15.0 if roll < 0.08 else 0.0 if roll < 0.12 else
                       1.0 + rng.uniform(-0.05, 0.05))
            wait = rng.choice([0.0, 0.1, rng.uniform(0, 2 * seconds + 0.1)])
            when = t + seconds - (rng.uniform(0, 0.5) if rng.random() < 0.1 else 0.0)
            record = {"v": 1, "kind": "step", "step": step, "time": when, "rank": 0,
                      "step_time_seconds": seconds, "data_wait_seconds": wait,
                      "tokens": None if rng.random() < 0.05 else 512}
            lines.append(json.dumps(record))
            t = max(t, when)
            if rng.random() < 0.15:
                t += rng.uniform(0.2, 2.0)
                lines.append(json.dumps({"v": 1, "kind": "eval", "step": step, "time": t,
                                         "rank": 0, "val_loss": 2.0}))
            if rng.random() < 0.15:
                t += 0.25
                event("checkpoint_saved", "rank0", rank=0, step=step + 1,
                      blocking_seconds=0.25, write_seconds=0.05, mode="async")
            step += 1
            t += 12.0 if rng.random() < 0.05 else 0.01
        if attempt + 1 < attempts:
            t += rng.uniform(0.0, 15.0)
            if rng.random() < 0.3:
                event("alert_firing", "engine", alert="TrainingStalled")
            event("failed", "rank0", rank=0, error="RuntimeError('boom')")
            if rng.random() < 0.3:  # stopped, relaunched later: a pause
                t += 1.0
                event("launcher_exited", "launcher", pid=1, returncode=1)
                t += 60.0
                event("launcher_started", "launcher", pid=1)
            t += 1.0
    event("finished", "rank0", rank=0)
    t += 1.0
    event("launcher_exited", "launcher", pid=1, returncode=0)
    run.metrics_file(0).write_text("\n".join(lines) + "\n")
    run.journal_file.write_text("".join(json.dumps(e) + "\n" for e in journal))
    return run.root


def _straightforward(tl: timeline.Timeline, typical: float, budget: float):
    """Totals, incident totals, lost steps and the recomputed count with a Python loop per
    step over the same segments (the report's computation before numpy), summed exactly."""
    log = tl.steps
    painter = goodput._Painter(tl, typical, budget)
    painter.not_running()
    painter.evaluations_and_saves()
    painter.gaps()
    columns = goodput._sweep(painter.pieces, tl.start, tl.end)
    segments = [(a, b, goodput._LABELS[code], None if owner < 0 else owner) for a, b, code, owner
                in zip(columns.start.tolist(), columns.end.tolist(), columns.label.tolist(),
                       columns.owner.tolist())]
    terms: dict = {}
    lost: dict = {}

    def credit(label, incident, value):
        terms.setdefault((None, label), []).append(value)
        if incident is not None:
            terms.setdefault((incident, label), []).append(value)

    def incident_of(index):
        return index if goodput._is_incident(tl.attempts[index]) else None

    def pieces():
        later = goodput._later_resumes(tl.attempts)
        previous_end = -math.inf
        for attempt in tl.attempts:
            lo, k = attempt.execs.lo, attempt.index
            for i in range(lo, attempt.execs.hi):
                x_start, end = log.start[i], log.end[i]
                start = max(x_start, previous_end)
                previous_end = max(previous_end, end)
                link = later[k]
                while link is not None and link[1] > log.step[i]:
                    link = link[2]
                if link is not None:   # a later attempt resumed at or before this step
                    lost.setdefault(link[0] - 1, []).append(log.step[i])
                    yield start, end, "recomputed", incident_of(link[0] - 1)
                    continue
                length = end - start
                excess = length - typical if length > budget else 0.0
                useful = length - excess
                wait = useful * (log.wait[i] / (end - x_start)) if end > x_start else 0.0
                yield max(start, tl.start), min(start + wait, tl.end), "data_wait", None
                yield max(start + wait, tl.start), min(start + useful, tl.end), "productive", None
                if excess:
                    label, incident = (("initial_startup", None) if i == lo and k == 0 else
                                       ("restart_downtime", incident_of(k - 1)) if i == lo else
                                       ("stalled", None))
                    yield max(start + useful, tl.start), min(end, tl.end), label, incident

    for t0, t1, label, incident in segments:
        credit(label, incident, t1 - t0)
    j = 0
    for a, b, label, incident in pieces():
        if b <= a and label != "recomputed":
            continue
        while j < len(segments) and segments[j][1] <= a:
            j += 1
        k = j
        while k < len(segments) and segments[k][0] < b:
            s0, s1, under, under_incident = segments[k]
            overlap = min(b, s1) - max(a, s0)
            if overlap > 0 and under != "not_running":
                credit(under, under_incident, -overlap)
                credit(label, incident, overlap)
            k += 1
    sums = {key: math.fsum(values) for key, values in terms.items()}
    return sums, {k: sorted(v) for k, v in lost.items()}


@pytest.mark.parametrize("chunk,block", [(1, 1 << 16), (3, 7), (64, 1 << 16), (4096, 5)])
@pytest.mark.parametrize("seed", range(12))
def test_numpy_painting_equals_the_loop_per_step(tmp_path, monkeypatch, seed, chunk, block):
    """Every total, every incident's seconds, the lost steps and the recomputed count equal
    the straightforward computation's exactly, however the steps fall into chunks, and
    whether the steps stay in memory or go to the temporary file a few at a time."""
    monkeypatch.setattr(goodput, "_STEP_CHUNK", chunk)
    monkeypatch.setattr(kept_steps, "VALUES_CHUNK", chunk)
    monkeypatch.setattr(kept_steps, "CHUNK", max(chunk, 2))
    monkeypatch.setattr(steplog, "BLOCK", block)
    monkeypatch.setattr(steplog, "READ", max(block // 2, 1))
    tl = timeline.read_timeline(RunDir(_varied_run(tmp_path / "run", seed)))
    acc = goodput.account(tl)
    assert acc.typical_step_seconds is not None and acc.stall_budget_seconds is not None
    sums, lost = _straightforward(tl, acc.typical_step_seconds, acc.stall_budget_seconds)
    for label in goodput.CATEGORIES:
        assert acc.seconds[label] == sums.get((None, label), 0.0), label
    assert acc.not_running_seconds == sums.get((None, "not_running"), 0.0)
    assert acc.recomputed_steps == sum(map(len, lost.values()))
    assert acc.incidents
    for inc in acc.incidents:
        index = inc.attempt.index
        assert inc.lost_steps == lost.get(index, [])
        for label in ("recomputed", "restart_downtime", "stalled"):
            assert inc.seconds[label] == sums.get((index, label), 0.0), (index, label)
    assert math.fsum(acc.seconds.values()) == pytest.approx(acc.wall_seconds, abs=1e-6)


def test_the_varied_runs_cover_what_the_painter_must_handle(tmp_path):
    """The seeds above meet every kind of piece and segment, rollbacks past an earlier
    resume, and a pause: else the comparison would prove less than it says."""
    seen: set[str] = set()
    charged: set[str] = set()
    rollbacks = pauses = 0
    for seed in range(12):
        tl = timeline.read_timeline(RunDir(_varied_run(tmp_path / str(seed), seed)))
        acc = goodput.account(tl)
        seen |= {label for label, value in acc.seconds.items() if value > 0}
        charged |= {label for inc in acc.incidents for label, v in inc.seconds.items() if v > 0}
        resumes = [a.resumed_from or 0 for a in tl.attempts[1:]]
        rollbacks += any(b < a for a, b in zip(resumes, resumes[1:]))
        pauses += bool(tl.not_running)
    assert seen == set(goodput.CATEGORIES)
    assert charged == {"recomputed", "restart_downtime", "stalled"}
    assert rollbacks >= 3 and pauses >= 3
