"""A headless volunteer for ``bench/chaos.py``: the app's supervising side without Qt.

Wired as ``app/main.py`` and ``app/supervisor.py`` wire it: the ``Start`` of ``joining.start_command``,
a ``WorkerProcess`` whose reader thread feeds a ``StatsRecorder(StatsStore(default_path(),
threadsafe=True)).start()`` (the real SQLite file in ``$DEDLOC_HOME/data``), ``on_event(None)`` when
the worker exits, a restart with back-off. After the recorder has taken an event, one JSON line on
stdout tells the chaos bench what was reported (``hello``, ``stats``, ``progress``, ``error``, ``exit``).
SIGTERM stops the worker and closes the recorder (a user's quit); SIGKILL is the crash under test.

Usage: python bench/chaos_volunteer.py EXPERIMENT_JSON READY_JSON NAME
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dedloc_core.catalog import Experiment  # noqa: E402
from dedloc_core.errors import DedlocError, user_message  # noqa: E402
from dedloc_core.joining import start_command  # noqa: E402
from dedloc_core.prefs import Preferences  # noqa: E402
from dedloc_core.protocol import Error, Hello, Limits, Progress, Stats  # noqa: E402
from dedloc_core.stats.db import StatsStore, default_path  # noqa: E402
from dedloc_core.stats.recorder import StatsRecorder  # noqa: E402
from dedloc_core.workerproc import WorkerProcess  # noqa: E402

BACKOFF = (2.0, 5.0, 15.0)
_out = threading.Lock()


def say(kind: str, **fields) -> None:
    with _out:
        print(json.dumps({"kind": kind, "t": time.time(), **fields}), flush=True)


def main(argv: list[str]) -> int:
    exp_file, ready_file, name = argv
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [volunteer] %(name)s: %(message)s")
    exp = msgspec.json.decode(Path(exp_file).read_bytes(), type=Experiment)
    ready = json.loads(Path(ready_file).read_text())
    os.environ["DEDLOC_INITIAL_PEERS"] = " ".join(ready["maddrs"])
    start = start_command(exp, Preferences(display_name=name), limits=Limits(cpu_threads=1),
                          data_url=ready["http_url"])
    try:
        recorder = StatsRecorder(StatsStore(default_path(), threadsafe=True)).start()
    except DedlocError as exc:  # as the app: statistics are off, contributing goes on
        say("stats_off", message=user_message(exc).line())
        recorder = None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    failures = 0
    while not stop.is_set():
        if recorder is not None:
            recorder.begin(exp.id)
        worker = WorkerProcess(on_event=lambda e, r=recorder: _on_event(r, e),
                               stderr=open(Path(os.environ["DEDLOC_HOME"]) / "worker.log", "a"))
        try:
            worker.start(hello_timeout=120)
        except DedlocError as exc:
            say("error", message=user_message(exc).line(), fatal=True)
        else:
            worker.send(start)
            while worker.running() and not stop.wait(0.2):
                pass
            if stop.is_set():
                worker.stop(timeout=20)
                break
            if recorder is not None:
                recorder.on_event(None)  # as the supervisor's watch thread
            say("exit", code=worker.proc.returncode if worker.proc else None)
        delay = BACKOFF[min(failures, len(BACKOFF) - 1)]
        failures += 1
        stop.wait(delay)
    if recorder is not None:
        recorder.on_event(None)
        recorder.close()
    say("closed")
    return 0


def _on_event(recorder: StatsRecorder | None, event: object) -> None:
    """The supervisor's ``_from_worker``: record first, then tell the bench."""
    if recorder is not None:
        recorder.on_event(event)
    if isinstance(event, Stats):
        say("stats", samples=event.samples, cpu=event.compute_seconds, rounds=event.rounds)
    elif isinstance(event, Progress):
        say("progress", step=event.global_step, local=event.local_epoch, peers=event.num_peers)
    elif isinstance(event, Hello):
        say("hello", pid=event.pid)
    elif isinstance(event, Error):
        say("error", message=f"{event.title}: {event.message}", fatal=event.fatal)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
