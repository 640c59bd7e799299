"""The one rules source: exports pass promtool, both engines fire at the same moments.

Set TRAINWATCH_REGENERATE=1 to rewrite the generated files after changing the rules.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainwatch import runbooks
from trainwatch.alerts.export import prometheus_yaml, prometheusrule_yaml
from trainwatch.alerts.replay import promtool_test_file, replay_file
from trainwatch.alerts.rules import DEFAULT_RUNBOOK_BASE, RULES_FILE, load_rules
from trainwatch.errors import ConfigError
from trainwatch.contract.metrics import METRICS

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "trainwatch" / "alerts" / "generated"
SCENARIOS = REPO / "tests" / "promtool" / "scenarios.yaml"
PROMTOOL_TEST = REPO / "tests" / "promtool" / "alerts.test.yaml"
REQUIRED = ["TrainingStallSuspected", "TrainingStalled", "TrainingRankDown", "TrainingStartupFailed",
            "TrainingStragglerRank", "TrainingStragglerNode", "TrainingLossNonFinite",
            "TrainingLossSpike", "TrainingLossNotDecreasing", "TrainingThroughputDrop",
            "CheckpointFailed", "CheckpointFailedRepeatedly", "CheckpointTooOld", "GPUXidErrors",
            "GPUUncorrectableECC",
            "GPUThermalThrottling", "GPUPowerThrottling", "NCCLErrors", "StorageFillingUp",
            "StorageFull", "StorageProbeSlow", "NetworkInterfaceErrors", "NetworkLinkFlapping",
            "NCCLPeerUnresponsive", "TrainwatchVersionSkew", "TrainwatchAgentDown", "TrainwatchCollectorFailing",
            "TrainwatchRunUnreadable", "TrainwatchCannotPublish", "TrainwatchSupervisorDown",
            "TrainingRanksMissing", "TrainwatchJournalUnreliable", "TrainingNetworkLinkSlow"]
promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")


@pytest.fixture(scope="module")
def ruleset():
    return load_rules()


def _generated(ruleset):
    return {
        GENERATED / "prometheus-rules.yaml": prometheus_yaml(ruleset),
        GENERATED / "prometheusrule.yaml": prometheusrule_yaml(ruleset),
        # kustomize and Helm read only files under their own folder: each holds a copy
        REPO / "deploy" / "kubernetes" / "base" / "prometheusrule.yaml":
            prometheusrule_yaml(ruleset),
        REPO / "deploy" / "helm" / "trainwatch" / "files" / "prometheusrule.yaml":
            prometheusrule_yaml(ruleset),
        PROMTOOL_TEST: promtool_test_file(ruleset, SCENARIOS,
                                          "../../trainwatch/alerts/generated/prometheus-rules.yaml",
                                          DEFAULT_RUNBOOK_BASE),
    }


def test_generated_files_are_up_to_date(ruleset):
    stale = []
    for path, text in _generated(ruleset).items():
        if os.environ.get("TRAINWATCH_REGENERATE"):
            path.write_text(text)
        elif not path.exists() or path.read_text() != text:
            stale.append(str(path.relative_to(REPO)))
    assert not stale, f"regenerate with TRAINWATCH_REGENERATE=1 pytest {__file__}: {stale}"


def test_every_required_alert_exists_and_scenarios_cover_all(ruleset):
    names = [r.name for r in ruleset.rules]
    assert not set(REQUIRED) - set(names)
    scenarios = yaml.safe_load(SCENARIOS.read_text())
    covered = {c["alertname"] for t in scenarios["tests"] for c in t["alert_rule_test"]
               if c.get("exp_alerts")}
    not_yet = {c["alertname"] for t in scenarios["tests"] for c in t["alert_rule_test"]
               if not c.get("exp_alerts")}
    assert set(names) == covered == not_yet | covered and set(names) <= not_yet


@promtool
def test_promtool_check_rules_on_both_exports(tmp_path):
    out = subprocess.run(["promtool", "check", "rules", str(GENERATED / "prometheus-rules.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 36 rules found" in out.stdout
    spec = yaml.safe_load((GENERATED / "prometheusrule.yaml").read_text())
    assert spec["kind"] == "PrometheusRule"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec["spec"]))
    out = subprocess.run(["promtool", "check", "rules", str(tmp_path / "spec.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@promtool
def test_promtool_test_rules_pins_every_moment():
    out = subprocess.run(["promtool", "test", "rules", PROMTOOL_TEST.name],
                         cwd=PROMTOOL_TEST.parent, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_embedded_engine_replays_the_same_file_to_the_same_moments(ruleset):
    rows = replay_file(ruleset, PROMTOOL_TEST, runbook_base=DEFAULT_RUNBOOK_BASE)
    assert len(rows) >= 2 * len(ruleset.rules)
    failed = [(name, c.alertname, c.eval_time) for name, c, _, ok in rows if not ok]
    assert not failed
    # the engine really checks: one minute earlier, the "fires" checks must fail
    doc = yaml.safe_load(PROMTOOL_TEST.read_text())
    for t in doc["tests"]:
        for c in t["alert_rule_test"]:
            if c.get("exp_alerts"):
                c["eval_time"] = f"{int(c['eval_time'][:-1]) - 1}m"
    shifted = PROMTOOL_TEST.parent / ".shifted.test.yaml"
    try:
        shifted.write_text(yaml.safe_dump(doc))
        rows = replay_file(ruleset, shifted, runbook_base=DEFAULT_RUNBOOK_BASE)
    finally:
        shifted.unlink()
    fires_early = [(name, c.alertname) for name, c, _, ok in rows if c.expected and ok]
    # only the checks that an alert keeps firing may still hold one minute earlier
    lost = "a lost node is named once by the agents that remain; its down rank's page does not resolve"
    never = ("ranks that never reported page for the run; an agent that died alone, or a "
             "stopped run, page nobody")
    journal = ("a journal unreadable for its for, or replaced while the run goes on, warns; a "
               "whole one does not")  # a replacement warns for its whole window
    # still firing after the kernel's min_rtt caught up with the slow link (at 85m)
    slow_link = "a slow link the job waits on, a long link, a slow link a job does not wait on"
    assert fires_early == [(lost, "TrainingRanksMissing"), (lost, "TrainingRankDown"),
                           (never, "TrainingRanksMissing"),
                           ("loss spike fires at once and keeps firing for keep_firing_for",
                            "TrainingLossSpike"),
                           (slow_link, "TrainingNetworkLinkSlow"),
                           (journal, "TrainwatchJournalUnreliable")]


def test_every_alert_has_a_runbook_and_every_runbook_an_alert(ruleset):
    names = {r.name for r in ruleset.rules}
    assert set(runbooks.names()) == names
    for name in names:
        text = runbooks.text(name)
        for section in ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation",
                        "## Automatic action"):
            assert section in text, f"runbooks/{name}.md lacks {section}"
        assert "trainwatch diagnose" in text or "trainwatch agent" in text, name


def test_rules_use_only_contract_metrics(ruleset):
    for rule in ruleset.rules:
        assert rule.metrics - {"up"} <= set(METRICS), rule.name


BAD = [
    ("trainwatch_rank_up == 0", "trainwatch_rank_upp == 0", "not in the metrics contract"),
    ("for: ${stall_for}", "for: 5 minutes", "bad duration"),
    ("expr: trainwatch_nccl_ras_ranks_missing > 0", "expr: trainwatch_nccl_ras_ranks_missing >",
     "bad expression"),
    ("expr: trainwatch_nccl_ras_ranks_missing > 0",
     "expr: label_replace(trainwatch_nccl_ras_ranks_missing, 'a', 'b', 'c', 'd') > 0",
     "not supported"),
    ("alert: NCCLErrors", "alert: NCCLMystery", "has no runbook"),
    ("severity: info", "severity: page-me", "severity must be"),
    ("${stall_min_seconds}", "${stall_min_secs}", "unknown threshold"),
    ("  - name: trainwatch-gpu\n", "  - name: trainwatch-gpu\n   bad: [\n", "invalid YAML"),
]


@pytest.mark.parametrize("old,new,message", BAD, ids=[b[2] for b in BAD])
def test_bad_rule_files_name_file_and_line(tmp_path, old, new, message):
    source = RULES_FILE.read_text()
    assert old in source
    bad = source.replace(old, new, 1)
    path = tmp_path / "rules.yaml"
    path.write_text(bad)
    with pytest.raises(ConfigError) as err:
        load_rules(path)
    assert message in str(err.value)
    assert err.value.file == str(path) and err.value.line
    changed = next(i for i, (a, b) in enumerate(zip(source.splitlines(), bad.splitlines()))
                   if a != b) + 1
    assert abs(err.value.line - changed) <= 12  # the rule's or the key's line, not line 1
    out = subprocess.run([sys.executable, "-m", "trainwatch", "alerts", "check", "--rules",
                          str(path)], capture_output=True, text=True)
    assert out.returncode == 2
    assert re.search(rf"{re.escape(str(path))}:\d+", out.stderr), out.stderr


def test_threshold_overrides_change_both_outputs(tmp_path):
    override = tmp_path / "t.yaml"
    override.write_text("stall_min_seconds: 42\nstall_for: 30s\n")
    ruleset = load_rules(thresholds_file=override)
    rule = ruleset.get("TrainingStalled")
    assert "> 42" in rule.expr and rule.for_seconds == 30
    assert "for: 30s" in prometheus_yaml(ruleset)
    override.write_text("stall_mni_seconds: 42\n")
    with pytest.raises(ConfigError, match="unknown threshold") as err:
        load_rules(thresholds_file=override)
    assert err.value.line == 1


def test_cli_export_and_runbook(tmp_path):
    out = subprocess.run([sys.executable, "-m", "trainwatch", "alerts", "export", "--format",
                          "prometheusrule", "--namespace", "ml"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    assert doc["metadata"]["namespace"] == "ml"
    urls = [r["annotations"]["runbook_url"] for g in doc["spec"]["groups"] for r in g["rules"]]
    assert all(u.endswith(".md") and "/runbooks/" in u for u in urls) and len(urls) == 36
    out = subprocess.run([sys.executable, "-m", "trainwatch", "runbook", "trainingstalled"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("# TrainingStalled")
    out = subprocess.run([sys.executable, "-m", "trainwatch", "runbook", "TrainingStaled"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "TrainingStalled" in out.stderr


@pytest.mark.skipif(not (shutil.which("promtool") and shutil.which("amtool")),
                    reason="promtool/amtool not installed")
def test_deploy_configs_are_valid(tmp_path):
    rules = tmp_path / "trainwatch.yml"
    rules.write_text((GENERATED / "prometheus-rules.yaml").read_text())
    config = (REPO / "deploy" / "prometheus" / "prometheus.yml").read_text()
    (tmp_path / "prometheus.yml").write_text(
        config.replace("/etc/prometheus/rules/trainwatch.yml", str(rules)))
    out = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run(["amtool", "check-config",
                          str(REPO / "deploy" / "alertmanager" / "alertmanager.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "/webhook" in (REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text()


def test_evaluator_vector_matching_and_quantile():
    """Operators no shipped rule uses yet, checked against values computed by hand."""
    from trainwatch.alerts.evaluate import Evaluator, History
    from trainwatch.alerts.promql import parse
    h = History()
    for rank, node, value in (("0", "a", 1.0), ("1", "a", 1.0), ("2", "b", 1.0),
                              ("3", "b", 4.0)):
        h.add({"__name__": "t", "job": "j", "node": node, "rank": rank}, 0, value)
    ev = Evaluator(h)
    ratio = ev.vector(parse("t / on(job) group_left() quantile by (job) (0.5, t) > 1.5").root, 0)
    assert ratio == {(("job", "j"), ("node", "b"), ("rank", "3")): 4.0}
    node = ev.vector(parse("avg by (job, node) (t) / on(job) group_left() "
                           "quantile by (job) (0.5, avg by (job, node) (t))").root, 0)
    assert node == {(("job", "j"), ("node", "a")): 1 / 1.75,
                    (("job", "j"), ("node", "b")): 2.5 / 1.75}
    assert ev.vector(parse('t{rank=~"1|3"} unless t{node="b"}').root, 0) == {
        (("__name__", "t"), ("job", "j"), ("node", "a"), ("rank", "1")): 1.0}
    with pytest.raises(ValueError, match="group_left"):
        ev.vector(parse("t / on(job) max by (job) (t)").root, 0)
    with pytest.raises(ValueError, match="many-to-many"):
        ev.vector(parse("max by (job) (t) / on(job) t").root, 0)
