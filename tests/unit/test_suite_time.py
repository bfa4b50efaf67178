"""scripts/suite_time.py reads a `--durations=0` log the way pytest writes it: per file, setup + call + teardown."""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "suite_time.py"
LOG = """\
============================= slowest durations ==============================
62.53s setup    tests/parallel/test_gradient_equivalence.py::test_one_step_equals_one_process[budget]
0.01s call     tests/parallel/test_gradient_equivalence.py::test_one_step_equals_one_process[tp2-sp]
30.00s call     tests/e2e/test_checkpoint.py::test_killed_at_a_random_step_and_resumed[grpo]
1.50s teardown tests/e2e/test_checkpoint.py::test_killed_at_a_random_step_and_resumed[grpo]
(4 durations < 0.005s hidden.  Use -vv to show these durations.)
1 failed, 3 passed in 95.00s (0:01:35)
"""


def test_per_file_seconds_and_the_summary_line(tmp_path):
    (tmp_path / "suite.log").write_text(LOG)
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "suite.log")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "    62.5 s  tests/parallel/test_gradient_equivalence.py",
        "    31.5 s  tests/e2e/test_checkpoint.py",
        "2 files, 94 s of tests in all, 0.8 min per worker at -n 2"]
