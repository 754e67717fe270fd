"""The worker's CPU and I/O priority: the lowest there is, from its first line on.

Without torch, so that ``dedloc worker`` lowers itself before it imports torch and hivemind:
those imports take a core for seconds right after the user clicks Join, and at normal priority
they compete with what the user is doing."""

from __future__ import annotations

import logging
import sys

import psutil

from dedloc_core import environ

logger = logging.getLogger(__name__)

NICE = int(environ.WORKER_NICE.default)  # the worker's nice value: the lowest priority there is


def worker_nice() -> int:
    """The worker's nice value: 19, or ``DEDLOC_WORKER_NICE`` (tests on a shared machine)."""
    return environ.WORKER_NICE.integer()


def lower_priority() -> None:
    """Lowest CPU priority (``worker_nice`` / IDLE_PRIORITY_CLASS) and idle I/O priority for this
    process and everything it starts later (threads, hivemind's forks, p2pd)."""
    nice = worker_nice()
    proc = psutil.Process()
    try:
        if sys.platform.startswith("win"):
            proc.nice(psutil.IDLE_PRIORITY_CLASS)
        elif nice > proc.nice():
            proc.nice(nice)
        if sys.platform.startswith("linux"):
            proc.ionice(psutil.IOPRIO_CLASS_IDLE)
    except (psutil.Error, OSError) as exc:
        logger.warning("Could not lower the worker's priority: %s", exc)
