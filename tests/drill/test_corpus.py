"""`trainwatch drill corpus`: every case of the diagnosis corpus is well formed, scoring on
synthetic records (every number has an exact expected value), bad usage, and one real case
end to end."""

import json
import subprocess
import sys

import pytest

from trainwatch.drill.corpus import case as cases
from trainwatch.drill.corpus import render, score
from trainwatch.errors import ConfigError

T0 = 1_800_000_000.0


def test_every_case_is_a_module_named_after_its_kind_with_a_possible_answer():
    """Adding a kind adds a file: discovery finds it, its kind is its module's name, its
    culprit is one of its ranks, and the corpus holds the clean run and >= 20 fault kinds."""
    loaded = cases.load_all()
    assert [c.kind for c in loaded] == cases.kinds() and cases.kinds()[0] == "clean"
    faults = [c for c in loaded if c.expect is not None]
    assert len(faults) >= 20, [c.kind for c in faults]
    for c in faults:
        assert set(c.expect.ranks) <= set(range(c.nproc)), c.kind
        assert c.expect.category and c.expect.cause, c.kind
        assert (c.fault or c.item or c.every_step) is not None, c.kind
    with pytest.raises(ConfigError, match="unknown corpus kind 'nope'"):
        cases.load("nope")


def _answer(ended, title="rank 1 is dead", category="rank_dead", ranks=(1,),
            evidence=("killed by SIGKILL",), severity="critical"):
    return {"started": ended - 1, "ended": ended, "exit_code": 1, "findings": [
        {"category": category, "title": title, "severity": severity, "confidence": "high",
         "ranks": list(ranks), "evidence": list(evidence), "cause": None}]}


def _record(answers, alerts=(), findings=()):
    return {"fault_at": T0, "answers": list(answers), "alerts": list(alerts),
            "agent_findings": list(findings), "error": None}


def test_a_run_is_right_from_its_first_right_answer_and_detected_by_the_first_signal():
    sigkill = cases.load("sigkill")
    record = _record([_answer(T0 + 2, ranks=(0,)), _answer(T0 + 5.5)],
                     alerts=[{"alert": "TrainingRankDown", "at": T0 + 3.0, "rank": "1"},
                             {"alert": "Old", "at": T0 - 9, "rank": None}],
                     findings=[{"kind": "stall", "detected_at": T0 + 2.5, "message": "x"}])
    card = score.card(sigkill, record)
    assert card["rank_right"] and card["cause_right"]
    assert card["diagnose_seconds"] == 5.5
    assert (card["detect_seconds"], card["detected_by"]) == (2.0, "diagnose")


def test_a_wrong_rank_or_a_missing_cause_keyword_is_wrong_and_says_what_it_said():
    sigkill = cases.load("sigkill")
    wrong_rank = score.card(sigkill, _record([_answer(T0 + 1, ranks=(0, 1))]))
    assert not wrong_rank["rank_right"] and wrong_rank["cause_right"]
    assert wrong_rank["diagnose_seconds"] is None
    no_cause = score.card(sigkill, _record([_answer(T0 + 1, evidence=("exit code 1",))]))
    assert no_cause["rank_right"] and not no_cause["cause_right"]
    assert no_cause["answer"]["missing"] == ["SIGKILL"]
    stuck = score.card(sigkill, _record([_answer(T0 + 1, category="rank_stuck")]))
    assert not stuck["cause_right"]


def test_a_node_level_faults_culprit_is_its_node_named_alone(monkeypatch):
    """slow_network_link: the right answer names no rank and exactly the slowed node (its
    name is the run's, from the record); both ends of the link, or the other end, are wrong."""
    link = cases.load("slow_network_link")
    assert (link.nnodes, link.expect.nodes, link.expect.ranks) == (2, (1,), ())
    names = ["tw-n0-ab", "tw-n1-ab"]

    def said(nodes):
        answer = _answer(T0 + 4, "slow network link: node x ↔ node y, RTT 106.4 ms",
                         "network", ranks=(), evidence=())
        answer["findings"][0]["nodes"] = nodes
        return score.card(link, {**_record([answer]), "nodes": names})

    right = said(["tw-n1-ab"])
    assert right["rank_right"] and right["cause_right"] and right["diagnose_seconds"] == 4.0
    for wrong in (["tw-n0-ab", "tw-n1-ab"], ["tw-n0-ab"], []):
        assert not said(wrong)["rank_right"] and said(wrong)["cause_right"], wrong
    monkeypatch.setattr("os.geteuid", lambda: 1000)  # not root: skipped, with the reason
    assert cases.unmet_needs(link) == "needs root (root, network namespaces, tc tbf)"


def test_a_clean_run_counts_every_finding_alert_and_agent_finding_once():
    clean = cases.load("clean")
    healthy = {"started": T0, "ended": T0 + 1, "exit_code": 0, "findings": [
        {"category": "healthy", "title": "healthy", "severity": "info", "ranks": []}]}
    record = _record([healthy, _answer(T0 + 3, severity="warning"),
                      _answer(T0 + 6, severity="warning")],
                     alerts=[{"alert": "TrainingStallSuspected", "at": T0 + 4, "rank": "0"}])
    card = score.card(clean, record)
    assert card["false_findings"] == ["diagnose: rank 1 is dead",
                                      "alert TrainingStallSuspected"]
    quiet = score.card(clean, _record([healthy]))
    result = score.table({"clean": clean, "sigkill": cases.load("sigkill")},
                         [quiet, score.card(cases.load("sigkill"), _record([_answer(T0 + 4)]))])
    assert result["totals"]["both_right_ratio"] == 1.0 and result["goals"]["met"]
    text = render.summary(result)
    assert "rank and cause right in 1/1 fault runs (100 %)" in text and "Goal met." in text
    result = score.table({"clean": clean}, [card])
    assert result["totals"]["false_findings_clean"] == 2 and not result["goals"]["met"]


def test_repeated_runs_show_their_spread_not_only_the_median():
    """A kind run 3 times: its row says the median and the fastest and slowest run (a
    median of 3 hides the one run past the goal), and the summary the slowest of all."""
    sigkill = cases.load("sigkill")
    cards = [score.card(sigkill, _record([_answer(T0 + t)])) for t in (3.6, 13.8, 4.5)]
    result = score.table({"sigkill": sigkill}, cards)
    row = result["rows"][0]
    assert (row["detect_seconds"], row["detect_range"]) == (4.5, [3.6, 13.8])
    assert result["totals"]["diagnose_seconds_max"] == 13.8
    assert "| sigkill | 3 | 3/3 | 3/3 | 4.5 s (3.6–13.8) | 4.5 s (3.6–13.8) |" in \
        render.table(result)
    assert "median 4.5 s, slowest 13.8 s" in render.summary(result)
    one = score.table({"sigkill": sigkill}, cards[:1])
    assert "| 1/1 | 1/1 | 3.6 s | 3.6 s |" in render.table(one)


def test_list_and_bad_usage():
    def corpus(*args):
        return subprocess.run([sys.executable, "-m", "trainwatch", "drill", "corpus", *args],
                              capture_output=True, text=True, timeout=60)
    listed = corpus("--list", "--json", "sigkill", "clean")
    assert listed.returncode == 0, listed.stderr
    assert [c["kind"] for c in json.loads(listed.stdout)] == ["sigkill", "clean"]
    bad = corpus("--list", "no_such_kind")
    assert bad.returncode == 2 and "unknown corpus kind 'no_such_kind'" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_a_sigkilled_rank_is_named_for_real(tmp_path):
    """One real case: rank 1 of a `trainwatch run -- torchrun` gloo job SIGKILLs itself;
    diagnose names rank 1 and SIGKILL, within the goals, and everything is stopped."""
    from trainwatch.drill.corpus.runner import run_case
    case = cases.load("sigkill")
    run, record = run_case(case, tmp_path, diagnose_within=40, diagnose_timeout=40)
    card = score.card(case, record)
    assert record["error"] is None, (record["error"], run.drill_log.read_text()[-2000:])
    assert card["rank_right"] and card["cause_right"], card["answer"]
    assert card["diagnose_seconds"] <= score.GOAL_DIAGNOSE_S, card
    assert card["detect_seconds"] <= score.GOAL_DETECT_S, card
    assert json.loads((run.drill_dir / "corpus.json").read_text())["fault_at"] == \
        record["fault_at"]
