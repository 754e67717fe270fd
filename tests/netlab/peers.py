"""A real backbone (``dedloc backbone``) and real workers inside the lab's namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from swarmpeer import SwarmPeer, wait_until

from dedloc_core.backboneproc import BackboneProcess
from dedloc_core.catalog import generate_keypair, load_private_key, sign_catalog
from dedloc_core.protocol import Limits, Start
from dedloc_core.workerproc import SOCKET_DIR_ENV, SOCKET_DIR_PREFIX, WorkerProcess, remove_socket_dir

from .lab import Host, Lab

__all__ = ["Backbone", "Peer", "Reference", "solo_rates", "wait_until"]

BACKBONE_PORT, HTTP_PORT = 31337, 8080


def signed_catalog(experiment: dict, folder: Path) -> tuple[Path, Path]:
    """A catalog holding ``experiment``, signed by a fresh key: (catalog file, public key file)."""
    pem, public_line = generate_keypair("netlab", "netlab test key")
    now = datetime.now(UTC)
    catalog = {"schema_version": 1, "catalog_id": "netlab", "issued_at": now.isoformat(),
               "expires_at": (now + timedelta(days=1)).isoformat(), "experiments": [experiment]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "catalog.json").write_bytes(sign_catalog(json.dumps(catalog), load_private_key(pem, "netlab")))
    (folder / "netlab.pub").write_text(public_line + "\n")
    return folder / "catalog.json", folder / "netlab.pub"


class Backbone(BackboneProcess):
    """``dedloc backbone`` in ``host``'s namespace, listening on its public address; started at once,
    up after ``wait_ready()``."""

    def __init__(self, lab: Lab, host: Host, experiment: dict, folder: Path, *extra_args: str):
        catalog, key = signed_catalog(experiment, folder / "catalog")
        sockets = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)  # hivemind_ext.socket_dir
        super().__init__([
            "--experiment", experiment["id"], "--catalog", str(catalog), "--trusted-key", str(key),
            "--listen", f"/ip4/{host.ip}/tcp/{BACKBONE_PORT}", "--http-host", host.ip, "--http-port", str(HTTP_PORT),
            "--insecure-http",  # the lab's private network, no certificate
            "--poll", "2", *extra_args], folder / "backbone", folder / "backbone.log",
            env={**os.environ, "DEDLOC_HOME": str(folder / "backbone-home"), SOCKET_DIR_ENV: sockets},
            launcher=lab.launcher(host))
        self.start(timeout=None)
        host.processes.append(self.proc)  # the lab kills it at close
        lab.after_close(lambda: remove_socket_dir(sockets))  # (the lab kills it: it removes none)


class Peer(SwarmPeer):
    """A worker in ``host``'s namespace and what it has said so far."""

    def __init__(self, lab: Lab, host: Host, home: Path):
        home.mkdir(parents=True, exist_ok=True)
        self.host, self.home, self.name = host, home, host.name
        super().__init__(WorkerProcess(
            env={**os.environ, "DEDLOC_HOME": str(home),
                 "DEDLOC_LOG_LEVEL": os.environ.get("DEDLOC_TEST_LOG_LEVEL", "INFO")},
            stderr=(home / "worker.log").open("w"), launcher=lab.launcher(host)))
        lab.after_close(self.worker.kill)  # reaps it and removes its socket folder (tests stop no peer)

    def start(self, experiment: dict, ready: dict, *, seed: int = 0, **start_fields) -> Peer:
        self.worker.start(hello_timeout=60)
        self.worker.send(Start(experiment=experiment, initial_peers=ready["maddrs"], data_base_url=ready["http_url"],
                               identity_path=str(self.home / "identity.key"), seed=seed, progress_period=0.5,
                               limits=Limits(cpu_threads=1), host_maddrs=["/ip4/0.0.0.0/tcp/0"], **start_fields))
        return self

    @property
    def reachability(self) -> str | None:
        return next((s.reachability for s in reversed(self.states) if s.reachability), None)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return (self.home / "worker.log").read_text()[-n:]
        except OSError:
            return ""

    def describe(self) -> str:
        head = f"--- {self.name} steps={self.step} rounds={self.rounds} reach={self.reachability}"
        return f"{head}\n{self.log_tail(1500)}"

    def stop(self) -> None:
        self.worker.stop(timeout=15)


def start_solo(lab: Lab, host: Host, experiment: dict, seconds: float, *extra: str) -> subprocess.Popen:
    """``solo.py`` on ``experiment``'s recipe in ``host``'s namespace and CPU group, stdout piped."""
    argv = [sys.executable, str(Path(__file__).with_name("solo.py")), experiment["recipe"],
            json.dumps(experiment["recipe_params"]), str(experiment["batch_size_per_step"]), str(seconds), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return lab.popen(host, argv, stdout=subprocess.PIPE, text=True, env=env)


def solo_rates(lab: Lab, hosts: list[Host], experiment: dict, seconds: float = 8.0, *,
               together: bool = False) -> list[float]:
    """Each host's samples/s on the bare training loop of ``experiment``'s recipe (``solo.py``), in
    its namespace and CPU group: one host at a time, or all ``together`` (the same figures when the
    quotas hold)."""
    def start(host: Host) -> subprocess.Popen:
        return start_solo(lab, host, experiment, seconds)

    def rate(proc: subprocess.Popen) -> float:
        out, _ = proc.communicate(timeout=seconds + 120)
        if proc.returncode != 0:
            raise RuntimeError(f"the solo probe failed (exit {proc.returncode}): {out[-500:]}")
        return float(out.split()[-1])

    if together:
        return [rate(p) for p in [start(h) for h in hosts]]
    return [rate(start(h)) for h in hosts]


class Reference:
    """The bare training loop (``solo.py``) running beside a swarm in its own node and CPU group, so
    a solo rate is measured at the same time as the swarm's (this VM's speed drifts by a tenth
    within minutes). ``mark()`` is (monotonic time, samples so far) after its latest micro-batch.
    ``netlab.solo_rates`` reads a rate from the same loop's output alone."""

    def __init__(self, lab: Lab, host: Host, experiment: dict, seconds: float = 3600.0):
        self.proc = start_solo(lab, host, experiment, seconds, "stream")
        self._latest: tuple[float, int] | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = line.split()
            if len(parts) == 2:
                self._latest = (float(parts[0]), int(parts[1]))

    def mark(self, timeout: float = 60.0) -> tuple[float, int]:
        deadline = time.monotonic() + timeout
        while self._latest is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the reference loop did not start")
            time.sleep(0.1)
        return self._latest

    def cpu_seconds(self) -> float:
        """CPU time the loop has used so far: under contention it gets less than its quota, and a rate
        read then says less about the machine's speed than samples per CPU second do."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
