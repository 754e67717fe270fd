"""Starting, waiting for and stopping a backbone node (``dedloc backbone``) as a child process: the
demo, the tests and the benchmarks use this class, as they use ``WorkerProcess`` for a worker.

The backbone runs in a session (process group) of its own and says it is up by writing its ready
file (``ready.json`` in its run directory: peer id, multiaddrs, HTTP root). ``stop()`` sends SIGTERM
(it saves a checkpoint and leaves the swarm), then kills what is left of its group (``proctree``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from . import proctree
from .errors import DedlocError
from .proctree import StopResult
from .workerproc import dedloc_command


class BackboneProcess:
    """``dedloc backbone ARGS --run-dir RUN_DIR --ready-file RUN_DIR/ready.json``, its output in ``log``.
    ``env``: its environment (default: ours); ``launcher``: a command prefix that must exec it (e.g.
    ``ip netns exec NS``)."""

    def __init__(self, args: Sequence[str], run_dir: Path, log: Path, *, env: dict[str, str] | None = None,
                 launcher: Sequence[str] = ()):
        self.args, self.run_dir, self.log = list(args), Path(run_dir), Path(log)
        self.ready_file = self.run_dir / "ready.json"
        self.env, self.launcher = env, list(launcher)
        self.proc: subprocess.Popen | None = None
        self.ready: dict = {}

    def start(self, timeout: float | None = 120.0) -> dict:
        """Start the backbone and, unless ``timeout`` is None, wait for it (``wait_ready``)."""
        self.ready_file.unlink(missing_ok=True)  # an earlier run's file must not pass for this one's
        with open(self.log, "w") as log:  # the child holds its own copy
            self.proc = subprocess.Popen(
                self.launcher + dedloc_command("backbone", *self.args, "--run-dir", str(self.run_dir),
                                               "--ready-file", str(self.ready_file)),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ if self.env is None else self.env), start_new_session=True)
        return self.ready if timeout is None else self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 120.0) -> dict:
        """The backbone's ready record, once written; a ``DedlocError`` with the end of its log if it
        exits first or is not up within ``timeout`` seconds."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise self._failed(f"The backbone exited (code {self.proc.returncode}) before it was up.")
            if time.monotonic() >= deadline:
                raise self._failed(f"The backbone was not up within {timeout:.0f} s.")
            time.sleep(0.2)
        self.ready = json.loads(self.ready_file.read_text())
        return self.ready

    def _failed(self, what: str) -> DedlocError:
        return DedlocError(f"{what} The end of its log ({self.log}):\n{self.log_tail()}",
                           title="Backbone did not start", code="backbone_not_ready")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def maddrs(self) -> list[str]:
        return self.ready.get("maddrs", [])

    @property
    def http_url(self) -> str | None:
        return self.ready.get("http_url")

    @property
    def peer_id(self) -> str | None:
        return self.ready.get("peer_id")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> StopResult:
        """SIGTERM (it saves a checkpoint and shuts hivemind down); after ``timeout`` seconds SIGKILL
        of its group; then whatever is left of the group."""
        if self.proc is None:
            return StopResult.NOT_RUNNING
        return proctree.stop_process(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL the backbone and its group at once (a crash, as the swarm sees it)."""
        if self.proc is None:
            return
        proctree.signal_group(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
