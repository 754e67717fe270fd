"""A worker in a test swarm and what it has said so far, and ``wait_until`` over several of them.

Used by the loopback swarm tests, the DiLoCo tests and the network lab (tests/netlab/peers.py)."""

from __future__ import annotations

import os
import queue
import time
from pathlib import Path

import psutil

from dedloc_core.backboneproc import BackboneProcess
from dedloc_core.protocol import Error, Progress, State, Stats


class SwarmPeer:
    """Drains a ``WorkerProcess``'s events into lists; subclasses see the rest in ``on_event``."""

    name = "peer"

    def __init__(self, worker):
        self.worker = worker
        self.progress: list[Progress] = []
        self.states: list[State] = []
        self.errors: list[Error] = []
        self.stats: Stats | None = None  # the last
        self.all_stats: list[Stats] = []

    def drain(self) -> None:
        while True:
            try:
                event = self.worker.events.get_nowait()
            except queue.Empty:
                return
            if event is None:  # the worker is gone: leave the marker for the next reader
                self.worker.events.put(None)
                return
            if isinstance(event, Progress):
                self.progress.append(event)
            elif isinstance(event, State):
                self.states.append(event)
            elif isinstance(event, Error):
                self.errors.append(event)
            elif isinstance(event, Stats):
                self.stats = event
                self.all_stats.append(event)
            else:
                self.on_event(event)

    def on_event(self, event) -> None:
        """Events other than Progress, State, Error and Stats."""

    @property
    def maddrs(self) -> list[str]:
        return next(s.maddrs for s in reversed(self.states) if s.maddrs)

    @property
    def step(self) -> int:
        """The local epoch (the outer round in DiLoCo mode) last reported."""
        return self.progress[-1].local_epoch if self.progress else 0

    @property
    def rounds(self) -> int:
        """Averaging rounds joined, from the last Stats."""
        return self.stats.rounds if self.stats else 0

    def digests(self) -> dict[int, list[float]]:
        """Parameter digest at each local epoch this peer reported."""
        return {p.local_epoch: p.param_digest for p in self.progress if p.param_digest}

    def describe(self) -> str:
        """A line or more for failure messages."""
        return f"{self.name}: step {self.step}, rounds {self.rounds}"


def wait_until(peers: list[SwarmPeer], condition, timeout: float, message: str) -> None:
    """Drain every peer until ``condition()`` holds; fail on a fatal worker error or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for peer in peers:
            peer.drain()
            fatal = [e for e in peer.errors if e.fatal]
            if fatal:
                raise AssertionError(f"{fatal[0].title}: {fatal[0].message}\n{peer.describe()}")
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(message + "\n" + "\n".join(p.describe() for p in peers))


def start_backbone(experiment: dict, folder: Path, *, http: bool = False, poll: str = "1",
                   extra: tuple = ()) -> tuple[BackboneProcess, dict, str]:
    """``dedloc backbone`` on loopback for ``experiment`` (its catalog signed by a fresh key), up:
    (the process, its ready.json, the key's base64). With ``http`` it serves HTTP on a free port."""
    from netlab.peers import signed_catalog

    catalog, key = signed_catalog(experiment, folder / "catalog")
    backbone = BackboneProcess([
        "--experiment", experiment["id"], "--catalog", str(catalog), "--trusted-key", str(key),
        "--listen", "/ip4/127.0.0.1/tcp/0", "--http-port", "0" if http else "-1", "--poll", poll, *extra],
        folder / "backbone", folder / "backbone.log", env={**os.environ, "DEDLOC_HOME": str(folder / "backbone-home")})
    ready = backbone.start(timeout=120)
    return backbone, ready, key.read_text().split()[1]


def scheduling_classes(pid: int) -> tuple[int | None, list[int]]:
    """A worker's main thread's scheduling class (its training loop's) and its helper processes'
    (hivemind's DHT and averagers, p2pd); a helper that ended meanwhile is left out."""
    def policy(p):
        try:
            return os.sched_getscheduler(p)
        except ProcessLookupError:
            return None
    helpers = [policy(h.pid) for h in psutil.Process(pid).children(recursive=True)]
    return policy(pid), [c for c in helpers if c is not None]
