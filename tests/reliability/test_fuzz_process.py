"""tests/reliability/test_fuzz.py in its own interpreter, when the suite runs on pytest-xdist workers.

Why: under `-n 2` a worker once died of a segfault inside protobuf's (upb's) FromString on a fuzzed payload, in the
fuzz server's thread, after the worker had run other files in the same process; the same file passes alone and after
the soak and fault files serially. The crash did not reproduce on demand, so its cause is not known (issue #64). What
is known: a worker crash must not take other files' tests with it, nor hang the run (pytest-xdist 3.8.0's loadfile
scheduler hangs when it replaces a crashed worker; tests/conftest.py says how `make test` avoids that). So on a worker
the fuzz file runs here, in a fresh `python -m pytest` exactly as a serial run has it: a crash fails this one test with
the child's output (faulthandler's traceback included) and the rest of the run goes on. Run serially (no xdist),
test_fuzz.py is collected as usual and this file is not (tests/reliability/conftest.py).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fuzz_file_passes_in_its_own_process() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", "tests/reliability/test_fuzz.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout[-8000:]}\n{done.stderr[-4000:]}"
    assert re.search(r"^2 passed", done.stdout, re.M), done.stdout[-2000:]  # both fuzz tests ran (a new one: update this count)
