"""A rank of the reference trainer that fails leaves at once, as one that finished does.

Before, a failure (a survivor's collective raising after its peer died) went through the
interpreter's teardown of torch, 7-13 s for a survivor at load ~40, and torchrun restarts
only when every worker is gone: every restart after a failure waited for it. main() has
closed the checkpointer (its dying gasp), the telemetry and journaled the failure by then."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, runpy, sys
    import trainwatch.trainer.train as train
    def failing(argv=None):
        {how}
    train.main = failing
    atexit.register(lambda: print("interpreter teardown ran", flush=True))
    runpy.run_module("trainwatch.trainer", run_name="__main__")
""")


def _run(how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(how=how)], capture_output=True,
                          text=True, timeout=120)


def test_a_failed_rank_says_what_failed_and_skips_the_interpreter_teardown():
    done = _run("raise RuntimeError('Connection closed by peer')")
    assert done.returncode == 1, done.stderr
    assert "Traceback" in done.stderr and "RuntimeError: Connection closed by peer" in done.stderr
    assert "interpreter teardown ran" not in done.stdout


def test_a_finished_rank_exits_with_mains_code_and_sys_exit_is_left_alone():
    assert _run("return 75").returncode == 75
    done = _run("raise SystemExit(2)")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "interpreter teardown ran" in done.stdout  # sys.exit: Python's own way out
