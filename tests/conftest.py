"""Shared fixtures: a real HTTP server for the corpus, tiny experiments, real worker processes,
and a reaper for anything a test leaves behind."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path

import msgspec
import psutil
import pytest

from dedloc_core.catalog import Catalog, generate_keypair, load_private_key, public_key_line, sign_catalog
from dedloc_core.organizer.httpserve import FileServer
from dedloc_core.protocol import Limits, Start
from dedloc_core.workerproc import WorkerProcess

# Workers lower themselves to nice 19; on a shared test machine other jobs would starve the test
# swarms. tests/test_pause.py checks the real priority by asking for it explicitly.
os.environ.setdefault("DEDLOC_WORKER_NICE", "0")

# The target batch of the app tests' swarm: large enough that a rejoining or paused peer catches up
# and joins averaging rounds (with 256 the seed peer alone finished a round every ~0.2 s).
APP_SWARM_BATCH = 1024

CORPUS_MANIFEST = json.loads(resources.files("resources").joinpath("corpus", "manifest.json").read_text())


def tiny_experiment(**overrides) -> dict:
    """A catalog experiment small enough for a 2-core CI machine (about 100k parameters)."""
    exp = {
        "id": "tiny-lm-test",
        "title": "Tiny LM (test)",
        "description": "test",
        "organizer": "tests",
        "recipe": "tiny-lm",
        "recipe_params": {"d_model": 64, "n_layers": 2, "n_heads": 2, "seq_len": 32, "lr": 0.01, "warmup_steps": 0},
        "run_id": "tiny_lm_test",
        "initial_peers": [],
        "target_batch_size": 512,
        "batch_size_per_step": 8,
        "matchmaking_time": 2.0,
        "averaging_timeout": 15.0,
        "hardware": {"ram_gb": 1, "cpu_cores": 1, "disk_gb": 1, "gpu_required": False},
        "data": {
            "base_url": None,
            "shards": [
                {"url": f"data/{s['name']}", "sha256": s["sha256"], "size": s["size"]}
                for s in CORPUS_MANIFEST["shards"][:2]
            ],
        },
        "needs_token": False,
        "status": "active",
        "expires_at": None,
    }
    exp.update(overrides)
    return exp


@pytest.fixture(scope="session")
def corpus_server():
    """A real HTTP server serving the shipped corpus under /data/."""
    with resources.as_file(resources.files("resources").joinpath("corpus")) as corpus:
        server = FileServer()
        server.serve_dir("/data/", Path(corpus))
        with server:
            yield server


@pytest.fixture
def spawn_worker(tmp_path):
    """Start real worker processes (``dedloc_core.engine.worker``); all are stopped after the test."""
    started: list[WorkerProcess] = []

    def spawn(name: str = "w0", home: Path | None = None) -> WorkerProcess:
        home = home or (tmp_path / name)
        home.mkdir(parents=True, exist_ok=True)
        worker = WorkerProcess(
            env={**os.environ, "DEDLOC_HOME": str(home),
                 "DEDLOC_LOG_LEVEL": os.environ.get("DEDLOC_TEST_LOG_LEVEL", "WARNING")},
            stderr=open(home / "worker.log", "w"),  # closed at exit
        )
        worker.start()
        worker.home = home  # type: ignore[attr-defined]
        started.append(worker)
        return worker

    yield spawn
    if started:  # stop them side by side: each leaves its swarm gracefully, which takes seconds
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(lambda w: w.stop(timeout=15), started))


def start_command(server: FileServer, home: Path, *, initial_peers=None, seed=0, **exp_overrides) -> Start:
    return Start(
        experiment=tiny_experiment(**exp_overrides),
        initial_peers=initial_peers or [],
        data_base_url=server.url,
        identity_path=str(home / "identity.key"),
        seed=seed,
        progress_period=0.5,
        limits=Limits(cpu_threads=1),
    )


# Every process this session starts carries this mark in its environment (children inherit it),
# so a leftover is found even after its parent died and it was re-parented to init.
SESSION_MARK = f"{os.getpid()}-{time.time_ns()}"
os.environ["DEDLOC_TEST_SESSION"] = SESSION_MARK
# Helpers that outlive their clients by design and exit on their own once the session does.
_BENIGN = ("torch_shm_manager", "multiprocessing.resource_tracker", "multiprocessing.forkserver")
_first_seen: dict[tuple[int, float], str] = {}  # (pid, create time) -> the test after which it ran


def session_processes() -> list[psutil.Process]:
    """Processes started by this test session (other than pytest itself), alive or zombie."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get("DEDLOC_TEST_SESSION") != SESSION_MARK:
                continue
            if proc.status() == psutil.STATUS_ZOMBIE or any(b in " ".join(proc.info["cmdline"] or []) for b in _BENIGN):
                continue
        except psutil.Error:
            continue
        found.append(proc)
    return found


def _describe(proc: psutil.Process) -> str:
    try:
        started = proc.create_time()
        cmd = " ".join(proc.cmdline())[:160]
    except psutil.Error:
        return f"pid {proc.pid} (gone)"
    return f"pid {proc.pid} {cmd!r}, left by {_first_seen.get((proc.pid, started), 'the session fixtures')}"


@pytest.fixture(autouse=True)
def _note_leftovers(request):
    """After each test, remember which test the session's running processes outlived first."""
    yield
    for proc in session_processes():
        try:
            _first_seen.setdefault((proc.pid, proc.create_time()), request.node.nodeid)
        except psutil.Error:
            pass


_CREATE_TASK = asyncio.create_task


@pytest.fixture(autouse=True)
def _hivemind_ext_stays_out(request):
    """Fail the test that installs ``hivemind_ext`` in pytest's own process: it replaces
    ``asyncio.create_task`` (and much of hivemind) process-wide, for every later test. Tests run
    the extensions in probes (fresh interpreters, ``tests/probes.py``)."""
    yield
    ext = sys.modules.get("dedloc_core.engine.hivemind_ext")
    leaked = asyncio.create_task is not _CREATE_TASK or (ext is not None and ext.installed())
    assert not leaked, f"{request.node.nodeid} installed hivemind_ext in pytest's process: use a probe"


@pytest.fixture(autouse=True, scope="session")
def reap_leftovers():
    """Fail the run, naming them, if the suite leaves processes behind (p2pd, workers, Xvfb, ...);
    kill them either way."""
    yield
    deadline = time.monotonic() + 10  # what a test stopped a moment ago may still be exiting
    leftovers = session_processes()
    while leftovers and time.monotonic() < deadline:
        time.sleep(0.5)
        leftovers = session_processes()
    described = [_describe(p) for p in leftovers]
    for proc in leftovers:
        try:
            proc.kill()
        except psutil.Error:
            pass
    if described:
        pytest.fail("processes left behind by the tests:\n  " + "\n  ".join(described), pytrace=False)


def serve_signed_catalog(server: FileServer, tmp_path: Path, monkeypatch, experiments: list[dict]) -> FileServer:
    """Serve a catalog of ``experiments`` on ``server``, signed by a fresh test key that the app
    trusts through DEDLOC_TRUSTED_KEYS; DEDLOC_CATALOG_URL points at it."""
    pem, public = generate_keypair("test-pass", "test key")
    key = load_private_key(pem, "test-pass")
    keys = tmp_path / "keys"
    keys.mkdir(exist_ok=True)
    (keys / "test.pub").write_text(public_key_line(key.public_key(), "test") + "\n")
    now = datetime.now(UTC)
    catalog = msgspec.convert({
        "schema_version": 1, "catalog_id": "test-catalog", "issued_at": now,
        "expires_at": now + timedelta(days=1), "experiments": experiments}, Catalog)
    server.add("/catalog.json", sign_catalog(catalog, key))
    monkeypatch.setenv("DEDLOC_CATALOG_URL", f"{server.url}catalog.json")
    monkeypatch.setenv("DEDLOC_TRUSTED_KEYS", str(keys))
    return server


@pytest.fixture
def signed_catalog_server(tmp_path, corpus_server, monkeypatch):
    """A real HTTP server with a catalog (of the tiny test experiment) signed by a test key that the
    app trusts; shards come from the corpus server next to it."""
    experiment = tiny_experiment(target_batch_size=APP_SWARM_BATCH)
    return serve_signed_catalog(corpus_server, tmp_path, monkeypatch, [experiment])


class Organizer:
    """An organizer's key and its catalog, served at /org/catalog.json with /org/catalog.pub."""

    def __init__(self, server: FileServer, name: str = "Lab of Tests", exp_id: str = "org-exp"):
        self.server, self.name, self.exp_id = server, name, exp_id
        self.key = load_private_key(generate_keypair("pw")[0], "pw")
        self.publish(self.key)

    @property
    def key_b64(self) -> str:
        from cryptography.hazmat.primitives import serialization

        raw = self.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return base64.b64encode(raw).decode()

    @property
    def url(self) -> str:
        return f"{self.server.url}org/catalog.json"

    def publish(self, signing_key, title: str = "Organizer's experiment", **overrides) -> None:
        now = datetime.now(UTC)
        exp = tiny_experiment(id=self.exp_id, title=title, organizer=self.name, run_id=self.exp_id.replace("-", "_"),
                              **overrides)
        catalog = msgspec.convert({"schema_version": 1, "catalog_id": "org", "issued_at": now,
                                   "expires_at": now + timedelta(days=1), "experiments": [exp]}, Catalog)
        self.server.add("/org/catalog.json", sign_catalog(catalog, signing_key))
        self.server.add("/org/catalog.pub", f"ed25519 {self.key_b64} org\n".encode())


@pytest.fixture
def netlab():
    """A network lab (tests/netlab): namespaces, NAT, shaping; torn down after the test.
    Skips where it cannot run (not root, no ip/iptables/tc)."""
    from netlab import Lab, lab_unavailable_reason

    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with Lab() as lab:
        yield lab
