"""Fuzzing what the invites issue added (issue 16): access tokens, invite keys, identity files and
proofs, and the backbone's ``/invite/*`` endpoints over real HTTP with a real issuer (its SQLite
store, its key). Any input gives a result or an InviteError / ValueError with a message; an
endpoint always answers a status with a JSON error, never a 500, a dropped connection or a hang."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_fuzz_http import normal_get, serving

from dedloc_core import invites
from dedloc_core.invites import InviteError
from dedloc_core.organizer import invites as org

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
RUN = "fuzz-run"
ISSUER = Ed25519PrivateKey.generate()
PUBLIC = invites.load_public_key(invites.public_key_text(ISSUER))
NOW = time.time()
TOKEN = invites.issue(ISSUER, invites.Claims(RUN, "peerA", NOW, NOW + 3600, "inv-1"))
IDENTITY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
PEER = invites.peer_id_of_der(invites.public_der(IDENTITY))


def mutate(text: str, data) -> str:
    """``text`` with a few characters changed, cut or inserted."""
    chars = list(text)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(chars)))
        kind = data.draw(st.sampled_from(["set", "cut", "insert"]))
        if kind == "set" and at < len(chars):
            chars[at] = data.draw(st.characters())
        elif kind == "cut":
            del chars[at:at + data.draw(st.integers(1, 20))]
        else:
            chars.insert(at, data.draw(st.sampled_from([".", "=", "A", "\x00", "é", "_", "-"])))
    return "".join(chars)


@FUZZ
@given(st.data())
def test_a_changed_token_is_refused_with_a_clear_error(data):
    token = mutate(TOKEN, data) if data.draw(st.booleans()) else data.draw(st.text(max_size=300))
    try:
        claims = invites.verify(token, PUBLIC, RUN, "peerA", now=NOW)
    except InviteError as exc:
        assert exc.code == "token_invalid" and exc.message
        return
    # only a change that decodes to the same signed bytes (base64 padding bits) can pass
    assert claims == invites.read(TOKEN, PUBLIC)


@FUZZ
@given(st.text(max_size=100) | st.binary(max_size=48).map(lambda b: __import__("base64").b64encode(b).decode()))
@example("")
@example("=" * 44)
def test_a_bad_invite_key_is_an_invite_error(text):
    try:
        invites.load_public_key(text)
    except InviteError as exc:
        assert exc.code == "invite_unconfigured" and "invite key" in exc.message


@FUZZ
@given(st.binary(max_size=400))
@example(b"\x08\x00\x12")  # a length that never comes
@example(b"\x08")
@example(b"\x08\x00\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")
def test_a_broken_identity_file_is_a_value_error(data):
    with pytest.raises(ValueError):
        invites.load_identity(data)


@FUZZ
@given(st.binary(max_size=600), st.binary(max_size=300), st.binary(max_size=300))
def test_a_proof_from_garbage_names_nobody(der, message, signature):
    assert invites.check_proof(der, message, signature) is None


# ------------------------------------------------------------------------------ the endpoints
@pytest.fixture(scope="module")
def gated(tmp_path_factory) -> Iterator:
    tmp = tmp_path_factory.mktemp("gated")
    store = org.InviteStore(tmp / "store")
    issuer = org.Issuer(store, ISSUER, RUN, lifetime=600)
    with serving(tmp / "backbone", issuer) as served:
        served.store = store
        yield served


def post(node, path: str, body: bytes) -> tuple[int, bytes]:
    node.errors.clear()
    conn = http.client.HTTPConnection(*node.address, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                 max_size=4), max_leaves=12)
FIELDS = st.sampled_from(["code", "peer_id", "public_key", "time", "signature"])


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=300))
    if kind == 1:
        return json.dumps(draw(JSON)).encode()
    request = invites._signed(draw(st.sampled_from(["redeem", "renew"])), IDENTITY, RUN, "")
    request["code"] = "ABCD-EFGH-IJKL-MNOP"
    for field in draw(st.lists(FIELDS, max_size=3)):  # a signed request with fields changed or dropped
        if draw(st.booleans()):
            request.pop(field, None)
        else:
            request[field] = draw(JSON | st.sampled_from([float("nan"), float("inf"), "nan", "1e999", -1e300]))
    return json.dumps(request).encode()


@FUZZ
@given(st.sampled_from(["/invite/redeem", "/invite/renew"]), bodies())
@example("/invite/redeem", b"[" * 16_000)  # was a RecursionError: a 500 and a traceback in the log
@example("/invite/redeem", b'{"code": "X", "time": NaN}')
@example("/invite/renew", b"\xff\xfe")
def test_every_invite_request_gets_a_json_answer(gated, path, body):
    status, answer = post(gated, path, body)
    assert not gated.errors, gated.errors[0]
    assert status in (400, 403, 404, 409, 410, 413), (body[:200], status, answer[:200])
    error = json.loads(answer)
    assert error["error"] in invites.CODES and error["message"], error


def test_a_replayed_proof_with_a_nan_time_is_too_old(gated):
    """A proof signed for ``time: NaN`` would never age: one captured request could be replayed forever."""
    code, _ = gated.store.create(uses=5)
    der = invites.public_der(IDENTITY)
    signature = invites.sign_proof(IDENTITY, invites.proof_message("renew", RUN, PEER, float("nan")))
    request = {"peer_id": PEER, "public_key": der.hex(), "time": float("nan"), "signature": signature.hex()}
    status, answer = post(gated, "/invite/renew", json.dumps(request).encode())
    assert status == 400 and "too old" in json.loads(answer)["message"], answer
    request["code"] = code
    signature = invites.sign_proof(IDENTITY, invites.proof_message("redeem", RUN, PEER, float("nan"),
                                                                   org.normalize(code)))
    request["signature"] = signature.hex()
    status, answer = post(gated, "/invite/redeem", json.dumps(request).encode())
    assert status == 400 and "too old" in json.loads(answer)["message"], answer
    normal_get(gated)
    # the same proof with the current time still works (the check is not simply closed)
    request = invites._signed("redeem", IDENTITY, RUN, org.normalize(code))
    request["code"] = code
    status, answer = post(gated, "/invite/redeem", json.dumps(request).encode())
    assert status == 200 and invites.verify(json.loads(answer)["token"], PUBLIC, RUN, PEER)
