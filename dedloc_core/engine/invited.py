"""A volunteer's side of an invite-only experiment: get a token from the backbone and keep it fresh.

``obtain`` reads the invite code (or takes the one the app sent) and the last token from the keyring
(``dedloc_core.secrets``; one that fails is a keyring with nothing in it), keeps
that token if it still has over half its life, else renews it at the experiment's ``invite_url``
(a member), else redeems the code (a newcomer). ``Renewer`` renews it at half life on a thread,
hands it to the DHT and averagers (``gate.TokenHolder``), publishes it and stores it in the keyring;
a refusal (revoked) ends the session with the backbone's ``InviteError``.

``data_token`` is how the worker fetches an invite-only experiment's shards, which the backbone
serves to members only: the ``fetch-data`` thread obtains the token first (this module imports no
hivemind, and writes a new volunteer's identity itself), then downloads, all while torch and
hivemind import; the session's own ``obtain`` then finds the fresh token it holds.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dedloc_core import invites, secrets
from dedloc_core.invites import InviteError

if TYPE_CHECKING:  # gate imports hivemind; obtain runs before it is imported (data_token)
    from . import gate

logger = logging.getLogger(__name__)


def _fresh(claims: invites.Claims) -> bool:
    return claims.remaining() > (claims.expires - claims.issued) / 2


_held: dict[str, str] = {}  # experiment id -> this process's newest token (the keyring may be out of reach)


def obtain(exp, identity_path: str, code: str | None = None) -> tuple[str, object]:
    """A valid token for this peer and the identity's private key (cryptography RSA). ``code``: the
    invite code the app sent (a worker across a boundary cannot read the app's keyring); else the
    keyring's."""
    if not exp.invite_key or not exp.invite_url:
        raise InviteError("invite_unconfigured", f"The catalog entry of {exp.title!r} is invite-only but names "
                                                 "no invite key or invite server.")
    if not os.path.isfile(identity_path):
        _write_identity(identity_path)
    identity = invites.load_identity(Path(identity_path).read_bytes())
    peer_id = invites.peer_id_of_der(invites.public_der(identity))
    public_key = invites.load_public_key(exp.invite_key)
    stored = _held.get(exp.id) or _stored_token(exp.id)
    if stored:
        try:
            claims = invites.verify(stored, public_key, exp.run_id, peer_id)
            if _fresh(claims):
                return stored, identity
        except InviteError:
            pass
    token = None
    try:
        token = invites.renew(exp.invite_url, identity, exp.run_id)
    except InviteError as exc:
        if exc.code != "invite_unknown":  # revoked, unreachable: say so
            raise
    if token is None:
        code = code or secrets.get_invite(exp.id)
        if not code:
            raise InviteError("invite_missing", f"{exp.title} is invite-only and no invite code is stored for it.")
        token = invites.redeem(exp.invite_url, code, identity, exp.run_id)
    invites.verify(token, public_key, exp.run_id, peer_id)  # the server must give us what we asked for
    keep(exp.id, token)
    return token, identity


def _stored_token(experiment_id: str) -> str | None:
    """The keyring's token, or None where the keyring cannot be read (a worker in WSL or on a rig
    has none): the identity renews a token without it."""
    try:
        return secrets.get_token(experiment_id)
    except secrets.SecretError as exc:
        logger.warning("%s", exc.message)
        return None


def keep(experiment_id: str, token: str) -> None:
    """Hold ``token`` for this process and store it in the keyring; a keyring that fails only costs
    a renewal at the next start (the token in memory works until it expires)."""
    _held[experiment_id] = token
    try:
        secrets.set_token(experiment_id, token)
    except secrets.SecretError as exc:
        logger.warning("%s", exc.message)


def data_token(exp, identity_path: str, code: str | None = None) -> Callable[[], str] | None:
    """What gives the token the experiment's shards need: None for open data (an open experiment,
    or ``data.public``), else ``obtain``'s token (InviteError when it cannot be had)."""
    if not exp.needs_token or exp.data.public:
        return None
    return lambda: obtain(exp, identity_path, code)[0]


def _write_identity(path: str) -> None:
    """A new libp2p identity as hivemind's ``P2P.generate_identity`` writes it (crypto.pb.PrivateKey:
    type RSA, the 2048-bit key as PKCS#1 DER; read only by its owner), without importing hivemind."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    der = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())
    length, size = bytearray(), len(der)
    while True:
        byte, size = size & 0x7F, size >> 7
        length.append(byte | (0x80 if size else 0))
        if not size:
            break
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)  # a concurrent writer's file stays
    with os.fdopen(fd, "wb") as f:
        f.write(b"\x08\x00\x12" + bytes(length) + der)


class Renewer:
    """Renews this peer's token at half life (and retries every few seconds if the server is down)."""

    def __init__(self, exp, identity, holder: gate.TokenHolder, publish):
        self.exp, self.identity, self.holder, self.publish = exp, identity, holder, publish
        self.public_key = invites.load_public_key(exp.invite_key)
        self.failure: InviteError | None = None  # set when the backbone refuses: the session ends
        self.renewals = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="token-renewer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            claims = invites.read(self.holder.get(), self.public_key)
            half = (claims.expires - claims.issued) / 2
            if self._stop.wait(max(0.0, claims.remaining() - half)):
                return
            try:
                token = invites.renew(self.exp.invite_url, self.identity, self.exp.run_id)
                invites.verify(token, self.public_key, self.exp.run_id, claims.peer_id)
            except InviteError as exc:
                if exc.code in ("invite_unreachable",):
                    logger.warning("Token renewal failed, retrying: %s", exc.message)
                    self._stop.wait(min(5.0, max(0.5, claims.remaining() / 4)))
                    continue
                logger.error("Token renewal refused: %s", exc.message)
                self.failure = exc
                return
            self.holder.set(token)
            self.publish(token)
            self.renewals += 1
            keep(self.exp.id, token)
            logger.info("Access token renewed (valid %.0f s)", invites.read(token, self.public_key).remaining())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

