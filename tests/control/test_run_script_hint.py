"""`trainwatch run RUN_DIR -- train.py` (a script given as the program): exit 2 saying how
to start it (python or torchrun), not only that it is not on PATH."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("program", ["train.py", "./train.py"])
def test_a_python_script_as_the_program_says_how_to_start_it(tmp_path, program):
    (tmp_path / "train.py").write_text("print('hi')\n")
    out = subprocess.run([sys.executable, "-m", "trainwatch", "run", str(tmp_path / "run"),
                          "--no-live", "--", program, "--lr", "3e-4"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "key 'COMMAND'" in out.stderr
    assert f"-- python {program} --lr 3e-4" in out.stderr, out.stderr
    assert f"-- torchrun --standalone --nproc-per-node N {program} --lr 3e-4" in out.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("logs/*"))
