"""trainwatch plan: hand-worked examples against published figures, the CLI, bad input."""

import json
import subprocess
import sys

import pytest

from trainwatch.plan import reliability
from trainwatch.plan.cli import build_spec
from trainwatch.plan.estimate import make_plan
from trainwatch.plan.memory import layer_activation_bytes
from trainwatch.plan.spec import PlanSpec, parse_count

PLAN = [sys.executable, "-m", "trainwatch", "plan"]


def plan_for(**options):
    base = {k: None for k in ("params", "layers", "hidden", "devices", "device_type")}
    return make_plan(build_spec(None, (), {**base, **options}))


def model_state(p):
    m = p["memory"]
    return m["weights_bytes"] + m["gradients_bytes"] + m["optimizer_bytes"]


def test_7b_mixed_precision_adam_is_16_bytes_a_parameter_unless_sharded():
    # The usual back-of-envelope: 2 B bf16 weights + 2 B gradients + 12 B fp32 master and
    # Adam moments = 16 B/param: 112 GB for 7B under plain data parallelism, 14 GB a device
    # fully sharded over 8.
    dp = plan_for(params=7e9, devices=8, precision="bf16-mixed", optimizer="adamw")
    fsdp = plan_for(params=7e9, devices=8, precision="bf16-mixed", optimizer="adamw",
                    sharding="full")
    assert model_state(dp) == pytest.approx(112e9)
    assert model_state(fsdp) == pytest.approx(14e9)
    assert dp["storage"]["checkpoint_bytes"] == pytest.approx(98e9)  # 2 + 12 B saved
    verdicts = {d["device_type"]: d["verdict"] for d in dp["devices"]}
    assert verdicts["h100"] == verdicts["h200"] == "does not fit"  # 112 GB + activations
    sharded = {d["device_type"]: d["verdict"] for d in fsdp["devices"]}
    assert sharded["h100"] == "fits"
    assert sharded["a100-40"] == "tight"  # 36 GB of 40: inside the 20 % headroom


def test_zero_paper_figure_1_for_7_5b_on_64_devices():
    # Rajbhandari et al. 2020, figure 1: 7.5B parameters, 64-way data parallel:
    # 120 GB baseline, 31.4 GB (optimizer sharded), 16.6 GB (+gradients), 1.9 GB (+weights).
    figures = {"none": 120e9, "optimizer": 31.4e9, "gradients": 16.6e9, "full": 1.875e9}
    for sharding, expected in figures.items():
        p = plan_for(params=7.5e9, devices=64, precision="bf16-mixed", sharding=sharding)
        assert model_state(p) == pytest.approx(expected, rel=0.005), sharding


def test_activations_follow_korthikanti_equation_1_and_its_tensor_parallel_form():
    # s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit with dropout, eager attention; with
    # tensor + sequence parallelism all of it divides by t. GPT-3 175B's shapes.
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    spec = PlanSpec(layers=96, hidden=h, heads=a, seq=s, micro_batch=b, dropout=True,
                    flash_attention=False, precision="bf16-mixed", devices=8)
    assert layer_activation_bytes(spec, "none") == s * b * h * (34 + 5 * a * s / h)
    spec.tp = t
    assert layer_activation_bytes(spec, "none") == s * b * h * (34 + 5 * a * s / h) / t
    assert layer_activation_bytes(spec, "full") == 2 * s * b * h / t


def test_pipeline_first_stage_holds_p_micro_batches_of_its_layers():
    one = plan_for(layers=32, hidden=4096, seq=2048, devices=8, grad_accum=16)
    piped = plan_for(layers=32, hidden=4096, seq=2048, devices=8, grad_accum=16, pp=4)
    # 8 layers x 4 in flight = 32 layer-micro-batches: the same as no pipeline
    assert piped["memory"]["activations_bytes"] == pytest.approx(
        one["memory"]["activations_bytes"])
    assert model_state(piped) == pytest.approx(model_state(one) / 4)


def test_llama3_failure_figures_give_back_419_interruptions_in_54_days():
    from trainwatch.plan.sheet import Sheet
    sheet = Sheet()
    spec = PlanSpec(devices=16384)
    reliability.reliability(spec, hours=54 * 24, step_seconds=10.0, checkpoint_bytes=1e9,
                            sheet=sheet)
    assert sheet.value("reliability", "expected_interruptions") == pytest.approx(419)
    assert sheet.value("reliability", "job_mtbf_hours") == pytest.approx(54 * 24 / 419)


def test_young_daly_interval_from_save_time_and_the_jobs_mtbf():
    p = plan_for(params=7e9, devices=1024, save_seconds=60.0)
    mtbf = reliability.DEVICE_MTBF_HOURS / 1024 * 3600
    assert p["reliability"]["checkpoint_interval_seconds"] == pytest.approx(
        (2 * 60.0 * mtbf) ** 0.5)
    assert p["reliability"]["checkpoint_every_steps"] == round(
        p["reliability"]["checkpoint_interval_seconds"] / p["compute"]["step_seconds"])


def test_compute_is_6nd_plus_attention_at_the_assumed_mfu():
    p = plan_for(params=7e9, layers=32, hidden=4096, seq=4096, tokens=1e12, devices=512,
                 mfu=0.5, price_per_device_hour=2.0)
    c = p["compute"]
    per_token = 6 * 7e9 + 12 * 32 * 4096 * 4096
    assert c["training_flops"] == pytest.approx(per_token * 1e12)
    assert c["hours"] == pytest.approx(per_token * 1e12 / (512 * 989e12 * 0.5) / 3600)
    assert c["cost"] == pytest.approx(c["hours"] * 512 * 2.0)


def test_storage_counts_kept_copies_the_save_in_flight_and_the_mirror():
    p = plan_for(params=1e9, precision="fp32", checkpoints_kept=2, mirror=True,
                 data_bytes=5e9, tokens=1e9)
    ckpt = 1e9 * 12  # fp32 weights + two fp32 moments
    s = p["storage"]
    assert s["checkpoint_bytes"] == pytest.approx(ckpt)
    assert s["checkpoints_bytes"] == pytest.approx(3 * ckpt)
    assert s["mirror_bytes"] == pytest.approx(3 * ckpt)
    assert s["free_bytes_needed"] == pytest.approx(5e9 + 6 * ckpt + s["logs_bytes"])


def test_counts_accept_suffixes():
    assert parse_count("7B", "k") == 7e9 and parse_count("125M", "k") == 125e6
    assert parse_count("2T", "k") == 2e12 and parse_count("1,000", "k") == 1000


def test_cli_json_and_explain_for_the_reference_defaults():
    done = subprocess.run([*PLAN, "--json", "--explain"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["format"] == "trainwatch.plan" and data["spec"]["reference"]
    assert data["storage"]["checkpoint_bytes"] > 0
    assert "sqrt(2 x save_seconds" in data["explain"][
        "reliability.checkpoint_interval_seconds"]["formula"]
    text = subprocess.run([*PLAN, "--explain", "--params", "70B", "--devices", "64",
                           "--tp", "8", "--sharding", "full"],
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "= params / (tp·pp) x 2 B / shard_degree" in text.stdout
    assert "fits? (keep 20% of device memory free)" in text.stdout


@pytest.mark.parametrize("args, key", [
    (["--params", "lots"], "--params"),
    (["--params", "7B", "--devices", "6", "--tp", "4"], "--devices"),
    (["--layers", "30", "--hidden", "4096", "--devices", "4", "--pp", "4"], "--pp"),
    (["--params", "7B", "--shard-degree", "2"], "--shard-degree"),
    (["--set", "model.layerz=3"], "model.layerz"),
    (["--params", "7B", "--mfu", "1.5"], "--mfu"),
])
def test_bad_input_is_exit_2_naming_the_option(args, key):
    done = subprocess.run([*PLAN, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout
    assert key in done.stderr and "Traceback" not in done.stderr


def test_plain_plan_says_what_it_assumed_and_keeps_figures_in_range():
    """No options: the header says 1 x h100 is an assumption; the checkpoint interval is
    never more steps than the run has; a cost is money in --price's currency."""
    import json as _json
    import subprocess as _sp
    import sys as _sys

    from trainwatch.trainer.config import Config

    def plan(*args):
        done = _sp.run([_sys.executable, "-m", "trainwatch", "plan", *args],
                       capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    text = plan()
    assert "1 x h100 (assumed: give --devices and --device-type)" in text.splitlines()[0]
    data = _json.loads(plan("--json"))
    assert data["assumed"] == ["--devices", "--device-type"]
    assert data["reliability"]["checkpoint_every_steps"] <= Config().train.steps
    priced = plan("--devices", "8", "--device-type", "h100", "--price", "2.5")
    assert "assumed" not in priced.splitlines()[0]
    cost = next(line for line in priced.splitlines() if line.strip().startswith("cost"))
    assert "e+" not in cost and "(in the currency of --price)" in cost
