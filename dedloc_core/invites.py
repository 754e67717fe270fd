"""Invite tokens, shared by the organizer (who issues them) and every peer (who checks them).

A token is ``dl1.<payload>.<signature>`` (base64url, no padding): the payload is JSON
``{"run": run id, "peer": libp2p peer id, "iat": issued, "exp": expires, "inv": invite id}`` and the
signature is the issuer's Ed25519 signature of ``b"dedloc-invite-token/1\\n" + payload``. The issuer's
public key reaches volunteers in the signed catalog (``Experiment.invite_key``, base64 of the raw 32
bytes), so a token proves "the organizer let this peer id into this run until ``exp``".

A peer proves it holds its libp2p identity (an RSA key) by signing ``proof_message(...)`` with it;
``peer_id_of_der`` gives the peer id of an RSA public key as libp2p does (``PeerID.from_identity``).

A revocation list is ``rl1.<payload>.<signature>``: the payload is JSON ``{"run": run id, "iat": issued,
"peers": [peer ids]}`` (the members revoked within the last token lifetime, whose tokens may still be
valid), signed by the same issuer key with the domain ``b"dedloc-revoked/1\\n"``. The backbone
publishes it in the DHT; every peer refuses the peers it names (``engine/gate.py``).

``InviteError`` codes: invite_missing, invite_unknown, invite_expired, invite_revoked, invite_used_up,
invite_unreachable, invite_unconfigured, token_invalid. ``cryptography`` is imported inside the
functions, so this module stays light.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import time
from dataclasses import dataclass

from .errors import DedlocError

PREFIX = "dl1"
_DOMAIN = b"dedloc-invite-token/1\n"
PROOF_WINDOW = 300.0  # seconds a signed redeem/renew request stays acceptable (clock skew)

_TITLES = {
    "invite_missing": ("Invite code needed", "This experiment is invite-only: enter the invite code the "
                       "organizer gave you (Join asks for it)."),
    "invite_unknown": ("Invite code not recognised", "Check the code for typos, or ask the organizer for a new one."),
    "invite_expired": ("Invite code expired", "Ask the organizer for a new invite code."),
    "invite_revoked": ("Invite revoked", "The organizer withdrew this invite; ask them if you "
                       "think this is a mistake."),
    "invite_used_up": ("Invite code already used", "Each code admits a set number of computers; ask the organizer "
                       "for a new one."),
    "invite_unreachable": ("Organizer's server unreachable", "Check the internet connection; the app tries again."),
    "invite_unconfigured": ("Invite-only experiment misconfigured", "Tell the experiment's organizer: the catalog "
                            "entry lacks its invite key or server."),
    "token_invalid": ("Access token rejected", "The app asks the organizer's server for a new one."),
}
CODES = tuple(_TITLES)


class InviteError(DedlocError):
    """An invite or token problem; ``code`` is one of ``CODES``, title and hint follow from it."""

    def __init__(self, code: str, message: str):
        title, hint = _TITLES.get(code, ("Invite problem", ""))
        super().__init__(message, title=title, code=code, hint=hint)


@dataclass(frozen=True)
class Claims:
    run_id: str
    peer_id: str
    issued: float
    expires: float
    invite: str  # the invite's id (not its code)

    def remaining(self, now: float | None = None) -> float:
        return self.expires - (time.time() if now is None else now)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def load_public_key(text: str):
    """The Ed25519 public key of a catalog's ``invite_key`` (base64 of 32 raw bytes)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, binascii.Error) as exc:
        raise InviteError("invite_unconfigured", f"The experiment's invite key is not an Ed25519 key: {exc}") from None


def public_key_text(private_key) -> str:
    """base64 of the raw public key of an Ed25519 private key (the catalog's ``invite_key``)."""
    from cryptography.hazmat.primitives import serialization

    raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def issue(private_key, claims: Claims) -> str:
    payload = json.dumps({"run": claims.run_id, "peer": claims.peer_id, "iat": round(claims.issued, 3),
                          "exp": round(claims.expires, 3), "inv": claims.invite},
                         separators=(",", ":"), sort_keys=True).encode()
    return ".".join([PREFIX, _b64(payload), _b64(private_key.sign(_DOMAIN + payload))])


def read(token: str, public_key) -> Claims:
    """The claims of a token signed by ``public_key``, expired or not; InviteError(token_invalid) if forged."""
    from cryptography.exceptions import InvalidSignature

    try:
        prefix, payload_text, sig_text = token.split(".")
        if prefix != PREFIX:
            raise ValueError("not a dedloc token")
        payload, signature = _unb64(payload_text), _unb64(sig_text)
        public_key.verify(signature, _DOMAIN + payload)
        data = json.loads(payload)
        return Claims(str(data["run"]), str(data["peer"]), float(data["iat"]), float(data["exp"]), str(data["inv"]))
    except (InvalidSignature, ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        raise InviteError("token_invalid", "The access token is not one the organizer signed.") from None


def verify(token: str, public_key, run_id: str, peer_id: str | None = None, now: float | None = None) -> Claims:
    """The claims of a valid token: signed by ``public_key``, for ``run_id`` and ``peer_id``, not expired."""
    claims = read(token, public_key)
    if claims.run_id != run_id:
        raise InviteError("token_invalid", f"The token is for run {claims.run_id!r}, not {run_id!r}.")
    if peer_id is not None and claims.peer_id != peer_id:
        raise InviteError("token_invalid", "The token was issued to another peer.")
    if claims.remaining(now) <= 0:
        raise InviteError("token_invalid", "The token has expired.")
    return claims


def is_valid(token: str, public_key, run_id: str, peer_id: str | None = None, now: float | None = None) -> bool:
    try:
        verify(token, public_key, run_id, peer_id, now)
        return True
    except InviteError:
        return False


# --------------------------------------------------------------------------- revocation list
_REVOKED_PREFIX = "rl1"
_REVOKED_DOMAIN = b"dedloc-revoked/1\n"


@dataclass(frozen=True)
class Revocations:
    """A verified revocation list: the peers of ``run_id`` to refuse, as of ``issued``."""

    run_id: str
    issued: float
    peers: frozenset[str]


def sign_revocations(private_key, run_id: str, peers, issued: float | None = None) -> str:
    """The signed revocation list naming ``peers`` (peer ids) for ``run_id``."""
    issued = time.time() if issued is None else issued
    payload = json.dumps({"run": run_id, "iat": round(issued, 3), "peers": sorted(set(peers))},
                         separators=(",", ":"), sort_keys=True).encode()
    return ".".join([_REVOKED_PREFIX, _b64(payload), _b64(private_key.sign(_REVOKED_DOMAIN + payload))])


def read_revocations(text: str, public_key, run_id: str) -> Revocations:
    """A revocation list signed by ``public_key`` for ``run_id``; InviteError(token_invalid) otherwise."""
    from cryptography.exceptions import InvalidSignature

    try:
        prefix, payload_text, sig_text = text.split(".")
        if prefix != _REVOKED_PREFIX:
            raise ValueError("not a revocation list")
        payload = _unb64(payload_text)
        public_key.verify(_unb64(sig_text), _REVOKED_DOMAIN + payload)
        data = json.loads(payload)
        peers = data["peers"]
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            raise ValueError("peers is not a list of peer ids")
        revocations = Revocations(str(data["run"]), float(data["iat"]), frozenset(peers))
    except (InvalidSignature, ValueError, KeyError, TypeError, AttributeError, binascii.Error):
        raise InviteError("token_invalid", "The revocation list is not one the organizer signed.") from None
    if revocations.run_id != run_id:
        raise InviteError("token_invalid", f"The revocation list is for run {revocations.run_id!r}, not {run_id!r}.")
    return revocations


# ---------------------------------------------------------------------------------- identities
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _base58(data: bytes) -> str:
    number, out = int.from_bytes(data, "big"), ""
    while number:
        number, rest = divmod(number, 58)
        out = _B58[rest] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def peer_id_of_der(der: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in DER SubjectPublicKeyInfo form."""
    proto = b"\x08\x00\x12" + _varint(len(der)) + der  # crypto.pb.PublicKey{key_type: RSA, data}
    return _base58(b"\x12\x20" + hashlib.sha256(proto).digest())  # multihash sha2-256


def load_identity(data: bytes):
    """The RSA private key of a libp2p identity file as hivemind writes it (crypto.pb.PrivateKey);
    ValueError if it is not one."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    pos, key_type, der = 0, 0, None
    try:
        while pos < len(data):
            tag = data[pos]
            pos += 1
            if tag == 0x08:
                key_type = data[pos]
                pos += 1
            elif tag == 0x12:
                length, shift = 0, 0
                while True:
                    byte = data[pos]
                    pos += 1
                    length |= (byte & 0x7F) << shift
                    shift += 7
                    if not byte & 0x80:
                        break
                der, pos = data[pos:pos + length], pos + length
            else:
                raise ValueError("not a libp2p identity file")
    except IndexError:
        raise ValueError("the identity file is cut short") from None
    if key_type != 0 or der is None:
        raise ValueError("the identity holds no RSA key")
    try:
        return serialization.load_der_private_key(der, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"the identity's key does not load: {exc}") from None


def public_der(private_key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return private_key.public_key().public_bytes(serialization.Encoding.DER,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo)


def proof_message(action: str, run_id: str, peer_id: str, when: float, extra: str = "") -> bytes:
    return f"dedloc-invite-{action}/1\n{run_id}\n{peer_id}\n{when:.3f}\n{extra}".encode()


def sign_proof(identity_key, message: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    return identity_key.sign(message, padding.PKCS1v15(), hashes.SHA256())


def check_proof(der: bytes, message: bytes, signature: bytes) -> str | None:
    """The peer id that signed ``message``, or None if the signature does not hold."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    try:
        key = serialization.load_der_public_key(der)
        if not isinstance(key, rsa.RSAPublicKey):
            return None
        key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
    except (InvalidSignature, ValueError, TypeError):
        return None
    return peer_id_of_der(der)


# ------------------------------------------------------------------------------------ client
def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is only reachable from this machine."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def plain_http_refusal(url: str, what: str) -> str | None:
    """Why ``what`` (an invite code, an access token) must not be sent to ``url``, or None if it may:
    only ``https://``, or ``http://`` to this machine, keeps it from whoever is on the way."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "https" or (scheme == "http" and is_loopback(parts.hostname or "")):
        return None
    return (f"Refusing to send {what} to {url}: it is not https://, so anyone on the way could read it. "
            "The organizer's server must use HTTPS.")


def _check_sendable(url: str, what: str) -> None:
    refusal = plain_http_refusal(url, what)
    if refusal is not None:
        raise InviteError("invite_unconfigured", refusal)


def _known_code(code: str, status: int) -> str:
    """The error code to raise for the server's ``code`` with HTTP ``status``: a code this client does
    not know is a busy or broken server (429, 5xx: try again) or else a refusal of the token."""
    if code in _TITLES:
        return code
    return "invite_unreachable" if status == 429 or status >= 500 else "token_invalid"


def _post(base_url: str, action: str, request: dict, timeout: float) -> str:
    import urllib.error
    import urllib.request

    url = base_url.rstrip("/") + "/invite/" + action
    _check_sendable(url, "an invite code" if action == "redeem" else "a signed request")
    req = urllib.request.Request(url, data=json.dumps(request).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:  # http(s) from the catalog
            body = response.read(1 << 16)
    except urllib.error.HTTPError as exc:
        body = exc.read(1 << 16)
        try:
            answer = json.loads(body)
            code, message = str(answer["error"]), str(answer.get("message", ""))
        except (ValueError, KeyError, TypeError):
            raise InviteError("invite_unreachable", f"The organizer's server answered {exc.code} at {url}.") from None
        raise InviteError(_known_code(code, exc.code), message or code) from None
    except (OSError, ValueError) as exc:
        raise InviteError("invite_unreachable", f"Cannot reach the organizer's server at {url}: {exc}") from None
    try:
        return str(json.loads(body)["token"])
    except (ValueError, KeyError, TypeError):
        raise InviteError("invite_unreachable", f"The organizer's server at {url} sent no token.") from None


def _signed(action: str, identity_key, run_id: str, extra: str = "") -> dict:
    der = public_der(identity_key)
    peer_id = peer_id_of_der(der)
    when = time.time()
    signature = sign_proof(identity_key, proof_message(action, run_id, peer_id, when, extra))
    return {"peer_id": peer_id, "public_key": der.hex(), "time": when, "signature": signature.hex()}


def redeem(base_url: str, code: str, identity_key, run_id: str, timeout: float = 15.0) -> str:
    """Redeem an invite code at the backbone (``base_url``) for a token bound to ``identity_key``'s peer id."""
    normalized = "".join(ch for ch in code.upper() if ch.isalnum())
    request = _signed("redeem", identity_key, run_id, normalized)
    request["code"] = code
    return _post(base_url, "redeem", request, timeout)


def renew(base_url: str, identity_key, run_id: str, timeout: float = 15.0) -> str:
    """A fresh token for a peer that redeemed a code before (InviteError if revoked)."""
    return _post(base_url, "renew", _signed("renew", identity_key, run_id), timeout)


def report(base_url: str, identity_key, run_id: str, peer_id: str, reason: str, timeout: float = 15.0) -> int:
    """Tell the backbone that this member banned ``peer_id`` for ``reason`` (``POST /invite/report``,
    signed like a renewal); the number of members who reported that peer, or InviteError."""
    import urllib.error
    import urllib.request

    reason = reason[:200]
    request = {**_signed("report", identity_key, run_id, f"{peer_id}\n{reason}"), "reported": peer_id,
               "reason": reason}
    url = base_url.rstrip("/") + "/invite/report"
    _check_sendable(url, "a signed report")
    req = urllib.request.Request(url, data=json.dumps(request).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:  # http(s) from the catalog
            return int(json.loads(response.read(1 << 16))["reporters"])
    except urllib.error.HTTPError as exc:
        try:
            answer = json.loads(exc.read(1 << 16))
            code, message = str(answer["error"]), str(answer.get("message", ""))
        except (ValueError, KeyError, TypeError):
            code, message = "invite_unreachable", f"The organizer's server answered {exc.code} at {url}."
        raise InviteError(_known_code(code, exc.code), message or code) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InviteError("invite_unreachable", f"Cannot report to the organizer's server at {url}: {exc}") from None


def fetch_info(base_url: str, timeout: float = 15.0) -> dict:
    """The backbone's ``/invite/info``: run id, invite key, token lifetime."""
    import urllib.request

    url = base_url.rstrip("/") + "/invite/info"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            info = json.loads(response.read(1 << 16))
        return {"run_id": str(info["run_id"]), "invite_key": str(info["invite_key"]),
                "lifetime": float(info["lifetime"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InviteError("invite_unreachable", f"No invite service at {url}: {exc}") from None
