"""Fuzzing the app <-> worker protocol (issue 16): any line gives a message or a ``ProtocolError``;
never another exception, whatever the bytes, the nesting or the size of the numbers."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dedloc_core import protocol
from dedloc_core.errors import EXIT_EXPLAINED, ProtocolError, user_message
from dedloc_core.protocol import MAX_LINE, PROTOCOL_VERSION, decode_command, decode_event, encode

FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
DECODERS = {"command": decode_command, "event": decode_event}
CODES = {"too_long", "not_json", "not_object", "version", "invalid"}

TEXT = st.text(st.characters(exclude_categories=()), max_size=20) | st.text(max_size=20)
NUMBERS = (st.integers() | st.floats() | st.integers(-(10**80), 10**80)
           | st.sampled_from([2**63, -(2**63) - 1, 10**4299, 1e308, 5e-324]))
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
                    max_leaves=16)


def _fields(*models: type) -> list[str]:
    return sorted({name for model in models for name in model.__struct_fields__} | {"v", "type"})


COMMAND_TYPES = ["start", "pause", "resume", "set_limits", "stop"]
EVENT_TYPES = ["hello", "state", "progress", "stats", "log", "error"]
COMMAND_FIELDS = _fields(protocol.Start, protocol.Pause, protocol.SetLimits, protocol.Limits)
EVENT_FIELDS = _fields(protocol.Hello, protocol.State, protocol.Progress, protocol.Stats, protocol.Log,
                       protocol.Error)


def check(decode, line: str | bytes, *, reencode: bool = True):
    """The line decodes to a message that encodes again, or is refused with a ProtocolError. (A message
    nested past the JSON encoder's depth decodes but may not encode: the worker never
    re-encodes the commands it reads.)"""
    try:
        message = decode(line)
    except ProtocolError as exc:
        assert exc.code in CODES, exc.code
        assert isinstance(exc.message, str) and exc.message and len(exc.message) < 2000
        assert user_message(exc).exit_code == EXIT_EXPLAINED
        return None
    assert isinstance(message, protocol._Message)
    assert not reencode or encode(message).endswith("\n")
    return message


@st.composite
def messages(draw, types: list[str], fields: list[str]) -> dict:
    """A JSON object with "v": 1 and a known "type", and arbitrary (mostly known) fields."""
    body = draw(st.dictionaries(st.sampled_from(fields) | TEXT, JSON, max_size=8))
    if draw(st.integers(0, 9)):  # mostly the right version and a known type
        body["v"] = PROTOCOL_VERSION
        body["type"] = draw(st.sampled_from(types))
    if body.get("type") in ("start", "set_limits") and draw(st.booleans()):
        body["limits"] = draw(st.dictionaries(st.sampled_from(_fields(protocol.Limits)), JSON, max_size=5))
    return body


@FUZZ
@given(st.sampled_from(sorted(DECODERS)), st.binary(max_size=2000) | TEXT)
@example("command", b"\xff\xfe\x00")
@example("event", "\ud800")
def test_any_bytes_or_text_is_a_message_or_a_protocol_error(kind, line):
    check(DECODERS[kind], line)


@FUZZ
@given(messages(COMMAND_TYPES, COMMAND_FIELDS), st.booleans())
@example({"v": 1, "type": "start", "experiment": {}, "batch_size": 10**4000}, True)
@example({"v": 1, "type": "set_limits", "limits": {"cpu_threads": 1e400}}, False)
@example({"\ud800": None}, False)  # a lone surrogate key: UnicodeEncodeError inside msgspec
def test_any_command_object_is_a_command_or_a_protocol_error(body, ascii_only):
    line = json.dumps(body, ensure_ascii=ascii_only)
    check(decode_command, line)
    check(decode_command, line.encode("utf-8", "surrogatepass"))


@FUZZ
@given(messages(EVENT_TYPES, EVENT_FIELDS), st.booleans())
@example({"v": 1, "type": "hello", "version": "x", "pid": 10**4000}, True)
@example({"v": 1, "type": "progress", "loss": float("nan"), "samples_per_second": float("inf")}, True)
@example({"v": 1, "type": "x" * 100_000}, True)  # the message names the type: was 100 kB long
@example({"v": ["x" * 100_000, [[[[[[[[1]]]]]]]]]}, True)  # and the version: was 100 kB long
def test_any_event_object_is_an_event_or_a_protocol_error(body, ascii_only):
    line = json.dumps(body, ensure_ascii=ascii_only)
    check(decode_event, line)
    check(decode_event, line.encode("utf-8", "surrogatepass"))


@FUZZ
@given(st.sampled_from(sorted(DECODERS)), st.sampled_from(["[", '{"a":', '{"v":1,"type":"start","experiment":']),
       st.integers(1, 300_000))
def test_deep_nesting_is_a_protocol_error_or_a_message(kind, opener, depth):
    if opener == "[":
        line = "[" * depth + "]" * depth
    elif opener == '{"a":':
        line = opener * depth + "1" + "}" * depth
    else:  # a start command whose experiment is nested ``depth`` deep
        line = opener + '{"a":' * depth + "1" + "}" * depth + "}"
    check(DECODERS[kind], line, reencode=False)


@pytest.mark.parametrize("kind", sorted(DECODERS))
@pytest.mark.parametrize("line", [
    "[" * 500_000,  # a line of MAX_LINE or less, nested far past Python's recursion limit
    "[" * 500_000 + "]" * 500_000,
    '{"v": 1, "type": "start", "experiment": ' + '{"a":' * 200_000 + "1" + "}" * 200_001,
    "1" + "0" * 5000,  # past Python's 4300-digit limit for int()
    '{"v": 1, "type": "hello", "version": "x", "pid": ' + "9" * 5000 + "}",
    " " * (MAX_LINE + 1),
    "x" * (MAX_LINE + 1),
], ids=["open", "closed", "start", "bigint", "pid", "spaces", "long"])
def test_known_hard_lines_fail_quickly_and_clearly(kind, line):
    started = time.monotonic()
    for variant in (line, line.encode()):
        with pytest.raises(ProtocolError) as info:
            DECODERS[kind](variant)
        assert info.value.code in CODES
    assert time.monotonic() - started < 10
