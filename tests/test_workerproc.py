"""No unbounded buffer between a worker and its owner: with a callback, the event queue is never
filled; without one, it keeps at most ``EVENT_BACKLOG`` events, the newest. A real worker, with
progress events sped up to one per micro-batch. And a killed worker, or one that never started,
leaves no socket file or folder."""

from __future__ import annotations

import glob
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import start_command
from msgspec.structs import replace

from dedloc_core.protocol import Stats
from dedloc_core.workerproc import EVENT_BACKLOG, SOCKET_DIR_ENV, SOCKET_DIR_PREFIX, WorkerProcess

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

BATCH = 8  # the tiny experiment's batch_size_per_step


def fast_start(server, home):
    return replace(start_command(server, home, target_batch_size=100_000), progress_period=0.001)


def worker_env(home):
    return {**os.environ, "DEDLOC_HOME": str(home), "DEDLOC_LOG_LEVEL": "WARNING"}


def test_with_a_callback_nothing_is_queued(corpus_server, tmp_path):
    seen: list[object] = []
    enough = threading.Event()

    def on_event(event):
        seen.append(event)
        if isinstance(event, Stats) and event.samples >= 2 * EVENT_BACKLOG * BATCH:
            enough.set()

    worker = WorkerProcess(env=worker_env(tmp_path), on_event=on_event)
    worker.start()
    try:
        worker.send(fast_start(corpus_server, tmp_path))
        assert enough.wait(180), f"too few events: {len(seen)}"
        assert worker.events.qsize() == 0 and len(seen) > 2 * EVENT_BACKLOG
    finally:
        worker.stop()


def test_without_a_callback_the_queue_keeps_the_newest_and_no_more(corpus_server, tmp_path):
    worker = WorkerProcess(env=worker_env(tmp_path))
    worker.start()
    try:
        worker.send(fast_start(corpus_server, tmp_path))
        assert worker.wait_for(lambda e: isinstance(e, Stats), 180), "no stats"
        newest, pause, overflowed = 0, 3.0, False
        while not overflowed and pause < 100:
            time.sleep(pause)  # nobody reads meanwhile: the worker sends two events a micro-batch
            events = []
            while not worker.events.empty():
                events.append(worker.events.get_nowait())
            stats = [e.samples for e in events if isinstance(e, Stats)]
            assert stats, "no events kept"
            sent = 2 * (max(stats) - newest) // BATCH  # events sent since the last look
            overflowed = sent > EVENT_BACKLOG
            assert len(events) <= EVENT_BACKLOG, f"{len(events)} events kept"
            newest, pause = max(stats), pause * 2
        assert overflowed, "the worker sent too few events to fill the queue"
    finally:
        worker.stop()


def test_a_killed_worker_leaves_no_socket_file(corpus_server, tmp_path):
    """hivemind's unix sockets (p2pd's, each P2P client's) go in the worker's own folder
    (hivemind_ext.socket_dir), not /tmp, and the folder goes when the worker is killed: a SIGKILL
    removes none of them (2,217 in /tmp on the dev VM after a day of tests)."""
    before = set(glob.glob("/tmp/hivemind-*.sock"))
    worker = WorkerProcess(env=worker_env(tmp_path))
    worker.start()
    try:
        worker.send(fast_start(corpus_server, tmp_path))
        assert worker.wait_for(lambda e: isinstance(e, Stats), 180), "no stats"
        folder = Path(worker.socket_dir)
        names = sorted(p.name for p in folder.iterdir())
        assert any(n.startswith("hivemind-p2pd-") for n in names), names  # the DHT's daemon
        assert any(n.startswith("hivemind-p2pclient-") for n in names), names
        assert set(glob.glob("/tmp/hivemind-*.sock")) <= before  # none in /tmp
    finally:
        worker.kill()  # SIGKILL, the whole group: nothing of it removes its sockets
    assert not folder.exists()


def test_a_worker_that_cannot_start_leaves_no_socket_folder(tmp_path, monkeypatch):
    """The folder is made before the process; when there is no process (a launcher that is not
    there), nothing else would ever remove it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    worker = WorkerProcess(env={k: v for k, v in os.environ.items() if k != SOCKET_DIR_ENV},
                           launcher=[str(tmp_path / "no-such-launcher")])
    with pytest.raises(FileNotFoundError):
        worker.start()
    assert not list(tmp_path.glob(f"{SOCKET_DIR_PREFIX}*"))
    assert worker.socket_dir is None
