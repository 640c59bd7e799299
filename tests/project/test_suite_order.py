"""CI runs the suite on two xdist workers, a file per worker: the longest files must start
first (tests/suite_order_helpers.py), or the last one started keeps a worker busy alone
while the other idles. xdist's own default (most tests first) puts one-test end-to-end
files last; a generated suite on one worker shows which order the files really run in."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_slow_files_start_before_files_of_many_quick_tests(tmp_path):
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from suite_order_helpers import keep_our_file_order, longest_files_first\n\n"
        "def pytest_configure(config):\n    keep_our_file_order(config)\n\n"
        "def pytest_collection_modifyitems(config, items):\n    longest_files_first(items)\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: a long run\n")
    (tmp_path / "test_a_quick.py").write_text(
        "".join(f"def test_quick_{i}():\n    pass\n\n" for i in range(5)))
    (tmp_path / "test_b_one_long.py").write_text(
        "import pytest\n\n@pytest.mark.slow\ndef test_long():\n    pass\n")
    (tmp_path / "test_c_drill.py").write_text(  # named in LONGEST_FILES, by its file name
        "def test_x():\n    pass\n\ndef test_y():\n    pass\n")
    (tmp_path / "test_drill.py").write_text("def test_drill():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "xdist.plugin",  # xdist only
                           "-p", "no:cacheprovider", "-n", "1", "--dist", "loadfile", "-v",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = [line.split("PASSED ")[1].split("::")[0] for line in done.stdout.splitlines()
           if "PASSED " in line]
    files = list(dict.fromkeys(ran))
    assert files == ["test_drill.py", "test_b_one_long.py", "test_a_quick.py",
                     "test_c_drill.py"], done.stdout[-3000:]
