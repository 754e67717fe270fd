"""Fuzzing the preferences loader (issue 16): whatever the file holds, ``prefs.load`` returns valid
preferences; a broken file is kept aside with a warning. It never raises."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dedloc_core import prefs
from dedloc_core.prefs import Loaded, Preferences

FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
FIELDS = sorted(Preferences.__struct_fields__)
WINDOW_FIELDS = ["days", "start", "end"]

TEXT = st.text(st.characters(exclude_categories=()), max_size=20) | st.text(max_size=20)
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-(10**80), 10**80) | st.floats() | TEXT
           | st.sampled_from(["00:00", "23:59", "24:00", "12:30:15.5", "7:5", "T12:00", "12:00Z", "12:00+05:00"]))
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
                    max_leaves=16)
WINDOWS = st.lists(st.dictionaries(st.sampled_from(WINDOW_FIELDS), JSON | st.lists(st.integers(-2, 8), max_size=8)),
                   max_size=3)
OBJECTS = st.dictionaries(st.sampled_from(FIELDS) | TEXT, JSON, max_size=10).flatmap(
    lambda d: st.just(d) | WINDOWS.map(lambda w: {**d, "schedule": w}))


def check(raw: bytes) -> Loaded:
    """Load ``raw`` from a real file; the result is valid, and a warning goes with a file kept aside."""
    with tempfile.TemporaryDirectory() as home:
        path = Path(home) / "preferences.json"
        path.write_bytes(raw)
        loaded = prefs.load(path)
        assert isinstance(loaded, Loaded) and isinstance(loaded.prefs, Preferences)
        prefs.validate(prefs.to_json(loaded.prefs))  # every field within its bounds
        if loaded.warning is None:
            assert loaded.backup is None and path.read_bytes() == raw  # a good file stays where it was
            prefs.save(loaded.prefs, path)  # and what loads saves and loads again, unchanged
            again = prefs.load(path)
            assert again.warning is None and again.prefs == loaded.prefs
        else:
            assert isinstance(loaded.warning, str) and loaded.warning
            assert loaded.backup is not None and loaded.backup.read_bytes() == raw and not path.exists()
            assert loaded.prefs == Preferences()
        return loaded


@FUZZ
@given(st.binary(max_size=2000))
@example(b"[" * 200_000)  # nested too deeply: was a RecursionError
@example(b"\xff\xfe\x00")  # a UTF-16 byte order mark and a truncated character
@example(b'{"idle_minutes": 1e400}')
@example(b'{"display_name": "' + b"9" * 5000 + b'"}')
def test_any_bytes_load_as_valid_preferences(raw):
    check(raw)


@FUZZ
@given(OBJECTS, st.booleans())
@example({"schedule": [{"days": [0, 6], "start": "22:00", "end": "06:30"}]}, True)
@example({"idle_minutes": 10**4000}, True)
@example({"schedule": [{"days": [[[[[[[[]]]]]]]]}]}, True)
def test_any_json_object_loads_as_valid_preferences(data, ascii_only):
    check(json.dumps(data, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"))


def test_deep_nesting_is_kept_aside_with_a_warning():
    for raw in (b"[" * 200_000 + b"]" * 200_000, b'{"schedule":' * 200_000 + b"1" + b"}" * 200_000):
        loaded = check(raw)
        assert loaded.warning and "not valid JSON" in loaded.warning
