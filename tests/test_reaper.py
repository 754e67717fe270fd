"""The session's reaper fails the run when a test leaves a process behind, and names it and the
test that started it (a real inner pytest run with our conftest)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

ROOT = Path(__file__).resolve().parents[1]

LEAKY = '''
import subprocess


def test_leaks():
    subprocess.Popen(["sleep", "321"])  # never waited for, never killed


def test_tidy():
    proc = subprocess.Popen(["sleep", "322"])
    proc.kill()
    proc.wait()
'''


def inner_run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(body)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def sleepers(seconds: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", seconds]]


def test_a_leftover_process_fails_the_run_and_is_named(tmp_path):
    out = inner_run(tmp_path, LEAKY)
    assert out.returncode != 0, out.stdout
    assert "processes left behind by the tests" in out.stdout, out.stdout
    assert "'sleep 321', left by test_inner.py::test_leaks" in out.stdout, out.stdout
    assert "sleep 322" not in out.stdout
    assert sleepers("321") == [], "the reaper did not kill the leftover"


def test_a_tidy_run_passes(tmp_path):
    out = inner_run(tmp_path, LEAKY.split("def test_leaks")[0] + "def test_tidy" + LEAKY.split("def test_tidy")[1])
    assert out.returncode == 0, out.stdout + out.stderr
