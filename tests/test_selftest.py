"""``dedloc --self-test`` from the source tree: a real worker, a real DHT on 127.0.0.1, real
training steps (the installer test runs the same from the frozen bundle)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dedloc_core.errors import EXIT_EXPLAINED

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"bert": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
         "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4),
         "gpt2": dict(n_embd=32, n_layer=2, n_head=4)}

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


def organizers_catalog(tmp_path: Path, kind: str, family: str, run: Callable) -> tuple[list[str], str]:
    """``dedloc data prepare`` (through ``run``: the source or the bundle) on a slice of the corpus, and a
    catalog signed by a fresh key with a small declared model on those shards: the self-test's options
    for it, and the recipe."""
    from netlab.peers import signed_catalog

    texts = tmp_path / "texts"
    texts.mkdir()
    corpus = (ROOT / "resources" / "corpus" / "shard-000.txt").read_text(encoding="utf-8")
    (texts / "a.txt").write_text(corpus[:100_000], encoding="utf-8")
    shards = tmp_path / "shards"
    out = run("data", "prepare", str(texts), "--out", str(shards), "--kind", kind, "--family", family,
              "--seq-len", "64", "--vocab-size", "512")
    assert out.returncode == 0, out.stderr[-3000:]
    entry = json.loads((shards / "catalog-entry.json").read_text())
    params = entry["recipe_params"]
    params["config"].update(SMALL.get(family, SMALL["bert"]))
    exp = dict(id=f"organizer-{family}", title="An organizer's model", description="self-test", organizer="test",
               recipe=entry["recipe"], recipe_params=params, run_id=f"organizer_{family}", initial_peers=[],
               target_batch_size=32, batch_size_per_step=8, matchmaking_time=1.0, averaging_timeout=10.0,
               hardware={"ram_gb": 1, "cpu_cores": 1, "disk_gb": 1, "gpu_required": False},
               data={"base_url": None, **entry["data"]}, needs_token=False, status="active", expires_at=None)
    catalog, key = signed_catalog(exp, tmp_path / "catalog")
    return ["--catalog", str(catalog), "--trusted-key", str(key), "--experiment", exp["id"],
            "--data-dir", str(shards)], entry["recipe"]


def test_an_organizers_experiment_from_its_own_catalog(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "dedloc_core.cli", *args], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)

    options, recipe = organizers_catalog(tmp_path, "causal", "gpt2", run)
    out = selftest(*options, "--steps", "1", home=tmp_path / "home")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"ok  training: 1 global step of {recipe} alone" in out.stdout, out.stdout
    assert "catalog.json verified; experiment 'organizer-gpt2'" in out.stdout

    untrusted = [o for i, o in enumerate(options) if "--trusted-key" not in options[max(0, i - 1):i + 1]]
    out = selftest(*untrusted, home=tmp_path / "home")
    assert out.returncode == EXIT_EXPLAINED
    assert "Self-test failed at: catalog" in out.stderr and "does not trust" in out.stderr, out.stderr
    assert "--trusted-key" in out.stderr  # what to do
