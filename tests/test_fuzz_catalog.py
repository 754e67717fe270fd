"""Fuzzing the catalog (issue 16): any input gives a catalog or a ``CatalogError`` with a known code;
never another exception, a hang or a traceback. Real files, real HTTP on 127.0.0.1 and real
subprocesses for the command line and the catalog child."""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dedloc_core.catalog import Catalog, key_id, public_key_line, sign_catalog, validate_catalog, verify_catalog
from dedloc_core.catalog import child as catalog_child
from dedloc_core.catalog.model import _TITLES
from dedloc_core.catalog.sources import parse_link
from dedloc_core.errors import EXIT_EXPLAINED, CatalogError, user_message
from dedloc_core.organizer.httpserve import FileServer

ROOT = Path(__file__).resolve().parents[1]
NOW = datetime(2030, 1, 1, tzinfo=UTC)
CODES = set(_TITLES)  # every code a CatalogError may carry (dedloc_core.catalog's docstring)
DEEP = 200_000  # the nesting of the issue's catalog (a RecursionError traceback before the fix)
FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

KEY = Ed25519PrivateKey.generate()
KEYS = {key_id(KEY.public_key()): KEY.public_key()}
KEY_B64 = base64.b64encode(KEY.public_key().public_bytes(serialization.Encoding.Raw,
                                                         serialization.PublicFormat.Raw)).decode()

# ------------------------------------------------------------------------------------ strategies
# Text with lone surrogates too ("\ud800" is valid JSON; it has no UTF-8 bytes).
TEXT = st.text(st.characters(exclude_categories=()), max_size=20) | st.text(max_size=20)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
                    max_leaves=16)


def experiment() -> dict:
    return {
        "id": "tiny-lm-demo", "title": "Tiny LM demo", "description": "...", "organizer": "DeDLOC Volunteer",
        "recipe": "tiny-lm", "recipe_params": {"d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 64},
        "run_id": "tiny_lm_demo", "initial_peers": ["/ip4/1.2.3.4/tcp/31337/p2p/QmPeer"],
        "target_batch_size": 256, "batch_size_per_step": 16, "matchmaking_time": 3.0, "averaging_timeout": 30.0,
        "hardware": {"ram_gb": 2, "cpu_cores": 2, "disk_gb": 1, "gpu_required": False, "gpu_memory_gb": 4},
        "data": {"base_url": "https://data.example.org/tiny/",
                 "shards": [{"url": "shards/000.txt", "sha256": "ab" * 32, "size": 1000},
                            {"url": "https://cdn.example.org/001.txt", "sha256": "cd" * 32, "size": 5}]},
        "needs_token": False, "status": "active", "expires_at": None, "mode": "diloco",
        "diloco": {"inner_steps": 10, "compression": "fp16"}, "aggregation": "centered_clip",
    }


VALID = {"schema_version": 1, "catalog_id": "dedloc-main", "issued_at": NOW.isoformat(),
         "expires_at": (NOW + timedelta(days=30)).isoformat(), "experiments": [experiment()]}
VALID_TEXT = json.dumps(VALID)
SIGNED = sign_catalog(VALID_TEXT, KEY, now=NOW)
GOOD = verify_catalog(SIGNED, KEYS, now=NOW)


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON value: the value itself, each dict key and each list index, recursively."""
    found = [prefix]
    if isinstance(value, dict):
        for name, child in value.items():
            found += _paths(child, (*prefix, name))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            found += _paths(child, (*prefix, i))
    return found


_DELETE = object()


def _mutate(value: object, path: tuple, new: object) -> object:
    """``value`` with the thing at ``path`` replaced by ``new`` (removed if ``_DELETE``); a path that
    an earlier mutation removed is left alone."""
    if not path:
        return None if new is _DELETE else new
    value = copy.deepcopy(value)
    parent = value
    for step in path[:-1]:
        try:
            parent = parent[step]
        except (KeyError, IndexError, TypeError):
            return value
    if isinstance(parent, dict) or (isinstance(parent, list) and isinstance(path[-1], int)
                                    and path[-1] < len(parent)):
        if new is _DELETE:
            parent.pop(path[-1], None) if isinstance(parent, dict) else parent.pop(path[-1])
        else:
            parent[path[-1]] = new
    return value


MUTATIONS = st.lists(st.tuples(st.sampled_from(_paths(VALID)), JSON | st.just(_DELETE)), min_size=1, max_size=3)


def assert_clear(exc: CatalogError) -> None:
    """A documented rejection: a known code, a title and message, and the CLIs' exit status 3."""
    assert exc.code in CODES, (exc.code, exc.message)
    assert isinstance(exc.message, str) and exc.message and exc.title
    assert user_message(exc).exit_code == EXIT_EXPLAINED


def check_validate(value: object) -> Catalog | None:
    try:
        catalog = validate_catalog(value)  # type: ignore[arg-type]
    except CatalogError as exc:
        assert_clear(exc)
        return None
    assert isinstance(catalog, Catalog)
    return catalog


def check_verify(data: bytes | str) -> Catalog | None:
    try:
        catalog = verify_catalog(data, KEYS, now=NOW)
    except CatalogError as exc:
        assert_clear(exc)
        return None
    assert isinstance(catalog, Catalog)
    return catalog


# ------------------------------------------------------------------------ validate_catalog
@FUZZ
@given(JSON)
@example({"schema_version": 1, "x": [[[[[[[[]]]]]]]]})
@example("\ud800")  # a lone surrogate: "malformed" (was the unhelpful "invalid": Input should be a valid string)
def test_validate_catalog_takes_any_json_value(value):
    text = json.dumps(value, ensure_ascii=False)  # lone surrogates stay in the text as they are
    check_validate(text)
    check_validate(json.dumps(value))
    check_validate(text.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        check_validate(value)
    if value == "\ud800":
        with pytest.raises(CatalogError) as info:
            validate_catalog(text)
        assert info.value.code == "malformed"


@FUZZ
@given(MUTATIONS)
def test_validate_catalog_on_mutations_of_a_valid_catalog(mutations):
    cat: object = VALID
    for path, new in mutations:
        cat = _mutate(cat, path, new)
    as_dict = check_validate(cat) if isinstance(cat, dict) else None
    as_text = check_validate(json.dumps(cat))
    assert as_dict == as_text or not isinstance(cat, dict)
    if as_text is not None:  # what validates signs and verifies to the same catalog, or is refused clearly
        try:
            signed = sign_catalog(json.dumps(cat), KEY, now=NOW)
        except CatalogError as exc:
            assert_clear(exc)
        else:
            assert verify_catalog(signed, KEYS, now=NOW) == as_text


@pytest.mark.parametrize("make", [
    lambda: "[" * DEEP + "]" * DEEP,
    lambda: '{"a":' * DEEP + "1" + "}" * DEEP,
    lambda: ("[" * DEEP + "]" * DEEP).encode(),
    lambda: {"schema_version": 1, "experiments": _nested_list(DEEP)},
], ids=["text", "objects", "bytes", "mapping"])
def test_validate_catalog_on_deep_nesting_is_malformed(make):
    value = make()
    started = time.monotonic()
    with pytest.raises(CatalogError) as info:
        validate_catalog(value)
    assert info.value.code == "malformed", info.value.message
    assert time.monotonic() - started < 10


def _nested_list(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# --------------------------------------------------------------------------- verify_catalog
@FUZZ
@given(st.binary(max_size=4000))
@example(b"[" * DEEP + b"]" * DEEP)
@example(b"\xef\xbb\xbf{}")
@example(b'{"format": "dedloc-catalog/1", "key_id": "0123456789abcdef", "signature": "x", "payload": 1')
def test_verify_catalog_takes_any_bytes(data):
    assert check_verify(data) is None


@FUZZ
@given(JSON)
def test_verify_catalog_takes_any_json_value(value):
    assert check_verify(json.dumps(value)) is None


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(SIGNED) - 1), st.integers(1, 255)), min_size=1, max_size=4))
def test_flipped_bytes_of_a_signed_catalog_are_refused_or_harmless(flips):
    data = bytearray(SIGNED)
    for at, mask in flips:
        data[at] ^= mask
    catalog = check_verify(bytes(data))
    assert catalog is None or catalog == GOOD  # a flip in the envelope's whitespace changes nothing


FIELDS = ("format", "key_id", "signature", "payload", "extra")


@st.composite
def envelope_mutation(draw) -> dict:
    envelope = json.loads(SIGNED)
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(FIELDS))
        how = draw(st.sampled_from(("flip", "replace", "delete")))
        current = envelope.get(field)
        if how == "flip" and isinstance(current, str) and current:
            at = draw(st.integers(0, len(current) - 1))
            char = draw(st.characters(exclude_categories=()))
            envelope[field] = current[:at] + char + current[at + 1:]
        elif how == "delete":
            envelope.pop(field, None)
        else:
            envelope[field] = draw(JSON)
    return envelope


@FUZZ
@given(envelope_mutation(), st.booleans())
@example({"format": "dedloc-catalog/1", "key_id": key_id(KEY.public_key()),
          "signature": base64.b64encode(bytes(64)).decode(), "payload": "\ud800"}, True)  # was UnicodeEncodeError
@example({"format": "x" * 100_000, "key_id": "", "signature": "", "payload": ""}, False)
@example({"format": "\ud800"}, False)  # a lone surrogate in the text given as str: was UnicodeEncodeError
def test_mutated_envelopes_are_refused_or_the_same_catalog(envelope, ascii_only):
    catalog = check_verify(json.dumps(envelope, ensure_ascii=ascii_only))
    original = json.loads(SIGNED)
    assert catalog is None or (catalog == GOOD and envelope["payload"] == original["payload"])


@FUZZ
@given(st.integers(0, 3), st.lists(st.sampled_from(("list", "object")), min_size=1, max_size=10),
       st.integers(1, 3000))
def test_a_signed_catalog_wrapped_in_nesting_is_refused(envelopes, wrappers, repeat):
    text = SIGNED.decode()
    for _ in range(envelopes):  # the envelope as the (correctly signed) payload of another envelope
        text = json.dumps({"format": "dedloc-catalog/1", "key_id": key_id(KEY.public_key()),
                           "signature": base64.b64encode(KEY.sign(text.encode())).decode(), "payload": text})
    for kind in (wrappers * repeat)[:5000]:
        text = f"[{text}]" if kind == "list" else f'{{"a": {text}}}'
    with pytest.raises(CatalogError) as info:
        verify_catalog(text, KEYS, now=NOW)
    assert_clear(info.value)


def test_verify_catalog_on_the_issues_deep_catalog_is_malformed_quickly():
    for data in (b"[" * DEEP + b"]" * DEEP, b'{"format":' * DEEP + b"1" + b"}" * DEEP):
        started = time.monotonic()
        with pytest.raises(CatalogError) as info:
            verify_catalog(data, KEYS, now=NOW)
        assert info.value.code == "malformed" and "\n" not in info.value.message
        assert time.monotonic() - started < 10


def test_a_catalog_over_the_size_limit_is_too_large():
    with pytest.raises(CatalogError) as info:
        verify_catalog(b"[" * (4 * 2**20 + 1), KEYS)
    assert info.value.code == "too_large"


# -------------------------------------------------------------- the command line and the child
def _cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEDLOC_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "dedloc_core.cli", "catalog", "verify", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("nesting", ["lists", "objects"])
def test_cli_verify_of_the_deep_catalog_explains_in_one_line(tmp_path, nesting):
    path = tmp_path / "deep.json"
    path.write_bytes(b"[" * DEEP + b"]" * DEEP if nesting == "lists" else b'{"a":' * DEEP + b"1" + b"}" * DEEP)
    out = _cli(str(path), home=tmp_path / "home")
    assert out.returncode == EXIT_EXPLAINED, out.stderr
    assert "Traceback" not in out.stderr and "RecursionError" not in out.stderr
    lines = out.stderr.splitlines()
    assert lines and lines[0].startswith("Catalog unreadable: ") and lines[0].endswith("[malformed]"), out.stderr
    assert all(line.startswith("  What to do: ") for line in lines[1:]), out.stderr


def test_cli_verify_json_of_the_deep_catalog(tmp_path):
    path = tmp_path / "deep.json"
    path.write_bytes(b"[" * DEEP + b"]" * DEEP)
    out = _cli(str(path), "--json", home=tmp_path / "home")
    assert out.returncode == EXIT_EXPLAINED and "Traceback" not in out.stderr, out.stderr
    answer = json.loads(out.stdout)
    assert answer["ok"] is False and answer["code"] == "malformed"


def test_catalog_child_refuses_the_deep_catalog_and_keeps_the_shipped_one(tmp_path, monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "fuzz.pub").write_text(public_key_line(KEY.public_key(), "fuzz") + "\n")
    monkeypatch.setenv("DEDLOC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DEDLOC_TRUSTED_KEYS", str(keys))
    with FileServer({"/catalog.json": b"[" * DEEP + b"]" * DEEP}) as server:
        result = catalog_child.load(f"{server.url}catalog.json")
    assert result.error is not None and result.error.code == "malformed", result.error
    assert result.source == "default"  # the catalog shipped with the app


def test_catalog_child_answering_deep_nesting_is_check_failed(monkeypatch):
    answer = "print('[' * 200_000 + ']' * 200_000)"
    monkeypatch.setattr(catalog_child, "command", lambda: [sys.executable, "-c", answer])
    result = catalog_child.load()
    assert result.catalog is None and result.error is not None and result.error.code == "check_failed"
    assert catalog_child.inspect("http://127.0.0.1:9/c.json", KEY_B64)[1].code == "check_failed"


CHILD_FIELDS = ("catalog", "error", "source", "expired", "sources", "origins")
CHILD_ERRORS = (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError)  # child.load catches


@FUZZ
@given(JSON | st.dictionaries(st.sampled_from(CHILD_FIELDS), JSON))
@example({"catalog": None, "error": None, "source": "new", "expired": False, "origins": []})  # AttributeError
def test_catalog_child_decode_fails_only_in_ways_load_catches(value):
    try:
        catalog_child.decode(json.dumps(value))
    except CHILD_ERRORS:
        pass


# ------------------------------------------------------------------------------- parse_link
HOSTS = st.sampled_from(["example.org", "127.0.0.1", "[::1]", "[x]", "[::1", "h:99999", "h:-1", "h:abc", "",
                         "user@h", "h:8080", "xn--d1acpjx3f.xn--p1ai"]) | TEXT
URLS = st.builds(lambda scheme, host, path: f"{scheme}{host}{path}",
                 st.sampled_from(["http://", "https://", "HTTP://", "ftp://", "file://", "javascript:", "//", ""]),
                 HOSTS, st.sampled_from(["", "/", "/catalog.json", "/../x", "?a=b", "#f"]) | TEXT)
KEYS_B64 = st.just(KEY_B64) | st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()) | TEXT


@st.composite
def links(draw) -> str:
    head = draw(st.sampled_from(["dedloc://add?", "dedloc:add?", "dedloc:///add?", "DEDLOC://add?",
                                 "dedloc://[add?", "dedloc://ad?", "dedloc://add/?"]))
    parts = []
    for name in draw(st.lists(st.sampled_from(["url", "key", "other", ""]), max_size=4)):
        value = draw(URLS if name == "url" else KEYS_B64 if name == "key" else TEXT)
        encoded = quote(value.encode("utf-8", "surrogatepass"), safe="")
        parts.append(f"{name}={encoded if draw(st.booleans()) else value}")
    return head + "&".join(parts) + draw(st.sampled_from(["", "#frag", " ", "\n"]))


@FUZZ
@given(TEXT | links())
@example(f"dedloc://add?url=http://[x]/c.json&key={KEY_B64}")  # was ValueError from urlsplit
@example(f"dedloc://add?url=http://[::1/c.json&key={KEY_B64}")  # was ValueError: Invalid IPv6 URL
@example(f"dedloc://[add?url=http://h/&key={KEY_B64}")  # was ValueError: Invalid IPv6 URL
@example(f"dedloc://add?url=http://h:99999/c.json&key={KEY_B64}")  # was accepted, port out of range
def test_parse_link_gives_a_url_and_key_or_a_clear_error(link):
    try:
        url, key = parse_link(link)
    except CatalogError as exc:
        assert exc.code in ("bad_url", "bad_key"), exc.code
        assert_clear(exc)
        return
    parts = urlsplit(url)
    assert parts.scheme.lower() in ("http", "https") and parts.hostname
    assert parts.port is None or 0 <= parts.port <= 65535
    assert len(base64.b64decode(key, validate=True)) == 32
