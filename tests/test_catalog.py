"""The signed experiment catalog: schema, signatures, every rejection code, the store and the CLI."""

from __future__ import annotations

import base64
import copy
import json
import os
import stat
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from dedloc_core.catalog import (
    MAX_CATALOG_BYTES,
    Catalog,
    CatalogStore,
    fetch_catalog,
    generate_keypair,
    key_id,
    load_private_key,
    load_trusted_keys,
    parse_public_key,
    sign_catalog,
    validate_catalog,
    verify_catalog,
)
from dedloc_core.catalog.shards import resolve_url
from dedloc_core.errors import EXIT_EXPLAINED, CatalogError

ROOT = Path(__file__).resolve().parents[1]
NOW = datetime(2030, 1, 1, tzinfo=UTC)
PASSPHRASE = "correct horse battery staple"


def experiment(**changes) -> dict:
    """A valid experiment entry, with ``changes`` applied on top."""
    exp = {
        "id": "tiny-lm-demo", "title": "Tiny LM demo", "description": "...", "organizer": "DeDLOC Volunteer",
        "recipe": "tiny-lm", "recipe_params": {"d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 64},
        "run_id": "tiny_lm_demo", "initial_peers": [], "target_batch_size": 256, "batch_size_per_step": 16,
        "matchmaking_time": 3.0, "averaging_timeout": 30.0,
        "hardware": {"ram_gb": 2, "cpu_cores": 2, "disk_gb": 1, "gpu_required": False},
        "data": {"base_url": None, "shards": [{"url": "shards/tiny-lm/000.txt", "sha256": "ab" * 32,
                                                "size": 1000}]},
        "needs_token": False, "status": "active", "expires_at": None,
    }
    exp.update(copy.deepcopy(changes))
    return exp


def catalog_dict(*experiments: dict, issued: datetime = NOW, days: float = 30, **changes) -> dict:
    cat = {
        "schema_version": 1, "catalog_id": "dedloc-main", "issued_at": issued.isoformat(),
        "expires_at": (issued + timedelta(days=days)).isoformat(),
        "experiments": list(experiments) if experiments else [experiment()],
    }
    cat.update(changes)
    return cat


@pytest.fixture(scope="module")
def key():
    pem, _ = generate_keypair(PASSPHRASE)
    return load_private_key(pem, PASSPHRASE)


@pytest.fixture(scope="module")
def keys(key):
    return {key_id(key.public_key()): key.public_key()}


def signed(cat: dict, key) -> bytes:
    return sign_catalog(json.dumps(cat), key, now=NOW)


def rejected(code: str, data: bytes, keys, now: datetime = NOW) -> CatalogError:
    with pytest.raises(CatalogError) as info:
        verify_catalog(data, keys, now=now)
    assert info.value.code == code, info.value.message
    assert info.value.title and info.value.message
    return info.value


def rejected_schema(code: str, cat: dict) -> CatalogError:
    with pytest.raises(CatalogError) as info:
        validate_catalog(json.dumps(cat))
    assert info.value.code == code, info.value.message
    return info.value


# ------------------------------------------------------------------------------------ good path
def test_valid_catalog_signs_verifies_and_round_trips(key, keys):
    cat = catalog_dict()
    data = signed(cat, key)
    envelope = json.loads(data)
    assert set(envelope) == {"format", "key_id", "signature", "payload"}
    assert envelope["format"] == "dedloc-catalog/1"
    assert envelope["key_id"] == key_id(key.public_key()) and len(envelope["key_id"]) == 16
    assert envelope["payload"] == json.dumps(cat)
    verified = verify_catalog(data, keys, now=NOW)
    assert verified == validate_catalog(json.dumps(cat))
    assert verified.get("tiny-lm-demo").recipe_params["d_model"] == 128
    assert verified.get("nope") is None
    # signing the model itself round-trips too
    assert verify_catalog(sign_catalog(verified, key, now=NOW), keys, now=NOW) == verified


def test_public_key_line_round_trips(key):
    pem, line = generate_keypair(PASSPHRASE, comment="alice")
    assert line.startswith("ed25519 ") and line.endswith(" alice")
    private = load_private_key(pem, PASSPHRASE)
    assert key_id(parse_public_key(line)) == key_id(private.public_key())


def test_load_trusted_keys_from_folder(tmp_path, key):
    _, line = generate_keypair(PASSPHRASE)
    (tmp_path / "a.pub").write_text(line + "\n")
    (tmp_path / "notes.txt").write_text("not a key")
    loaded = load_trusted_keys([tmp_path])
    assert list(loaded) == [key_id(parse_public_key(line))]
    (tmp_path / "bad.pub").write_text("ssh-rsa AAAA")
    with pytest.raises(CatalogError) as info:
        load_trusted_keys([tmp_path])
    assert info.value.code == "bad_key"


def test_default_trusted_keys_load():
    assert isinstance(load_trusted_keys(), dict)


def test_shipped_default_catalog_verifies_with_shipped_keys(tmp_path):
    from dedloc_core.paths import resource

    shipped = resource("catalog", "default.json")
    if not shipped.is_file():
        pytest.skip("no shipped default catalog")
    catalog = verify_catalog(shipped.read_bytes(), load_trusted_keys(), allow_expired=True)
    assert catalog.experiments
    result = CatalogStore(tmp_path / "last.json").load_default()
    assert result.source == "default" and result.catalog == catalog


def test_valid_variants_accepted():
    validate_catalog(catalog_dict(experiment(
        initial_peers=["/ip4/203.0.113.7/tcp/31337/p2p/QmXyZ123", "/dns4/example.org/tcp/443/wss"],
        data={"base_url": "https://example.org/data", "shards": [
            {"url": "shards/000.txt", "sha256": "cd" * 32, "size": 5},
            {"url": "https://mirror.example.org/x/001.txt", "sha256": "ef" * 32, "size": 5}]},
        hardware={"ram_gb": 8, "cpu_cores": 4, "disk_gb": 10, "gpu_required": True, "gpu_memory_gb": 6},
        expires_at="2030-06-01T00:00:00Z", status="upcoming")))
    assert validate_catalog(catalog_dict(experiment(), experiment(id="other"))).get("other")
    assert validate_catalog(catalog_dict(experiments=[])).experiments == []


# ------------------------------------------------------------------------- signature rejections
def test_unsigned_envelope(key, keys):
    envelope = json.loads(signed(catalog_dict(), key))
    del envelope["signature"]
    rejected("unsigned", json.dumps(envelope).encode(), keys)
    envelope["signature"], envelope["key_id"] = "", ""
    rejected("unsigned", json.dumps(envelope).encode(), keys)


def test_bare_catalog_is_unsigned(keys):
    rejected("unsigned", json.dumps(catalog_dict()).encode(), keys)


def test_tampered_payload_one_byte(key, keys):
    envelope = json.loads(signed(catalog_dict(), key))
    envelope["payload"] = envelope["payload"].replace('"target_batch_size": 256', '"target_batch_size": 257')
    rejected("tampered", json.dumps(envelope).encode(), keys)


def test_signed_by_untrusted_key(keys):
    pem, _ = generate_keypair(PASSPHRASE)
    other = load_private_key(pem, PASSPHRASE)
    err = rejected("untrusted_key", signed(catalog_dict(), other), keys)
    assert key_id(other.public_key()) in err.message


def test_wrong_signature_bytes(key, keys):
    envelope = json.loads(signed(catalog_dict(), key))
    envelope["signature"] = base64.b64encode(key.sign(b"something else")).decode()
    rejected("tampered", json.dumps(envelope).encode(), keys)


def test_expired(key, keys):
    data = signed(catalog_dict(days=1), key)
    verify_catalog(data, keys, now=NOW + timedelta(hours=23))
    rejected("expired", data, keys, now=NOW + timedelta(days=1))
    assert verify_catalog(data, keys, now=NOW + timedelta(days=2), allow_expired=True)
    with pytest.raises(CatalogError) as info:
        sign_catalog(json.dumps(catalog_dict(days=1)), key, now=NOW + timedelta(days=3))
    assert info.value.code == "expired"


def test_malformed_json(keys):
    rejected("malformed", b"{not json", keys)
    rejected("malformed", b"\xff\xfe", keys)
    rejected("malformed", b"[1, 2]", keys)


@pytest.mark.parametrize("change", [
    {"format": "something/9"},
    {"payload": {"schema_version": 1}},
    {"key_id": "not-hex"},
    {"signature": "***not base64***"},
    {"signature": base64.b64encode(b"short").decode()},
    {"extra": 1},
])
def test_malformed_envelope(key, keys, change):
    envelope = json.loads(signed(catalog_dict(), key))
    envelope.update(change)
    rejected("malformed", json.dumps(envelope).encode(), keys)


def test_signed_garbage_payload_is_malformed(key, keys):
    envelope = json.loads(signed(catalog_dict(), key))
    envelope["payload"] = "not json"
    envelope["signature"] = base64.b64encode(key.sign(b"not json")).decode()
    rejected("malformed", json.dumps(envelope).encode(), keys)


def test_too_large(key, keys):
    rejected("too_large", b" " * (MAX_CATALOG_BYTES + 1), keys)
    huge = catalog_dict(experiment(description="x" * 10_000))
    huge["experiments"] = [experiment(id=f"exp-{i}", description="x" * 10_000) for i in range(450)]
    with pytest.raises(CatalogError) as info:
        sign_catalog(json.dumps(huge), key, now=NOW)
    assert info.value.code == "too_large"


# ---------------------------------------------------------------------------- schema rejections
def test_schema_errors_reach_verify(key, keys):
    """A signed catalog that breaks the schema is rejected with the schema's code."""
    envelope = json.loads(signed(catalog_dict(), key))
    bad = json.dumps(catalog_dict(experiment(recipe="gpt-17")))
    envelope["payload"], envelope["signature"] = bad, base64.b64encode(key.sign(bad.encode())).decode()
    rejected("unknown_recipe", json.dumps(envelope).encode(), keys)


def test_unknown_recipe(key):
    err = rejected_schema("unknown_recipe", catalog_dict(experiment(recipe="gpt-17")))
    assert "experiments[0].recipe" in err.message
    with pytest.raises(CatalogError) as info:
        sign_catalog(json.dumps(catalog_dict(experiment(recipe="gpt-17"))), key, now=NOW)
    assert info.value.code == "unknown_recipe"


@pytest.mark.parametrize("changes", [
    {"target_batch_size": -1},
    {"target_batch_size": 10**12},
    {"batch_size_per_step": 0},
    {"batch_size_per_step": 512},  # more than the target batch
    {"matchmaking_time": -3.0},
    {"averaging_timeout": 1e9},
    {"recipe_params": {"d_model": 10**9}},
    {"recipe_params": {"d_model": 128, "n_heads": 0}},
    {"hardware": {"ram_gb": -1, "cpu_cores": 2, "disk_gb": 1, "gpu_required": False}},
    {"hardware": {"ram_gb": 2, "cpu_cores": 10**6, "disk_gb": 1, "gpu_required": False}},
])
def test_absurd_numbers(changes):
    err = rejected_schema("invalid_value", catalog_dict(experiment(**changes)))
    assert "experiments[0]" in err.message


def test_bad_recipe_params_of_the_wrong_kind_are_invalid():
    rejected_schema("invalid", catalog_dict(experiment(recipe_params={"no_such_param": 1})))
    rejected_schema("invalid", catalog_dict(experiment(recipe_params={"d_model": 100, "n_heads": 3})))


@pytest.mark.parametrize("changes", [
    {"id": "../evil"},
    {"id": "a/b"},
    {"id": "..."},
    {"run_id": "runs/evil"},
    {"run_id": "..hidden"},
    {"run_id": "a\\b"},
    {"run_id": "a\x00b"},
    {"run_id": "C:"},
])
def test_path_tricks_in_names(changes):
    rejected_schema("unsafe_name", catalog_dict(experiment(**changes)))


@pytest.mark.parametrize("url", [
    "../../etc/passwd", "shards/../../x", "file:///etc/passwd", "ftp://example.org/x", "data:,hello",
    "%2e%2e/x", "shards/%2E%2E/x", "/etc/x", "//evil.example.org/x", "~/x", "C:\\x", "C:/x",
    "http://example.org/a/../../b", "http://example.org/%252e%252e/b", "shards\\x", "javascript:alert(1)",
])
def test_path_tricks_in_shard_urls(url):
    shards = [{"url": url, "sha256": "ab" * 32, "size": 10}]
    rejected_schema("unsafe_name", catalog_dict(experiment(data={"base_url": None, "shards": shards})))


@pytest.mark.parametrize("base_url", ["file:///srv/data", "/srv/data", "ftp://example.org/"])
def test_unsafe_base_url(base_url):
    data = {"base_url": base_url, "shards": experiment()["data"]["shards"]}
    rejected_schema("unsafe_name", catalog_dict(experiment(data=data)))


def test_catalog_id_path_trick():
    rejected_schema("unsafe_name", catalog_dict(catalog_id="../cat"))


def test_duplicate_experiment_ids():
    err = rejected_schema("invalid", catalog_dict(experiment(), experiment(title="Again")))
    assert "duplicate" in err.message and "tiny-lm-demo" in err.message


@pytest.mark.parametrize("cat", [
    catalog_dict(schema_version=2),
    catalog_dict(experiment(status="running")),
    catalog_dict(experiment(extra_field=1)),
    catalog_dict(experiment(target_batch_size="256")),
    catalog_dict(experiment(needs_token="yes")),
    catalog_dict(experiment(expires_at="2030-01-01T00:00:00")),  # naive datetime
    catalog_dict(issued_at="2030-01-01T00:00:00"),
    catalog_dict(days=-1),
    catalog_dict(experiment(initial_peers=["ip4/1.2.3.4"])),
    catalog_dict(experiment(initial_peers=["/ip4/" + "1" * 600])),
    catalog_dict(experiment(initial_peers=["/dns4/a b/tcp/1"])),
    catalog_dict(experiment(initial_peers=["/ip4/1.2.3.4/tcp/1\n"])),
    catalog_dict(experiment(initial_peers=["/ip4/1.2.3.4"] * 65)),
    catalog_dict(experiment(id="UPPER")),
    catalog_dict(experiment(data={"base_url": None, "shards": []})),
    catalog_dict(experiment(data={"base_url": None, "shards": [{"url": "x.txt", "sha256": "z", "size": 1}]})),
    catalog_dict(experiment(data={"base_url": "example.org/data", "shards": experiment()["data"]["shards"]})),
])
def test_invalid_schema(cat):
    err = rejected_schema("invalid", cat)
    assert ":" in err.message  # names the field


def test_error_message_names_the_field():
    cat = catalog_dict(experiment(), experiment(id="second", hardware={"ram_gb": 2}))
    err = rejected_schema("invalid", cat)
    assert "experiments[1].hardware.cpu_cores" in err.message


# --------------------------------------------------------------------------------------- store
@pytest.fixture
def default_file(tmp_path):
    path = tmp_path / "default.json"
    path.write_text(json.dumps(catalog_dict(catalog_id="shipped-default", days=3650)))
    return path


def test_store_keeps_last_good_after_a_bad_one(tmp_path, key, keys, default_file):
    store = CatalogStore(tmp_path / "state" / "last.json", default=default_file)
    assert store.load_default(keys, now=NOW).catalog.catalog_id == "shipped-default"
    assert store.load_default(keys, now=NOW).source == "default"

    good = signed(catalog_dict(), key)
    result = store.accept(good, keys, now=NOW)
    assert result.error is None and not result.from_last_good and result.catalog.catalog_id == "dedloc-main"
    assert store.path.read_bytes() == good

    tampered = good.replace(b"Tiny LM demo", b"Tiny LM dema")
    result = store.accept(tampered, keys, now=NOW)
    assert result.error.code == "tampered"
    assert result.from_last_good and result.catalog.catalog_id == "dedloc-main"
    assert store.path.read_bytes() == good
    assert store.load_default(keys, now=NOW).from_last_good

    # a last good catalog that has expired since is still shown, flagged
    later = NOW + timedelta(days=60)
    result = store.accept(b"{bad", keys, now=later)
    assert result.error.code == "malformed" and result.from_last_good and result.expired


def test_store_refuses_rollback(tmp_path, key, keys, default_file):
    store = CatalogStore(tmp_path / "last.json", default=default_file)
    newer = signed(catalog_dict(issued=NOW + timedelta(days=1)), key)
    older = signed(catalog_dict(issued=NOW), key)
    assert store.accept(newer, keys, now=NOW + timedelta(days=2)).error is None
    result = store.accept(older, keys, now=NOW + timedelta(days=2))
    assert result.error.code == "outdated" and result.from_last_good
    assert store.path.read_bytes() == newer


def test_store_survives_corrupt_last_good(tmp_path, key, keys, default_file):
    last = tmp_path / "last.json"
    last.write_bytes(b"\x00garbage")
    store = CatalogStore(last, default=default_file)
    result = store.load_default(keys, now=NOW)
    assert result.source == "default" and result.catalog.catalog_id == "shipped-default"
    result = store.accept(b"not json", keys, now=NOW)
    assert result.error.code == "malformed" and result.source == "default" and result.catalog
    # a good catalog replaces the corrupt file
    assert store.accept(signed(catalog_dict(), key), keys, now=NOW).error is None
    assert store.load_default(keys, now=NOW).from_last_good


def test_store_last_good_signed_by_a_key_no_longer_trusted(tmp_path, key, keys, default_file):
    store = CatalogStore(tmp_path / "last.json", default=default_file)
    store.accept(signed(catalog_dict(), key), keys, now=NOW)
    assert store.load_default({}, now=NOW).source == "default"


def test_store_signed_default_and_missing_default(tmp_path, key, keys):
    signed_default = tmp_path / "default.json"
    signed_default.write_bytes(signed(catalog_dict(catalog_id="signed-default"), key))
    store = CatalogStore(tmp_path / "last.json", default=signed_default)
    assert store.load_default(keys, now=NOW).catalog.catalog_id == "signed-default"
    assert store.load_default({}, now=NOW).catalog is None  # signed by a key we do not trust
    missing = CatalogStore(tmp_path / "last.json", default=tmp_path / "nope.json")
    result = missing.load_default(keys, now=NOW)
    assert result.catalog is None and result.source == "none" and result.error is not None


def test_fetch_rejects_other_schemes_and_reports_unreachable():
    with pytest.raises(CatalogError) as info:
        fetch_catalog("file:///etc/passwd")
    assert info.value.code == "bad_url"
    with pytest.raises(CatalogError) as info:
        fetch_catalog("http://127.0.0.1:9/catalog.json", timeout=2)
    assert info.value.code == "unreachable"


def test_fetch_and_refresh_over_http(tmp_path, key, keys, default_file):
    import http.server
    import threading

    body = signed(catalog_dict(), key)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            payload = body if self.path == "/catalog.json" else b" " * (MAX_CATALOG_BYTES + 10)
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert fetch_catalog(f"{base}/catalog.json") == body
        with pytest.raises(CatalogError) as info:
            fetch_catalog(f"{base}/huge.json")
        assert info.value.code == "too_large"
        store = CatalogStore(tmp_path / "last.json", default=default_file)
        assert store.refresh(f"{base}/catalog.json", keys, now=NOW).catalog.catalog_id == "dedloc-main"
    finally:
        server.shutdown()
        server.server_close()
    result = store.refresh(f"{base}/catalog.json", keys, now=NOW, timeout=2)
    assert result.error.code == "unreachable" and result.from_last_good


def test_shard_url_resolution():
    data = {"base_url": "https://example.org/data", "shards": experiment()["data"]["shards"]}
    exp = validate_catalog(catalog_dict(experiment(data=data))).experiments[0]
    assert exp.data.base_url == "https://example.org/data/"
    # shard URLs are resolved in one place, dedloc_core.catalog.shards.resolve_url
    assert resolve_url(exp.data.shards[0], exp.data.base_url) == "https://example.org/data/shards/tiny-lm/000.txt"


def test_models_are_frozen():
    cat = validate_catalog(catalog_dict())
    with pytest.raises(AttributeError):
        cat.experiments[0].target_batch_size = 5  # type: ignore[misc]
    assert isinstance(cat, Catalog)


# ----------------------------------------------------------------------------------------- CLI
def cli(*args: str, env_passphrase: str | None = PASSPHRASE) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DEDLOC_CATALOG_PASSPHRASE"}
    if env_passphrase is not None:
        env["DEDLOC_CATALOG_PASSPHRASE"] = env_passphrase
    return subprocess.run([sys.executable, "-m", "dedloc_core.catalog.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_cli_keygen_sign_verify(tmp_path):
    keydir = tmp_path / "keys"
    out = cli("keygen", "--out", str(keydir), "--name", "org")
    assert out.returncode == 0, out.stderr
    key_file, pub_file = keydir / "org.key", keydir / "org.pub"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    pem = key_file.read_bytes()
    assert b"ENCRYPTED PRIVATE KEY" in pem
    with pytest.raises(TypeError):  # encrypted: not loadable without the passphrase
        serialization.load_pem_private_key(pem, None)
    with pytest.raises(ValueError):
        serialization.load_pem_private_key(pem, b"wrong")
    assert pub_file.read_text().startswith("ed25519 ")
    assert cli("keygen", "--out", str(keydir), "--name", "org").returncode == EXIT_EXPLAINED  # never overwrites

    now = datetime.now(UTC)
    src, dst = tmp_path / "catalog.json", tmp_path / "signed.json"
    src.write_text(json.dumps(catalog_dict(issued=now)))
    out = cli("sign", "--key", str(key_file), "--in", str(src), "--out", str(dst))
    assert out.returncode == 0, out.stderr
    assert json.loads(dst.read_text())["payload"] == src.read_text()

    out = cli("verify", str(dst), "--trusted-key", str(pub_file))
    assert out.returncode == 0, out.stderr
    assert "tiny-lm-demo" in out.stdout and "OK" in out.stdout
    out = cli("verify", str(dst), "--trusted-key", str(keydir), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["catalog"]["experiments"][0]["id"] == "tiny-lm-demo"

    tampered = tmp_path / "tampered.json"
    tampered.write_bytes(dst.read_bytes().replace(b"Tiny LM demo", b"Tiny LM dema"))
    out = cli("verify", str(tampered), "--trusted-key", str(pub_file), "--json")
    assert out.returncode == EXIT_EXPLAINED and json.loads(out.stdout)["code"] == "tampered"
    out = cli("verify", str(tampered), "--trusted-key", str(pub_file))
    assert out.returncode == EXIT_EXPLAINED and "[tampered]" in out.stderr

    out = cli("sign", "--key", str(key_file), "--in", str(src), "--out", str(dst), env_passphrase="wrong")
    assert out.returncode == EXIT_EXPLAINED and "bad_key" in out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(catalog_dict(experiment(recipe="gpt-17"), issued=now)))
    out = cli("sign", "--key", str(key_file), "--in", str(bad), "--out", str(tmp_path / "x.json"))
    assert out.returncode == EXIT_EXPLAINED and "unknown_recipe" in out.stderr
    assert not (tmp_path / "x.json").exists()
