"""The tray app's catalog check in a child process gives the same result as checking in-process,
for a good catalog and for a tampered one, and falls back to in-process when the child fails."""

from __future__ import annotations

import json
import subprocess

import pytest

from dedloc_core.catalog import child as catalog_child


def test_child_loads_the_signed_catalog_like_the_app_would(signed_catalog_server, tmp_path, monkeypatch):
    monkeypatch.setenv("DEDLOC_HOME", str(tmp_path / "home"))
    result = catalog_child.load(fallback=False)
    here = catalog_child.load_here()
    assert result.error is None and result.source in ("new", "last_good")
    assert [e.id for e in result.catalog.experiments] == ["tiny-lm-test"]
    assert result.catalog == here.catalog


def test_child_reports_a_tampered_catalog_and_keeps_the_last_good(signed_catalog_server, tmp_path, monkeypatch):
    monkeypatch.setenv("DEDLOC_HOME", str(tmp_path / "home"))
    good = catalog_child.load(fallback=False)
    assert good.error is None
    envelope = json.loads(signed_catalog_server._routes["/catalog.json"])
    envelope["payload"] = envelope["payload"].replace("Tiny LM (test)", "Tiny LM (evil)")
    signed_catalog_server.add("/catalog.json", json.dumps(envelope).encode())
    bad = catalog_child.load(fallback=False)
    assert bad.error is not None and bad.error.code == "tampered" and "altered" in bad.error.message
    assert bad.source == "last_good" and bad.catalog == good.catalog


def test_a_failing_child_falls_back_to_checking_here(signed_catalog_server, tmp_path, monkeypatch):
    monkeypatch.setenv("DEDLOC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(catalog_child, "command", lambda: ["false"])
    with pytest.raises(subprocess.CalledProcessError):
        catalog_child.load(fallback=False)
    result = catalog_child.load()
    assert result.error is None and result.catalog.experiments[0].id == "tiny-lm-test"
