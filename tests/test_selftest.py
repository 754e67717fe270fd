"""``dedloc --self-test`` from the source tree: a real worker, a real DHT on 127.0.0.1, real
training steps (the installer test runs the same from the frozen bundle)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dedloc_core.errors import EXIT_EXPLAINED

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast


def selftest(*args: str, home, timeout: float = 240):
    env = {**os.environ, "DEDLOC_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "dedloc_core.cli", "--self-test", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_self_test_passes(tmp_path):
    out = selftest("--keep", str(tmp_path / "kept"), home=tmp_path / "home")
    assert out.returncode == 0, out.stdout + out.stderr
    for step in ("catalog", "hardware", "data", "worker", "DHT", "training", "stop"):
        assert f"  ok  {step}" in out.stdout, out.stdout
    assert "2 global steps of tiny-lm alone" in out.stdout
    assert (tmp_path / "kept" / "worker.log").exists()
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*.sqlite3"))


def test_self_test_names_the_failing_step(tmp_path):
    out = selftest("--experiment", "no-such-experiment", home=tmp_path)
    assert out.returncode == EXIT_EXPLAINED
    assert "Self-test failed at: catalog" in out.stderr and "no experiment 'no-such-experiment'" in out.stderr

    out = selftest("--timeout", "0.5", home=tmp_path)
    assert out.returncode == EXIT_EXPLAINED
    # 0.5 s runs out while the worker starts (no hello yet) or while it joins: either is named.
    assert "Self-test failed at: worker" in out.stderr or "Timed out after 0.5 s" in out.stderr, out.stderr


def test_cli_takes_the_frozen_builds_spellings(tmp_path):
    """``dedloc --catalog-child`` (how the frozen app checks the catalog) answers one JSON line."""
    env = {**os.environ, "DEDLOC_HOME": str(tmp_path)}
    env.pop("DEDLOC_CATALOG_URL", None)
    out = subprocess.run([sys.executable, "-m", "dedloc_core.cli", "--catalog-child"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["source"] == "default" and answer["error"] is None
