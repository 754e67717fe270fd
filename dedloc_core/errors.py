"""The exception tree, and the one place that turns any error into what a person reads.

Each ``DedlocError`` has a short ``title``, a ``message`` a person can act on, a ``code`` for
programs, and a ``hint`` (what to do). The classes, with the module that defines those outside this
one::

    DedlocError
     ├── CatalogError       a catalog that is unsigned, tampered, expired, malformed, ...
     ├── ShardError         a data shard that cannot be fetched or verified
     ├── ProtocolError      a malformed message between app and worker
     ├── RecipeError        unknown recipe or bad recipe parameters
     ├── WorkerError        the worker failed (training, swarm, resources)
     ├── SecretError        the OS keyring is missing or refused (``secrets``)
     ├── AutostartError     the start-at-login entry cannot be written (``autostart``)
     ├── StatsError         the statistics file cannot be opened or read (``stats.db``)
     ├── SwarmUnavailable   the backbone's swarm summary cannot be fetched (``stats.swarmview``)
     └── SelfTestFailed     a step of ``dedloc --self-test`` failed (``engine.selftest``)

``user_message(error)`` is the one translation: a ``DedlocError``, a worker's ``Error`` event, an
``OSError`` (a full disk, a missing permission) or anything else becomes a ``UserMessage`` (title,
message, what to do, code, exit status). The app shows it; every command line prints it with
``report``, in one format::

    <title>: <message> [<code>]
      What to do: <hint>

Exit status of every ``dedloc`` command (``EXIT_*``): 0 done; 1 unexpected failure (a bug: the
traceback is in the log); 2 wrong usage (argparse); 3 an explained failure (the message says why);
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import errno
import sys
from dataclasses import dataclass
from typing import TextIO

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_USAGE = 2
EXIT_EXPLAINED = 3
EXIT_INTERRUPTED = 130


class DedlocError(Exception):
    title = "Error"
    hint = ""

    def __init__(self, message: str, *, title: str | None = None, code: str | None = None,
                 hint: str | None = None):
        super().__init__(message)
        self.message = message
        if title is not None:
            self.title = title
        if hint is not None:
            self.hint = hint
        self.code = code or type(self).__name__

    def __str__(self) -> str:
        return self.message


class CatalogError(DedlocError):
    title = "Catalog rejected"
    hint = "The app keeps the last good catalog. If this lasts, tell the experiment's organizer."


class ShardError(DedlocError):
    title = "Training data unavailable"
    hint = "Check the internet connection; the download resumes by itself once the server answers."


class ProtocolError(DedlocError):
    title = "Protocol error"
    hint = "The app and its worker disagree: reinstall the app so both are the same version."


class RecipeError(DedlocError):
    title = "Unknown or invalid recipe"
    hint = "The experiment needs a newer app: update DeDLOC Volunteer."


class WorkerError(DedlocError):
    title = "Training stopped"
    hint = "The app restarts the worker by itself; the event log has the details."


@dataclass(frozen=True)
class UserMessage:
    """What a person reads about an error: a title, a message, what to do."""

    title: str
    message: str
    hint: str = ""
    code: str = "error"
    exit_code: int = EXIT_EXPLAINED

    def line(self) -> str:
        """One line, for a log entry or a status text: ``title: message``."""
        return f"{self.title}: {self.message}"

    def text(self) -> str:
        """The command lines' format (see the module docstring)."""
        out = f"{self.title}: {self.message} [{self.code}]"
        return out + (f"\n  What to do: {self.hint}" if self.hint else "")


_OS_ERRORS = {
    errno.ENOSPC: ("Disk full", "Free some disk space; nothing was lost, and the app goes on once there is room."),
    errno.EDQUOT: ("Disk quota exceeded", "Free some space in your quota; nothing was lost."),
    errno.EACCES: ("Permission denied", "Check that the file or folder belongs to you and can be written."),
    errno.EPERM: ("Permission denied", "Check that the file or folder belongs to you and can be written."),
    errno.ENOENT: ("File not found", "Check the path."),
    errno.EROFS: ("Read-only file system", "Choose a folder on a disk that can be written."),
}


def user_message(error: object) -> UserMessage:
    """The one translation of an error (an exception, or a worker's ``Error`` event) for a person."""
    if isinstance(error, DedlocError):
        return UserMessage(error.title, error.message, error.hint, error.code, EXIT_EXPLAINED)
    if isinstance(error, KeyboardInterrupt):
        return UserMessage("Interrupted", "Stopped at your request.", "", "interrupted", EXIT_INTERRUPTED)
    if isinstance(error, OSError):
        title, hint = _OS_ERRORS.get(error.errno, ("System error", ""))
        where = f" ({error.filename})" if error.filename else ""
        code = "os." + errno.errorcode.get(error.errno or 0, "error")
        return UserMessage(title, f"{error.strerror or error}{where}.", hint, code, EXIT_EXPLAINED)
    if isinstance(error, BaseException):
        return UserMessage("Unexpected error", f"{type(error).__name__}: {error}",
                           "This is a bug in DeDLOC Volunteer; please report it with the log.", "unexpected",
                           EXIT_UNEXPECTED)
    # a worker's Error event (dedloc_core.protocol.Error): the worker translated it already
    title, message = getattr(error, "title", "Error"), getattr(error, "message", str(error))
    return UserMessage(title, message, getattr(error, "hint", "") or "", getattr(error, "code", "error"),
                       EXIT_EXPLAINED)


def report(error: object, stream: TextIO | None = None) -> int:
    """Print ``error`` in the command lines' format to ``stream`` (stderr); return the exit status."""
    msg = user_message(error)
    print(msg.text(), file=stream or sys.stderr, flush=True)
    return msg.exit_code
