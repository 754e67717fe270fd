"""Catalog sources: an organizer's catalog added from a dedloc://add link or a URL and a key
fingerprint, pinned to that key; another key's catalog is refused and the last good copy stays;
`dedloc catalog add | list | remove`; all over real HTTP on 127.0.0.1 and real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Organizer

from dedloc_core.catalog import child, generate_keypair, load_private_key, sources
from dedloc_core.errors import EXIT_EXPLAINED, CatalogError
from dedloc_core.organizer.httpserve import FileServer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def organizer(tmp_path, monkeypatch):
    monkeypatch.setenv("DEDLOC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DEDLOC_CATALOG_URL", raising=False)
    with FileServer() as server:
        yield Organizer(server)


def dedloc(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEDLOC_HOME": str(home), "PYTHONPATH": str(ROOT)}
    env.pop("DEDLOC_CATALOG_URL", None)
    return subprocess.run([sys.executable, "-m", "dedloc_core.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL)


def test_links_parse_and_bad_ones_are_refused(organizer):
    link = sources.add_link(organizer.url, organizer.key_b64)
    assert sources.parse_link(link) == (organizer.url, organizer.key_b64)
    for bad in ("https://example.org/add?url=x", "dedloc://add?url=https://x/c.json",
                f"dedloc://add?url=file:///etc/passwd&key={organizer.key_b64}",
                "dedloc://add?url=https://x/c.json&key=bm90IGEga2V5"):
        with pytest.raises(CatalogError):
            sources.parse_link(bad)


def test_cli_add_list_remove_and_the_experiments_appear(organizer, tmp_path):
    home = tmp_path / "home"
    link = sources.add_link(organizer.url, organizer.key_b64)
    refused = dedloc("catalog", "add", link, home=home)  # no terminal to ask on, no --yes
    assert refused.returncode == EXIT_EXPLAINED and "--yes" in refused.stderr
    out = dedloc("catalog", "add", link, "--yes", home=home)
    assert out.returncode == 0, out.stderr
    assert f"organizer: {organizer.name}" in out.stdout and sources.fingerprint(organizer.key_b64) in out.stdout
    listed = dedloc("catalog", "list", home=home)
    assert organizer.url in listed.stdout and sources.fingerprint(organizer.key_b64) in listed.stdout

    result = child.load()  # the app's way: in the catalog child process
    assert result.error is None
    ids = [e.id for e in result.catalog.experiments]
    assert "tiny-lm-demo" in ids and "org-exp" in ids  # the shipped catalog, then the organizer's
    assert result.origins["org-exp"] == organizer.url and result.origins["tiny-lm-demo"] is None
    state = next(s for s in result.sources if s.url == organizer.url)
    assert state.name == organizer.name and state.experiments == 1 and state.error is None

    assert dedloc("catalog", "remove", sources.fingerprint(organizer.key_b64), home=home).returncode == 0
    assert "org-exp" not in [e.id for e in child.load().catalog.experiments]


def test_url_and_fingerprint_fetch_the_key_and_a_wrong_fingerprint_is_refused(organizer, tmp_path):
    home = tmp_path / "home"
    good = dedloc("catalog", "add", organizer.url, "--fingerprint", sources.fingerprint(organizer.key_b64), "--yes",
                  home=home)
    assert good.returncode == 0, good.stderr
    wrong = dedloc("catalog", "add", organizer.url, "--fingerprint", "0123456789abcdef", "--yes", home=home)
    assert wrong.returncode == EXIT_EXPLAINED and "do not add this source" in wrong.stderr


def test_a_catalog_signed_by_another_key_is_refused_and_the_last_good_stays(organizer, tmp_path):
    home = tmp_path / "home"
    link = sources.add_link(organizer.url, organizer.key_b64)
    assert dedloc("catalog", "add", link, "--yes", home=home).returncode == 0
    first = child.load()
    assert [e.title for e in first.catalog.experiments if e.id == "org-exp"] == ["Organizer's experiment"]

    intruder = load_private_key(generate_keypair("pw")[0], "pw")
    organizer.publish(intruder, title="Hijacked experiment")  # the server now serves another key's catalog
    later = child.load()
    state = next(s for s in later.sources if s.url == organizer.url)
    assert state.error is not None and state.error.code == "untrusted_key"
    assert "another key than the one you trusted" in state.error.message
    assert [e.title for e in later.catalog.experiments if e.id == "org-exp"] == ["Organizer's experiment"]
    with pytest.raises(CatalogError, match="not trust"):  # checking it as new fails the same way
        sources.inspect(organizer.url, organizer.key_b64)


def test_a_broken_sources_file_is_kept_aside(tmp_path):
    path = tmp_path / "sources.json"
    path.write_text('{"version": 1, "sources": [{"url": "ftp://x", "key": "k"}]}')
    listed = sources.SourceList(path)
    assert listed.added == [] and "kept as" in listed.warning
    assert list(tmp_path.glob("sources.json.broken-*"))
