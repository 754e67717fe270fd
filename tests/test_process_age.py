"""How old the worker's process is, for its "Ready to train N s after the process started" line."""

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_process_knows_its_age_to_the_clock_tick():
    """psutil's create_time goes through Linux's boot time, given in whole seconds: an age taken
    from it reads up to a second too old, the same error for the whole boot."""
    script = ("import time; time.sleep(0.3); from dedloc_core.engine.training import process_age; "
              "print(process_age(), flush=True); time.sleep(30)")
    began = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        age = float(child.stdout.readline())
        elapsed = time.monotonic() - began
    finally:
        child.kill()
        child.wait()
    assert 0.3 <= age <= elapsed + 0.02, (age, elapsed)
