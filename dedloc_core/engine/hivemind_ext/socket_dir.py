"""Sockets in the supervisor's folder.

Upstream: ``hivemind/p2p/p2p_daemon.py``, ``P2P._UNIX_SOCKET_PREFIX`` (set), read by
``P2P.create`` and ``P2P.replicate`` to name p2pd's control socket and each client's.

Without it: hivemind names its unix sockets at random in /tmp. A worker killed (a stop past its
grace, a crash, a lab node stopped) removes none, and its supervisor cannot tell them from
another worker's: thousands on a machine after a day of tests and benchmarks.

Fix: with ``DEDLOC_SOCKET_DIR`` set (``WorkerProcess`` makes a folder per worker) they go in that
folder, which the supervisor removes once the worker's process group is gone.

Kind: our policy

Shown: ``tests/test_hivemind_ext_guard.py`` (a DHT's sockets in the folder; without this, none there)
and ``tests/test_workerproc.py`` (a killed worker's folder goes with its sockets).
"""

from __future__ import annotations

import os

REPLACES = ["hivemind.p2p.p2p_daemon.P2P.create", "hivemind.p2p.p2p_daemon.P2P.replicate"]


def install() -> None:
    from hivemind.p2p.p2p_daemon import P2P

    from dedloc_core import environ

    folder = environ.SOCKET_DIR.optional()
    # (a unix socket's path holds at most 107 bytes; hivemind's names take 40)
    if folder and os.path.isdir(folder) and len(os.path.abspath(folder)) <= 60:
        P2P._UNIX_SOCKET_PREFIX = f"/unix{os.path.abspath(folder)}/hivemind-"
