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
     ├── InviteError        an invite code or token refused: invite_unknown, invite_expired, ... (``invites``)
     ├── AutostartError     the start-at-login entry cannot be written (``autostart``)
     ├── StatsError         the statistics file cannot be opened or read (``stats.db``)
     ├── SwarmUnavailable   the backbone's swarm summary cannot be fetched (``stats.swarmview``)
     ├── HivemindVersionError  not the hivemind our extensions are written for (``engine.hivemind_ext``)
     ├── GpuRuntimeError    the GPU runtime cannot be listed, fetched or checked (``gpu_runtime``)
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
    """The one translation of an error (an exception, or a worker's ``Error`` event) for a person.
    Never raises, whatever ``error`` is (an exception whose ``str`` fails, an odd ``errno``, ...)."""
    try:
        return _user_message(error)
    except Exception:  # a hostile object (a property that raises, ...): say what we can
        return UserMessage("Unexpected error", type(error).__name__,
                           "This is a bug in DeDLOC Volunteer; please report it with the log.", "unexpected",
                           EXIT_UNEXPECTED if isinstance(error, BaseException) else EXIT_EXPLAINED)


def _text(value: object) -> str:
    """``str(value)``, or its type's name when that fails (a ``__str__`` that raises, a self-nested list)."""
    try:
        return value if isinstance(value, str) else str(value)
    except Exception:
        return f"<{type(value).__name__}>"


def _user_message(error: object) -> UserMessage:
    if isinstance(error, DedlocError):
        return UserMessage(_text(error.title), _text(error.message), _text(error.hint), _text(error.code),
                           EXIT_EXPLAINED)
    if isinstance(error, KeyboardInterrupt):
        return UserMessage("Interrupted", "Stopped at your request.", "", "interrupted", EXIT_INTERRUPTED)
    if isinstance(error, OSError):
        number = error.errno if isinstance(error.errno, int) else None  # OSError("a", "b").errno is "a"
        title, hint = _OS_ERRORS.get(number, ("System error", ""))
        where = f" ({_text(error.filename)})" if error.filename else ""
        code = "os." + errno.errorcode.get(number or 0, "error")
        return UserMessage(title, f"{_text(error.strerror or error)}{where}.", hint, code, EXIT_EXPLAINED)
    if isinstance(error, BaseException):
        return UserMessage("Unexpected error", f"{type(error).__name__}: {_text(error)}",
                           "This is a bug in DeDLOC Volunteer; please report it with the log.", "unexpected",
                           EXIT_UNEXPECTED)
    # a worker's Error event (dedloc_core.protocol.Error): the worker translated it already
    title, message = getattr(error, "title", "Error"), getattr(error, "message", error)
    return UserMessage(_text(title), _text(message), _text(getattr(error, "hint", "") or ""),
                       _text(getattr(error, "code", "error")), EXIT_EXPLAINED)


def report(error: object, stream: TextIO | None = None) -> int:
    """Print ``error`` in the command lines' format to ``stream`` (stderr); return the exit status."""
    msg = user_message(error)
    print(msg.text(), file=stream or sys.stderr, flush=True)
    return msg.exit_code
