"""A script that installs its own SIGTERM handler after ``Checkpoints.from_env`` (a common
"save on preemption" habit) silently replaced trainwatch's: a stop then saved nothing and
did not exit 75, and nothing said so. The loop's first step now warns, naming the handler
that won, on every rank that has one."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import signal, sys, torch
    from trainwatch import Checkpoints
    ckpt = Checkpoints.from_env(every_steps=1000)
    model = torch.nn.Linear(2, 1)
    def my_handler(signum, frame):
        sys.exit(3)
    if sys.argv[1] == "replace":
        signal.signal(signal.SIGTERM, my_handler)
    start = ckpt.resume(model=model)
    for step in range(start, 3):
        ckpt.maybe_save(step + 1, model=model)
    ckpt.close()
""")


def _run(tmp_path, how):
    return subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TRAINWATCH_RUN_DIR":
                                            str(tmp_path / how)})


def test_a_replaced_sigterm_handler_is_named_once(tmp_path):
    done = _run(tmp_path, "replace")
    assert done.returncode == 0, done.stderr
    told = [line for line in done.stderr.splitlines() if "SIGTERM" in line]
    assert len(told) == 1, done.stderr
    assert "my_handler" in told[0] and "not save" in told[0], told


def test_nothing_is_said_when_the_handler_is_trainwatchs(tmp_path):
    done = _run(tmp_path, "keep")
    assert done.returncode == 0, done.stderr
    assert "SIGTERM" not in done.stderr, done.stderr
