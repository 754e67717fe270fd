"""HTTPS for the backbone: a local CA made here signs a certificate for 127.0.0.1 and localhost;
clients verify it the standard way (the CA named by ``SSL_CERT_FILE``). Also the backbone's refusal
of plain HTTP on a public address, the clients' refusal to send codes and tokens over plain HTTP to
another computer, and the limits on POST endpoints (``/invite/*``)."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import socket
import ssl
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from email.message import Message
from pathlib import Path

import pytest
from conftest import tiny_experiment
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from dedloc_core import invites
from dedloc_core.catalog import key_id, public_key_line, sign_catalog, verify_catalog
from dedloc_core.catalog.shards import Shard
from dedloc_core.engine.shard_cache import ShardCache
from dedloc_core.errors import DedlocError, ShardError
from dedloc_core.invites import InviteError
from dedloc_core.organizer import backbone
from dedloc_core.organizer import invites as org
from dedloc_core.organizer.httpserve import FileServer
from dedloc_core.stats.swarmview import SwarmUnavailable, SwarmView, fetch_summary

DATA = bytes(range(256)) * 1024  # 256 KiB: several of the server's 64 KiB chunks
PLAIN_REMOTE = "http://10.1.2.3:8000/"  # never contacted: the clients refuse before connecting


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A local CA (``ca.pem``) and a server certificate it signed for 127.0.0.1 and localhost."""
    folder = tmp_path_factory.mktemp("pki")
    now = datetime.now(UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("dedloc test CA")).issuer_name(_name("dedloc test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


@pytest.fixture()
def trust_ca(pki, monkeypatch) -> Path:
    """This process trusts the test CA the standard way (OpenSSL reads ``SSL_CERT_FILE``)."""
    monkeypatch.setenv("SSL_CERT_FILE", str(pki["ca"]))
    return pki["ca"]


def _signed_catalog() -> tuple[bytes, object, str]:
    key = Ed25519PrivateKey.generate()
    now = datetime.now(UTC)
    catalog = {"schema_version": 1, "catalog_id": "https", "issued_at": now.isoformat(),
               "expires_at": (now + timedelta(days=1)).isoformat(), "experiments": [tiny_experiment()]}
    data = sign_catalog(json.dumps(catalog), key)
    exp = verify_catalog(data, {key_id(key.public_key()): key.public_key()}).experiments[0]
    return data, exp, public_key_line(key.public_key())


def _serve_backbone(stack: ExitStack, tmp: Path, *extra: str) -> tuple[str, bytes]:
    """The real ``Backbone._serve_http`` (no keeper): its URL and the catalog it serves."""
    data_dir = tmp / "data"
    data_dir.mkdir(exist_ok=True)
    (data_dir / "shard.bin").write_bytes(DATA)
    catalog, exp, key_line = _signed_catalog()
    node = backbone.Backbone(backbone.parse_args(["--run-dir", str(tmp / "run"), "--data-dir", str(data_dir),
                                                  "--http-port", "0", *extra]))
    node.view = SwarmView.load(node.run_dir, exp.run_id)
    return node._serve_http(stack, catalog, exp, key_line), catalog


# ------------------------------------------------------------------------------ TLS and trust
def test_a_client_that_trusts_the_ca_fetches_the_catalog_over_https(tmp_path, pki, trust_ca):
    with ExitStack() as stack:
        url, catalog = _serve_backbone(stack, tmp_path, "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]))
        assert url.startswith("https://127.0.0.1:")
        with urllib.request.urlopen(url + "catalog.json", timeout=10) as response:
            assert response.read() == catalog
        assert fetch_summary(url + "swarm.json").run_id  # the app's own client, default verification


def test_a_client_that_does_not_trust_the_ca_is_refused(tmp_path, pki, monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with FileServer({"/catalog.json": b"{}"}, tls_cert=pki["cert"], tls_key=pki["key"]) as server:
        with pytest.raises(urllib.error.URLError) as refused:
            urllib.request.urlopen(server.url + "catalog.json", timeout=10)
        assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)
        with pytest.raises(OSError):  # and plain HTTP to an HTTPS port gets no answer
            urllib.request.urlopen(server.url.replace("https", "http") + "catalog.json", timeout=10)


def test_a_handshake_for_another_host_name_fails(pki):
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    with FileServer({"/x": b"x"}, tls_cert=pki["cert"], tls_key=pki["key"]) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
                context.wrap_socket(sock, server_hostname="volunteers.example.org")
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # the right name works
            with context.wrap_socket(sock, server_hostname="localhost") as tls:
                tls.sendall(b"GET /x HTTP/1.1\r\nHost: localhost\r\n\r\n")
                assert tls.recv(4096).startswith(b"HTTP/1.1 200")


def test_a_certificate_without_its_key_is_refused(pki):
    with pytest.raises(ValueError, match="tls_key"):
        FileServer(tls_cert=pki["cert"])
    with pytest.raises(ssl.SSLError):  # a key that is not the certificate's
        FileServer(tls_cert=pki["cert"], tls_key=pki["ca"]).start()


def test_a_range_request_over_tls_gets_206_and_the_right_bytes(tmp_path, pki, trust_ca):
    with ExitStack() as stack:
        url, _ = _serve_backbone(stack, tmp_path, "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]))
        request = urllib.request.Request(url + "data/shard.bin", headers={"Range": "bytes=70000-200000"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 206
            assert response.headers["Content-Range"] == f"bytes 70000-200000/{len(DATA)}"
            assert response.read() == DATA[70000:200001]
        with pytest.raises(urllib.error.HTTPError) as unsatisfiable:
            urllib.request.urlopen(urllib.request.Request(url + "data/shard.bin",
                                                          headers={"Range": f"bytes={len(DATA)}-"}), timeout=10)
        assert unsatisfiable.value.code == 416
        shard = Shard(url="data/shard.bin", sha256=hashlib.sha256(DATA).hexdigest(), size=len(DATA))
        assert ShardCache(tmp_path / "cache", 1 << 20).fetch(shard, url).read_bytes() == DATA


# ------------------------------------------------------------------------- the backbone's rule
def test_the_backbone_refuses_plain_http_on_a_public_address(tmp_path, caplog):
    with ExitStack() as stack, pytest.raises(DedlocError) as refused:
        _serve_backbone(stack, tmp_path, "--http-host", "0.0.0.0")
    assert refused.value.code == "tls_needed" and "0.0.0.0" in refused.value.message
    assert "--tls-cert" in refused.value.hint and "--insecure-http" in refused.value.hint
    with ExitStack() as stack, pytest.raises(DedlocError, match="both --tls-cert and --tls-key"):
        _serve_backbone(stack, tmp_path, "--http-host", "0.0.0.0", "--tls-cert", str(tmp_path / "cert.pem"))
    caplog.set_level(logging.ERROR)  # the command line says it in one line and exits with an error
    assert backbone.main(["--run-dir", str(tmp_path / "cli"), "--http-host", "0.0.0.0"]) != 0
    assert "HTTPS needed" in caplog.text and "0.0.0.0" in caplog.text


def test_the_backbone_serves_a_public_address_with_tls_or_the_explicit_flag(tmp_path, pki, trust_ca):
    with ExitStack() as stack:
        url, catalog = _serve_backbone(stack, tmp_path, "--http-host", "0.0.0.0", "--tls-cert", str(pki["cert"]),
                                       "--tls-key", str(pki["key"]))
        assert url.startswith("https://0.0.0.0:")
        port = url.rsplit(":", 1)[1].rstrip("/")
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/catalog.json", timeout=10) as response:
            assert response.read() == catalog
    with ExitStack() as stack:
        url, catalog = _serve_backbone(stack, tmp_path, "--http-host", "0.0.0.0", "--insecure-http")
        port = url.rsplit(":", 1)[1].rstrip("/")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/catalog.json", timeout=10) as response:
            assert response.read() == catalog


# ------------------------------------------------------------- clients keep codes and tokens safe
@pytest.fixture()
def issuer(tmp_path) -> org.Issuer:
    org.generate_key(tmp_path, "pw")
    return org.Issuer(org.InviteStore(tmp_path), org.load_key(tmp_path, "pw"), "gated-run", lifetime=60.0)


def identity():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def test_clients_refuse_to_send_a_code_or_token_over_plain_http_to_another_computer(tmp_path):
    started = time.monotonic()
    with pytest.raises(InviteError) as refused:
        invites.redeem(PLAIN_REMOTE, "AAAA-BBBB-CCCC-DDDD", identity(), "gated-run")
    assert "http://10.1.2.3:8000/invite/redeem" in refused.value.message and "https" in refused.value.message
    with pytest.raises(InviteError, match="not https"):
        invites.renew(PLAIN_REMOTE, identity(), "gated-run")
    with pytest.raises(InviteError, match="not https"):
        invites.report(PLAIN_REMOTE, identity(), "gated-run", "QmPeer", "bad gradients")
    with pytest.raises(SwarmUnavailable, match="Refusing to send an access token to http://10.1.2.3"):
        fetch_summary(PLAIN_REMOTE + "swarm.json", token="a.b.c")
    shard = Shard(url="data/x.bin", sha256="0" * 64, size=1)
    with pytest.raises(ShardError, match="Refusing to send an access token to http://10.1.2.3"):
        ShardCache(tmp_path / "cache", 1 << 20, retries=1, token="a.b.c").fetch(shard, PLAIN_REMOTE)
    assert time.monotonic() - started < 5  # none of them waited for 10.1.2.3 to answer


@pytest.mark.parametrize("tls", [False, True], ids=["http-loopback", "https"])
def test_codes_are_sent_to_loopback_http_and_to_https(issuer, pki, trust_ca, tls):
    code, _ = issuer.store.create(uses=1)
    alice = identity()
    files = {"tls_cert": pki["cert"], "tls_key": pki["key"]} if tls else {}
    with FileServer(**files) as server:
        issuer.add_routes(server)
        assert server.url.startswith("https://" if tls else "http://127.0.0.1:")
        token = invites.redeem(server.url, code, alice, "gated-run")
        assert invites.verify(token, invites.load_public_key(issuer.public_key_text), "gated-run")
        assert invites.renew(server.url.replace("127.0.0.1", "localhost"), alice, "gated-run")
    assert invites.plain_http_refusal("http://[::1]:80/", "a code") is None
    assert invites.plain_http_refusal("ftp://127.0.0.1/", "a code") is not None


# --------------------------------------------------------------------------- limits on POSTs
def _post(url: str, body: bytes) -> tuple[int, Message]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers


def test_an_oversized_invite_request_gets_413(issuer, pki, trust_ca):
    with FileServer(tls_cert=pki["cert"], tls_key=pki["key"]) as server:  # the backbone's default limit
        issuer.add_routes(server)
        assert _post(server.url + "invite/redeem", b" " * (64 * 1024 + 1))[0] == 413
        assert _post(server.url + "invite/redeem", b"{}")[0] == 404  # within the limit: the issuer says "no code"
    with FileServer(max_post=100) as server:
        issuer.add_routes(server)
        assert _post(server.url + "invite/renew", b" " * 101)[0] == 413


def test_a_client_still_sending_an_oversized_body_reads_its_413(issuer):
    # the server answers before the body is in: unless it reads the body, its close resets the
    # connection under the client, which then reads no answer (8 of 200 such posts without the read)
    with FileServer(max_post=100, rate_burst=1000, rate_per_s=1000.0) as server:
        issuer.add_routes(server)
        assert [_post(server.url + "invite/renew", b" " * 800_000)[0] for _ in range(100)] == [413] * 100


def test_too_many_invite_requests_get_429_until_the_window_passes(issuer):
    with FileServer(rate_burst=3, rate_per_s=4.0) as server:
        issuer.add_routes(server)
        url = server.url + "invite/renew"
        assert [_post(url, b"{}")[0] for _ in range(3)] == [400, 400, 400]  # answered by the issuer
        status, headers = _post(url, b"{}")
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert server.count("/invite/renew", "POST") == 4
        time.sleep(0.3)  # one token back after 0.25 s
        assert _post(url, b"{}")[0] == 400
        assert _post(url, b"{}")[0] == 429
        assert urllib.request.urlopen(server.url + "invite/info", timeout=10).status == 200  # reads are not limited
