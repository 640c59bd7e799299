"""`trainwatch diagnose` on the hard cases (issue #23), each a real torchrun job: a rank
that skips a collective on a side group, racing deaths (a peer's failure against
torchrun's order; two ranks exiting within one torchrun poll), stale status steps, a hang
killed afterwards, a rank killed while a peer finishes a slow batch, a hung DataLoader
worker, an OOM kill (a rank busy in C holding the GIL: test_diagnose_busy_in_c.py).

Every case checks the rank, the cause, that no confident claim is wrong, and that
diagnose answers within 20 s (printed). The cases run three at a time (tests/side_by_side.py).
"""

import contextlib
import os
import shutil
import signal
import tempfile
import time

import psutil
import pytest

from agent_helpers import get_json, start_agent, stop_process, wait_for
from conftest import tmpfs_mount
from diagnose_helpers import jobs_in, no_confident_wrong, stalled_for, timed_diagnose, top
from side_by_side import scenario, side_by_side
from trainwatch.rundir.beat import beat_path, read_beat
from trainwatch.host.cgroup import cgroup_dir
from trainwatch.host.cgroup import memory_cgroup as memory_cgroup_of

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def scratch(tmp_path):
    """A short folder of its own: a socket path has 107 bytes at most (pytest's folders
    under xdist are longer)."""
    folder = tempfile.mkdtemp(prefix="tw-")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _rank_skipping_a_side_group_collective_is_named(jobs, tmp_path):
    """Rank 1 skips one all_reduce on a side group, inside a phase of the user's own
    ("metrics", no collective phase by name), and goes on to the next step's gradient
    all_reduce; ranks 0 and 2 wait in the side group's collective. The rank that did not
    enter it is the culprit, not the ranks waiting in it: in diagnose and in the node
    agent's stall incident, which reads the collective counters the ranks' beats carry,
    not their phases (issue #36: it named rank 0, "outside a collective (phase metrics)")."""
    step = 12
    job = jobs(nproc=3, FAULT="skip_side", FAULT_RANK="1", FAULT_STEP=str(step))
    agent, url = start_agent(tmp_path, "--run-dir", str(job.run.root))
    try:
        job.wait(lambda s: s[1]["step"] == step + 1 and s[0]["step"] == step
                 and stalled_for(2)(s), "ranks 0 and 2 waiting in the side group")
        code, report, _ = timed_diagnose(job.run, "--stall-after", "1")
        incident = wait_for(lambda: next((f for f in get_json(url + "/status")["findings"]
                                          if f["kind"] == "stall_incident"
                                          and len(f["culprit_ranks"] + f["waiting_ranks"]) == 3),
                                         None), 90,
                            what="the agent's stall incident of the 3 ranks")
    finally:
        stop_process(agent)
    assert incident["culprit_ranks"] == [1] and incident["waiting_ranks"] == [0, 2], incident
    assert incident["culprit_rank"] == 1 and incident["stall_kind"] == "stuck", incident
    assert f"did not enter collective #{step + 1} of process group 1" in incident["reason"]
    assert code == 1
    finding = top(report)
    assert finding["category"] == "collective_desync" and finding["ranks"] == [1], finding
    assert finding["confidence"] == "high"
    # Which collective: the side group's all_reduce #step+1 (sequence numbers start at 1).
    assert f"#{step + 1}" in finding["title"] and "process group 1" in finding["title"], finding
    assert "all_reduce" in finding["title"], finding
    assert any("[0, 2] wait" in e for e in finding["evidence"]), finding["evidence"]
    no_confident_wrong(report, 1)
    # The post-mortem, once every process is gone, reads the dumps that diagnose left in
    # diagnostics/ (issue #36: it said "rank(s) [0, 2] were outside a collective").
    job.stop()
    code, report, _ = timed_diagnose(job.run, "--stall-after", "1")
    finding = top(report, "rank_stuck")
    assert finding["ranks"] == [1] and finding["confidence"] == "high", finding
    assert f"did not enter collective #{step + 1} of process group 1" in finding["title"]
    assert any(e.startswith("saved evidence used: diagnostics/dump-rank-00000.json")
               for e in finding["evidence"]), finding["evidence"]
    no_confident_wrong(report, 1)


def _racing_deaths_weigh_a_peers_failure_against_the_launchers_order(jobs):
    """Rank 1 is SIGKILLed while rank 0 waits for it in the all_reduce; rank 0 fails at
    once ("Connection reset by peer") and aborts. torchrun sees both exits in one poll and names the
    lower rank its root cause. Rank 0's error is a peer's failure seen from it: rank 1 is
    named, with less than high confidence, and the disagreement is said."""
    job = jobs(launcher_args=("--monitor-interval=3",), ABORT_ON_ERROR="1")
    job.wait_step(8)
    os.kill(job.pid(1), signal.SIGKILL)
    job.proc.wait(timeout=60)
    code, report, _ = timed_diagnose(job.run)
    assert code == 1
    root = report["evidence"]["launcher"]["root_cause"]
    assert root["rank"] == 0, (root, job.tail())  # the race this test is about
    dead = top(report, "rank_dead")
    assert dead["ranks"] == [1], dead
    assert dead["confidence"] == "medium", dead
    text = " ".join(dead["evidence"])
    assert "SIGKILL" in text and "peer" in text and "root cause" in text, dead["evidence"]
    no_confident_wrong(report, 1)


def _two_ranks_exiting_within_one_poll_are_both_named_not_torchruns_pick(jobs):
    """Rank 1 exits with code 3 and rank 0 with code 4 5 ms later, at a moment they agreed
    on: torchrun sees both in one poll (0.1 s) and names rank 0, the lower. Nothing the
    ranks left orders them: both are named with their exit codes, at medium confidence.
    When torchrun's poll falls between them it stops the other (which may still exit with its
    own code before the signal lands): the rank it saw first alone."""
    job = jobs(FAULT="racing", FAULT_RANK="1", FAULT_STEP="4", FAULT_ARG="0:0.005:exit")
    job.proc.wait(timeout=60)
    code, report, _ = timed_diagnose(job.run)
    assert code == 1
    launcher = report["evidence"]["launcher"]
    exits = {x["rank"]: x["exitcode"] for x in [launcher["root_cause"], *launcher["failures"]]}
    dead = top(report, "rank_dead")
    print(f"torchrun's root cause: rank {launcher['root_cause']['rank']}; exits {exits}; "
          f"diagnose: {dead['title']} ({dead['confidence']})")
    # torchrun stopped a rank its poll found still running ("Sending process N closing
    # signal"): the poll fell between the two exits, even when the rank then exited with
    # its own code before the signal landed (1 run in ~15 on a loaded machine).
    torn_down = set(launcher.get("torn_down") or [])
    pids = {x["rank"]: x["pid"] for x in [launcher["root_cause"], *launcher["failures"]]}
    if exits == {0: 4, 1: 3} and not torn_down & set(pids.values()):  # both within one poll
        assert dead["ranks"] == [0, 1] and dead["confidence"] == "medium", (
            dead["title"], dead["evidence"], launcher["root_cause"], launcher["failures"])
        assert "within one torchrun poll" in dead["title"], dead["title"]
        text = " ".join(dead["evidence"])
        assert "rank 0 (exit code 4)" in text and "rank 1 (exit code 3)" in text, text
        no_confident_wrong(report, 1)
    else:  # the poll fell between them: the rank torchrun saw first, alone (rank 1, or rank 0
        # when a loaded machine held rank 1 past the moment they agreed on)
        first = launcher["root_cause"]["rank"]
        assert dead["ranks"] == [first], (dead, launcher, job.tail())
        no_confident_wrong(report, first)


def _a_dead_ranks_step_comes_from_its_beat_not_a_stale_status(jobs, tmp_path):
    """The status folder (a small tmpfs) fills up at step ~30: status files stop changing,
    the fixed-size beat files go on. Rank 1 dies at step 60: diagnose says step 60."""
    with tmpfs_mount(tmp_path / "run" / "status", "1m") as status_dir:
        job = jobs()
        job.wait_step(30)
        filler = status_dir / "filler"
        with open(filler, "wb") as fh:  # fill the tmpfs: ENOSPC for every new status file
            try:
                while True:
                    fh.write(b"\0" * 65536)
            except OSError:
                pass
        stale = {r: s["step"] for r, s in job.statuses().items()}
        wait_for(lambda: all((beat(status_dir, r) or {}).get("step", 0) >= 60 for r in (0, 1)),
                 120, what="both ranks at step 60 by their beats")
        assert all(s["step"] <= max(stale.values()) + 5 for s in job.statuses().values())
        os.kill(job.pid(1), signal.SIGKILL)
        job.proc.wait(timeout=60)
        code, report, _ = timed_diagnose(job.run)
    assert code == 1
    dead = top(report, "rank_dead")
    assert dead["ranks"] == [1], dead
    step = report["evidence"]["ranks"]["1"]["step"]
    done = report["evidence"]["ranks"]["1"]["steps_completed"]  # from the beat file too
    assert step >= 60 and done in (step, step + 1), report["evidence"]["ranks"]["1"]
    assert f"step {step} ({done} completed) (from its beat file" in dead["evidence"][0], \
        dead["evidence"]
    assert "could not write its status" in dead["evidence"][0], dead["evidence"]


def beat(status_dir, rank: int):
    return read_beat(beat_path(status_dir, rank))


def _post_mortem_of_a_killed_hang_says_it_was_stalled_before_it_died(jobs, tmp_path):
    """Rank 1 blocks in data loading, rank 0 waits in the all_reduce; after a while the
    operator stops the job (SIGTERM to torchrun). Afterwards diagnose says the run was
    already stalled before it died, and where each rank was: the deaths ended a hang."""
    fifo = tmp_path / "never-written.fifo"
    os.mkfifo(fifo)
    job = jobs(FAULT="data_fifo", FAULT_RANK="1", FAULT_STEP="12", FAULT_ARG=str(fifo))
    job.wait(lambda s: s[1]["phase"] == "data" and stalled_for(8)(s), "stalled for 8 s")
    job.proc.send_signal(signal.SIGTERM)
    job.proc.wait(timeout=60)
    code, report, _ = timed_diagnose(job.run)
    assert code == 1
    finding = top(report)
    assert "stalled" in finding["title"] and "before" in finding["title"], finding
    assert finding["ranks"] == [1], finding
    assert finding["confidence"] != "high", finding
    text = " ".join(finding["evidence"])
    assert "phase data" in text and "[0]" in text, finding["evidence"]
    no_confident_wrong(report, 1)


def _killed_rank_is_dead_not_a_stall_while_a_peer_finishes_a_slow_batch(jobs):
    """Rank 1 is SIGKILLed at step 12 while rank 0 spends 8 s loading that step's batch and
    stops on SIGTERM only after the step (as Checkpoints does): rank 0 beats on for 8 s
    without a step, then dies in the all_reduce. The run died when rank 1 was killed (the
    launcher saw it at once), not after a stall: rank 1 killed by SIGKILL, high confidence,
    and no finding says the run was stalled."""
    job = jobs(FAULT="killed_peer_busy", FAULT_RANK="1", FAULT_STEP="12", FAULT_ARG="8")
    job.proc.wait(timeout=120)
    code, report, _ = timed_diagnose(job.run)
    assert code == 1
    finding = top(report)
    assert finding["category"] == "rank_dead" and finding["ranks"] == [1], finding
    assert finding["confidence"] == "high", finding
    assert "SIGKILL" in " ".join(finding["evidence"]), finding["evidence"]
    stalls = [f["title"] for f in report["findings"] if "stall" in f["title"]]
    assert not stalls, stalls
    no_confident_wrong(report, 1)


def _hung_data_loader_worker_is_named_with_its_stack(scratch, jobs, tmp_path):
    """Rank 1's DataLoader (2 worker processes) waits in _try_get_data for a worker that
    blocks opening a FIFO nobody writes: diagnose names that worker (pid, stack, cause)."""
    fifo = tmp_path / "never-written.fifo"
    os.mkfifo(fifo)
    # DataLoader workers hand tensors back through a Unix socket in TMPDIR: a short one.
    job = jobs(FAULT="worker_fifo", FAULT_RANK="1", FAULT_STEP="12", FAULT_ARG=str(fifo),
               TMPDIR=scratch)
    job.wait(lambda s: s[1]["phase"] == "data" and (s[1]["step"] or 0) >= 10
             and stalled_for(3)(s), "rank 1 waiting for its data worker")
    rank_pid = job.pid(1)
    code, report, _ = timed_diagnose(job.run, "--stall-after", "2")
    assert code == 1
    finding = top(report)
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [1], finding
    assert "data loading" in finding["title"], finding["title"]
    workers = {c.pid for c in psutil.Process(rank_pid).children()}
    blocked = [w for w in report["evidence"]["ranks"]["1"]["data_workers"] if w.get("blocked")]
    assert len(blocked) == 1 and blocked[0]["pid"] in workers, blocked
    pid = blocked[0]["pid"]
    assert f"worker pid {pid}" in finding["title"], finding["title"]
    assert any("__getitem__" in line for line in blocked[0]["stack"]), blocked[0]
    assert finding["cause"]["kind"] == "fifo_open" and finding["cause"]["path"] == str(fifo)
    assert any(f"pid {pid}" in e and "__getitem__" in e for e in finding["evidence"]), \
        finding["evidence"]
    no_confident_wrong(report, 1)


@contextlib.contextmanager
def memory_cgroup(tmp_path):
    """A real memory cgroup with a 1.5 GiB limit (v2 where the memory controller is there,
    else v1), removed afterwards; skips where cgroups cannot be made (not root, no
    controller)."""
    limit = 3 << 29
    own = memory_cgroup_of("self")
    if own is None:
        pytest.skip("no memory cgroup on this host (/proc/self/cgroup)")
    version, _, path = own.partition(":")
    base = cgroup_dir(own)
    name = f"trainwatch-oom-test-{os.getpid()}"
    folder = f"{base}/{name}" if base else None
    try:
        os.mkdir(folder)
        limit_file = "memory.limit_in_bytes" if version == "v1" else "memory.max"
        with open(f"{folder}/{limit_file}", "w") as fh:
            fh.write(str(limit))
    except (OSError, TypeError) as exc:
        pytest.skip(f"cannot make a memory cgroup under {base}: {exc}")
    try:
        yield f"{version}:{path.rstrip('/')}/{name}", folder, limit
    finally:
        deadline = time.time() + 30
        while True:
            try:
                os.rmdir(folder)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)


def _oom_kill_is_named_with_its_cgroup_and_limit(memory_cgroup, jobs):
    """The job runs in a memory cgroup; rank 1 allocates until the kernel's OOM killer
    kills it (SIGKILL). diagnose reads the kernel log and the cgroup the rank recorded."""
    cgroup, folder, limit = memory_cgroup
    job = jobs(prefix=("sh", "-c", f'echo $$ > {folder}/cgroup.procs && exec "$@"', "sh"),
               FAULT="oom", FAULT_RANK="1", FAULT_STEP="10")
    assert job.proc.wait(timeout=180) != 0, job.tail()
    code, report, _ = timed_diagnose(job.run)
    assert code == 1
    dead = top(report, "rank_dead")
    assert dead["ranks"] == [1], dead
    assert f"killed by the OOM killer (cgroup {cgroup.partition(':')[2]}" in dead["title"], dead
    assert f"limit {limit / 2**30:.2f} GiB" in dead["title"], dead["title"]
    assert any("kernel log" in e and "Killed process" in e for e in dead["evidence"])
    assert any("1 OOM kill(s)" in e for e in dead["evidence"]), dead["evidence"]
    assert dead["confidence"] == "high"
    assert not [f for f in report["findings"] if "stalled" in f["title"]], report["findings"]
    no_confident_wrong(report, 1)


# --------------------------------------------------------------------------- side by side

WITH = {"jobs": jobs_in, "scratch": scratch, "memory_cgroup": memory_cgroup}


# The two races first and alone, before the others start side by side: what they test is
# the order of two exits a few milliseconds apart, which a loaded machine stretches.

def test_racing_deaths_weigh_a_peers_failure_against_the_launchers_order(tmp_path):
    scenario(_racing_deaths_weigh_a_peers_failure_against_the_launchers_order, WITH)(tmp_path)


def test_two_ranks_exiting_within_one_poll_are_both_named_not_torchruns_pick(tmp_path):
    scenario(_two_ranks_exiting_within_one_poll_are_both_named_not_torchruns_pick, WITH)(tmp_path)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The other cases three at a time: most of a case is waiting for its fault to show."""
    with side_by_side(request, tmp_path_factory, {
        "test_rank_skipping_a_side_group_collective_is_named":
            scenario(_rank_skipping_a_side_group_collective_is_named, WITH),
        "test_killed_rank_is_dead_not_a_stall_while_a_peer_finishes_a_slow_batch":
            scenario(_killed_rank_is_dead_not_a_stall_while_a_peer_finishes_a_slow_batch, WITH),
        "test_post_mortem_of_a_killed_hang_says_it_was_stalled_before_it_died":
            scenario(_post_mortem_of_a_killed_hang_says_it_was_stalled_before_it_died, WITH),
        "test_hung_data_loader_worker_is_named_with_its_stack":
            scenario(_hung_data_loader_worker_is_named_with_its_stack, WITH),
        "test_oom_kill_is_named_with_its_cgroup_and_limit":
            scenario(_oom_kill_is_named_with_its_cgroup_and_limit, WITH),
        "test_a_dead_ranks_step_comes_from_its_beat_not_a_stale_status":
            scenario(_a_dead_ranks_step_comes_from_its_beat_not_a_stale_status, WITH),
    }, at_once=3) as running:
        yield running


def test_rank_skipping_a_side_group_collective_is_named(runs, request):
    runs.result(request)


def test_a_dead_ranks_step_comes_from_its_beat_not_a_stale_status(runs, request):
    runs.result(request)


def test_post_mortem_of_a_killed_hang_says_it_was_stalled_before_it_died(runs, request):
    runs.result(request)


def test_killed_rank_is_dead_not_a_stall_while_a_peer_finishes_a_slow_batch(runs, request):
    runs.result(request)


def test_hung_data_loader_worker_is_named_with_its_stack(runs, request):
    runs.result(request)


def test_oom_kill_is_named_with_its_cgroup_and_limit(runs, request):
    runs.result(request)
