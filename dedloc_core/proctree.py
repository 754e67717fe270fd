"""Stopping a process and everything it started (hivemind's helper processes, p2pd): the one place
that signals, waits and kills. No torch, no hivemind: the app imports it.

Every long-lived child of ours (a worker, a backbone) starts in a session of its own
(``start_new_session=True``), so its process group holds its whole tree, and the group outlives its
leader: ``kill_group`` finds p2pd after the worker that started it crashed. ``stop_process``
escalates SIGTERM -> SIGKILL of the group; ``stop_children`` is a process tidying up after itself.
"""

from __future__ import annotations

import enum
import os
import signal
import subprocess
from collections.abc import Callable, Iterable

import psutil


class StopResult(enum.Enum):
    OK = "stopped"
    KILLED = "killed"
    NOT_RUNNING = "not running"


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to every process of group ``pgid``; False if there is no such group (or it is not ours)."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_members(pgid: int) -> list[psutil.Process]:
    """The processes of group ``pgid``, this one excepted."""
    me, members = os.getpid(), []
    for proc in psutil.process_iter():
        try:
            if proc.pid != me and os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def kill_group(pgid: int, timeout: float = 3.0) -> None:
    """SIGKILL whatever is left of group ``pgid`` (e.g. p2pd after its worker crashed) and wait up to
    ``timeout`` seconds for it to go."""
    members = group_members(pgid)
    _kill(members)
    psutil.wait_procs(members, timeout=timeout)


def terminate_then_kill(procs: Iterable[psutil.Process], timeout: float = 3.0) -> list[psutil.Process]:
    """SIGTERM each of ``procs``, wait up to ``timeout`` seconds, SIGKILL the rest; returns those killed."""
    procs = list(procs)
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    _kill(alive)
    return alive


def stop_children(timeout: float = 3.0, spare: Callable[[psutil.Process], bool] | None = None) -> None:
    """Terminate, then kill, every process this one started, but those ``spare`` says to leave."""
    children = psutil.Process().children(recursive=True)
    terminate_then_kill([c for c in children if spare is None or not spare(c)], timeout)


def stop_process(proc: subprocess.Popen, timeout: float = 30.0, kill_timeout: float = 10.0) -> StopResult:
    """SIGTERM ``proc``; if it has not exited within ``timeout`` seconds, SIGKILL it with its group.
    Then kill what is left of its group (when it leads one: ``start_new_session``)."""
    if proc.poll() is not None:
        kill_group(proc.pid)
        return StopResult.NOT_RUNNING
    proc.terminate()
    try:
        proc.wait(timeout)
        result = StopResult.OK
    except subprocess.TimeoutExpired:
        if not signal_group(proc.pid, signal.SIGKILL):
            proc.kill()
        result = StopResult.KILLED
        try:
            proc.wait(kill_timeout)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc.pid)
    return result


def _kill(procs: Iterable[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
