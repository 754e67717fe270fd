"""Children die with us: every process hivemind starts is killed when its parent dies.

Upstream: ``hivemind/p2p/p2p_daemon.py``, ``P2P.create`` (starts ``p2pd`` with
``asyncio.subprocess.create_subprocess_exec``), and the forks of ``DHT`` and
``DecentralizedAverager`` (``multiprocessing.Process.start``).

Without it: hivemind ties no child's lifetime to its parent's. After a SIGKILL of the worker its
forked DHT and averager processes and its ``p2pd`` linger for ever, holding ports, memory and
socket files.

Fix: ``PR_SET_PDEATHSIG`` = SIGKILL in every forked child (``os.register_at_fork``) and in
``p2pd`` (a ``preexec_fn`` given to ``create_subprocess_exec`` inside ``p2p_daemon`` only), so a
killed worker takes its whole tree with it.

Kind: bug fix (belongs upstream; docs/hivemind/child_lifetime.patch)

Shown: ``tests/test_hivemind_ext_guard.py`` (a SIGKILLed peer's DHT process and ``p2pd`` die with it;
without this they linger).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

REPLACES = ["hivemind.p2p.p2p_daemon.P2P.create"]

_PR_SET_PDEATHSIG = 1


def set_pdeathsig() -> None:
    """Ask the kernel to SIGKILL the calling process when its parent dies (Linux; no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass


def install() -> None:
    from hivemind.p2p import p2p_daemon

    os.register_at_fork(after_in_child=set_pdeathsig)
    real_asyncio = p2p_daemon.asyncio

    class _Subprocess:
        """Stands in for ``asyncio.subprocess`` inside p2p_daemon only."""

        PIPE = real_asyncio.subprocess.PIPE
        STDOUT = real_asyncio.subprocess.STDOUT

        @staticmethod
        async def create_subprocess_exec(*args, **kwargs):
            kwargs.setdefault("preexec_fn", set_pdeathsig)
            return await real_asyncio.subprocess.create_subprocess_exec(*args, **kwargs)

    class _AsyncioProxy:
        subprocess = _Subprocess

        def __getattr__(self, name: str) -> Any:
            return getattr(real_asyncio, name)

    p2p_daemon.asyncio = _AsyncioProxy()  # type: ignore[assignment]
