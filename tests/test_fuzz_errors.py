"""Fuzzing the errors module (issue 16): ``user_message`` and ``report`` turn any exception and any
object into a message a person can read, and never raise themselves."""

from __future__ import annotations

import errno
import io

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dedloc_core.errors import (
    EXIT_EXPLAINED,
    EXIT_INTERRUPTED,
    EXIT_UNEXPECTED,
    CatalogError,
    DedlocError,
    ProtocolError,
    ShardError,
    UserMessage,
    WorkerError,
    report,
    user_message,
)
from dedloc_core.protocol import Error

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
EXITS = {EXIT_EXPLAINED, EXIT_UNEXPECTED, EXIT_INTERRUPTED}

TEXT = st.text(st.characters(exclude_categories=()), max_size=20) | st.text(max_size=20)
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | TEXT | st.binary(max_size=10)
           | st.sampled_from(list(errno.errorcode)))
VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(TEXT, kids, max_size=3)
                      | st.tuples(kids, kids), max_leaves=8)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


class Hostile(Exception):
    """An exception whose every way of becoming text fails."""

    def __str__(self) -> str:
        raise RuntimeError("no str")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class HostileEvent:
    """An object shaped like an Error event whose attributes raise."""

    @property
    def title(self) -> str:
        raise RuntimeError("no title")

    def __str__(self) -> str:
        raise RuntimeError("no str")


class OddStr:
    def __init__(self, value: object):
        self.value = value

    def __str__(self):  # returns a non-string: str() raises TypeError
        return self.value


EXCEPTION_TYPES = st.sampled_from([Exception, ValueError, RuntimeError, KeyError, OSError, FileNotFoundError,
                                   PermissionError, ConnectionResetError, TimeoutError, KeyboardInterrupt,
                                   SystemExit, RecursionError, MemoryError, BaseException, Hostile])
DEDLOC_TYPES = st.sampled_from([DedlocError, CatalogError, ShardError, ProtocolError, WorkerError])


@st.composite
def exceptions(draw) -> BaseException:
    kind = draw(st.sampled_from(("plain", "dedloc", "oserror")))
    if kind == "plain":
        return draw(EXCEPTION_TYPES)(*draw(st.lists(VALUES, max_size=3)))
    if kind == "oserror":  # errno, strerror, filename, winerror, filename2: any values at all
        error = OSError(*draw(st.lists(VALUES, max_size=5)))
        if draw(st.booleans()):
            error.errno = draw(VALUES)
        return error
    message = draw(VALUES | st.builds(OddStr, VALUES))
    options = draw(st.fixed_dictionaries({}, optional={"title": VALUES, "code": VALUES, "hint": VALUES}))
    return draw(DEDLOC_TYPES)(message, **options)


OBJECTS = (VALUES | st.builds(Error, code=TEXT, title=TEXT, message=TEXT, hint=TEXT, fatal=st.booleans())
           | st.builds(OddStr, VALUES) | st.just(HostileEvent()) | st.just(object()))


def check(error: object) -> UserMessage:
    msg = user_message(error)
    assert isinstance(msg, UserMessage)
    for field in (msg.title, msg.message, msg.hint, msg.code):
        assert isinstance(field, str)
    assert msg.exit_code in EXITS
    assert msg.line() and msg.text()
    out = io.StringIO()
    assert report(error, out) == msg.exit_code and out.getvalue()
    return msg


@FUZZ
@given(exceptions())
@example(OSError([1], "x"))  # an unhashable errno: was TypeError
@example(OSError("not a number", "x", "/tmp/f"))
@example(Hostile())  # str() raises: was RuntimeError
@example(CatalogError(OddStr(5)))  # a message that is not text
@example(KeyboardInterrupt())
@example(OSError(errno.ENOSPC, "No space left on device", "/data"))
def test_user_message_on_any_exception(error):
    msg = check(error)
    if isinstance(error, DedlocError):
        assert msg.exit_code == EXIT_EXPLAINED
    elif isinstance(error, KeyboardInterrupt):
        assert msg.exit_code == EXIT_INTERRUPTED
    elif isinstance(error, OSError):
        assert msg.exit_code == EXIT_EXPLAINED and msg.code.startswith("os.")


@FUZZ
@given(OBJECTS)
@example(HostileEvent())  # its title raises: was RuntimeError
@example(OddStr([1]))
@example(Error(code="disk", title="Disk full", message="Free some space.", hint="", fatal=True))
def test_user_message_on_any_object(error):
    msg = check(error)
    assert msg.exit_code == EXIT_EXPLAINED
    if isinstance(error, Error):
        assert (msg.title, msg.message, msg.code) == (error.title, error.message, error.code)


def test_user_message_on_values_nested_too_deeply_to_print():
    """(Not through hypothesis, which would try to print them.)"""
    deep = _nested(100_000)
    for error in (ValueError(deep), OSError(1, deep, deep), CatalogError(deep), deep):  # str(): RecursionError
        msg = check(error)
        assert msg.exit_code in EXITS
