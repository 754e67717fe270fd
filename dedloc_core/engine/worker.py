"""The worker process: trains one experiment with hivemind, driven by the JSON-lines protocol.

Run as ``dedloc worker`` or ``python -m dedloc_core.engine.worker``. Commands arrive on stdin; events go
to the event channel, which is the original stdout (or ``--event-fd N``). Right at start the
worker points fd 1 at stderr, so a stray ``print`` of a library (or of p2pd) cannot corrupt the
protocol. EOF on stdin means the app is gone: the worker stops as if told to.

Exit codes (``errors.EXIT_*``): 0 stopped cleanly, 1 crashed (a bug), 3 a fatal, explained error (bad
data, bad experiment, a full disk).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading

import msgspec

from dedloc_core import __version__, environ, gpu_runtime, paths
from dedloc_core.errors import EXIT_EXPLAINED, EXIT_UNEXPECTED, DedlocError, WorkerError, user_message
from dedloc_core.protocol import Error, Hello, Start, State, Stop
from dedloc_core.workerproc import SOCKET_DIR_PREFIX

from . import invited, priority
from .channel import Control, EventChannel, EventLogHandler, read_commands
from .shard_cache import fetch_in_background

logger = logging.getLogger("dedloc_core.engine.worker")  # not "__main__" when run with -m


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dedloc worker", description=__doc__.splitlines()[0])
    parser.add_argument("--event-fd", type=int, default=None, help="write events to this fd (default stdout)")
    parser.add_argument("--log-level", default=environ.LOG_LEVEL.text())
    args = parser.parse_args(argv)
    priority.lower_priority()  # before torch's import: seconds of a core

    event_fd = args.event_fd if args.event_fd is not None else os.dup(1)
    command_fd = os.dup(0)
    os.dup2(2, 1)  # stray prints (ours, libraries', children's) go to stderr
    sys.stdout = sys.stderr
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # children inherit no command pipe
    os.set_inheritable(event_fd, False)
    channel = EventChannel(event_fd)
    _setup_logging(args.log_level, channel)

    own_sockets = _socket_dir()
    control = Control()
    channel.send(Hello(version=__version__, pid=os.getpid(), host=socket.gethostname()))
    channel.send(State(state="idle", reason="Waiting for an experiment"))
    reader = threading.Thread(target=read_commands, args=(command_fd, control, channel), daemon=True)
    reader.start()
    try:
        return run(control, channel)
    finally:
        if own_sockets:
            shutil.rmtree(own_sockets, ignore_errors=True)


def _socket_dir() -> str | None:
    """The folder for hivemind's unix sockets: the supervisor's (``DEDLOC_SOCKET_DIR``), or, for a
    worker started across a boundary, one of its own, removed at exit (returned)."""
    if environ.SOCKET_DIR.optional():
        return None
    folder = os.environ[environ.SOCKET_DIR.name] = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)
    return folder


def run(control: Control, channel: EventChannel) -> int:
    """Wait for ``start``, train until ``stop``; return the exit code."""
    while True:
        command = control.commands.get()
        if isinstance(command, Stop):
            channel.send(State(state="stopped", reason="Stopped"))
            return 0
        if isinstance(command, Start):
            break
    try:
        experiment = check_experiment(command.experiment)  # fail fast, before loading torch and hivemind
        channel.send(State(state="preparing", reason=f"Fetching data for {experiment.title}"))
        # an invite-only experiment's data needs the token: the fetch thread obtains it first. It may
        # write a new identity; hivemind must still treat it as new (no check that it is free)
        identity = command.identity_path or str(paths.data_dir() / "identity.key")  # as Session's
        new_identity = not os.path.isfile(identity)
        shards = fetch_in_background(experiment.data.files(), command.data_base_url or experiment.data.base_url,
                                     invited.data_token(experiment, identity, command.invite_code))
        runtime = gpu_runtime.activate()  # an installed CUDA build of torch comes before the bundled one
        from .training import Session  # imports torch and hivemind (seconds) while the data comes

        if runtime is not None:
            import torch

            logger.info("GPU runtime %s: torch %s from %s", runtime.name, torch.__version__,
                        os.path.dirname(torch.__file__))

        carried = None
        while True:
            with Session(command, control, channel, carried, shards=shards, new_identity=new_identity) as session:
                session.train()
            if not session.rejoin or control.stop.is_set():
                break
            carried = session.totals()  # a fresh session: a new p2pd, the swarm's current state
            shards = None
            new_identity = False
            command = msgspec.structs.replace(command, start_paused=False)
        channel.send(State(state="stopped", reason="Stopped"))
        return 0
    except DedlocError as exc:
        return _fatal(channel, exc, EXIT_EXPLAINED)
    except OSError as exc:  # a full disk, a missing permission: say which, not "crashed"
        logger.exception("Worker stopped")
        return _fatal(channel, exc, EXIT_EXPLAINED)
    except BaseException as exc:  # a crash must end with an error event
        logger.exception("Worker crashed")
        return _fatal(channel, WorkerError(f"{type(exc).__name__}: {exc}", code="crash"), EXIT_UNEXPECTED)


def _fatal(channel: EventChannel, exc: BaseException, exit_code: int) -> int:
    msg = user_message(exc)
    logger.error("%s", msg.line())
    channel.send(Error(code=msg.code, title=msg.title, message=msg.message, hint=msg.hint, fatal=True))
    return exit_code


def check_experiment(experiment: dict):
    """The ``Experiment``; raise ``WorkerError(code="bad_experiment")`` unless it is a valid catalog entry.

    The Session checks it again; this check only spares a bad experiment the seconds (and hundreds
    of MB) of importing torch and hivemind before it is reported."""
    from dedloc_core.catalog.model import experiment_from

    try:
        return experiment_from(experiment)
    except ValueError as exc:
        raise WorkerError(f"The experiment description is invalid: {exc}", code="bad_experiment") from exc


def _setup_logging(level: str, channel: EventChannel) -> None:
    root = logging.getLogger()
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(getattr(logging, level.upper(), logging.INFO))
    root.setLevel(min(logging.INFO, stderr.level))  # DEDLOC_LOG_LEVEL=DEBUG shows hivemind's debug lines too
    stderr.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [worker %(process)d] %(name)s: %(message)s"))
    root.addHandler(stderr)
    root.addHandler(EventLogHandler(channel))


__all__ = ["check_experiment", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
