"""The tray app's catalog check in a child process gives the same result as checking in-process,
for a good catalog and for a tampered one; when the child fails, the app keeps its last good
catalog and says so, without checking anything (or loading cryptography) itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dedloc_core.catalog import child as catalog_child


def test_child_loads_the_signed_catalog_like_the_app_would(signed_catalog_server, tmp_path, monkeypatch):
    monkeypatch.setenv("DEDLOC_HOME", str(tmp_path / "home"))
    result = catalog_child.load()
    here = catalog_child.load_here()
    assert result.error is None and result.source in ("new", "last_good")
    assert [e.id for e in result.catalog.experiments] == ["tiny-lm-test"]
    assert result.catalog == here.catalog


def test_child_reports_a_tampered_catalog_and_keeps_the_last_good(signed_catalog_server, tmp_path, monkeypatch):
    monkeypatch.setenv("DEDLOC_HOME", str(tmp_path / "home"))
    good = catalog_child.load()
    assert good.error is None
    envelope = json.loads(signed_catalog_server._routes["/catalog.json"])
    envelope["payload"] = envelope["payload"].replace("Tiny LM (test)", "Tiny LM (evil)")
    signed_catalog_server.add("/catalog.json", json.dumps(envelope).encode())
    bad = catalog_child.load()
    assert bad.error is not None and bad.error.code == "tampered" and "altered" in bad.error.message
    assert bad.source == "last_good" and bad.catalog == good.catalog


def test_a_failing_child_keeps_the_last_good_catalog(signed_catalog_server, tmp_path, monkeypatch):
    monkeypatch.setenv("DEDLOC_HOME", str(tmp_path / "home"))
    good = catalog_child.load()
    assert good.error is None
    monkeypatch.setattr(catalog_child, "command", lambda: [sys.executable, "-c", "raise SystemExit('disk on fire')"])
    kept = catalog_child.load(previous=good)
    assert kept.catalog == good.catalog and kept.source == good.source
    assert kept.error.code == "check_failed" and "disk on fire" in kept.error.message
    assert "loaded before" in kept.error.message
    first = catalog_child.load()  # nothing loaded before: nothing to show, and it says so
    assert first.catalog is None and first.error.code == "check_failed" and "no catalog" in first.error.message


def test_a_failing_child_loads_no_cryptography_here(signed_catalog_server, tmp_path):
    code = """
import sys
from dedloc_core.catalog import child
child.command = lambda: ["false"]
result = child.load()
print(result.error.code, "cryptography" in sys.modules)
"""
    env = {**os.environ, "DEDLOC_HOME": str(tmp_path / "home"), "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["check_failed", "False"]
