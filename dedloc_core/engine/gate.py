"""Invite-only swarms: who holds a valid token, checked by every peer (see ``dedloc_core.invites``).

For an experiment with ``needs_token``, ``configure(run_id, invite_key)`` in the main process, before
creating the DHT and the averagers (the processes hivemind forks inherit it), turns the checks on:

- the DHT: ``InviteAuthorizer`` (hivemind's ``TokenAuthorizerBase``, passed as ``authorizer=``) puts
  this peer's token in every DHT request and response, signed with its libp2p identity key, and
  refuses those whose token is not the issuer's, for this run, bound to the key that signed them,
  and unexpired. So a peer without a token cannot read or write the experiment's DHT records
  (progress, metrics, group keys), and its answers are ignored.
- matchmaking and all-reduce (``hivemind_ext.invite_gate``): ``admits(dht, peer)`` tells whether a
  peer has published a valid token under ``{run_id}_invites`` in the DHT (cached until the token
  expires; an unknown peer costs at most one DHT read a second).

``TokenHolder`` keeps this peer's current token in shared memory, so the DHT and the averagers see
each renewal, whether threads or forked processes; ``publish`` stores it in the DHT for the other peers.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import get_dht_time
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPublicKey

from dedloc_core import invites

logger = logging.getLogger(__name__)

REFETCH_S = 1.0  # at most one registry read a second for peers not (yet) known
_MAX_TOKEN = 4096

_run_id: str | None = None
_public_key = None
_known: dict[str, float] = {}  # peer id -> expiry of its valid token (per process)
_last_fetch = 0.0


def configure(run_id: str, invite_key: str) -> None:
    """Turn the checks on for ``run_id`` with the issuer key from the catalog (base64 Ed25519)."""
    global _run_id, _public_key, _last_fetch
    _public_key = invites.load_public_key(invite_key)
    _run_id = run_id
    _known.clear()
    _last_fetch = 0.0


def disable() -> None:
    global _run_id, _public_key
    _run_id, _public_key = None, None
    _known.clear()


def active() -> bool:
    return _run_id is not None


def registry_key(run_id: str) -> str:
    return f"{run_id}_invites"


def valid(token: str, peer_id: str | None = None) -> invites.Claims | None:
    """The claims of a token valid for this swarm (and ``peer_id``), or None."""
    if not active():
        return None
    try:
        return invites.verify(token, _public_key, _run_id, peer_id)
    except invites.InviteError:
        return None


def learn(token: str) -> None:
    """Remember a valid token's peer (for ``admits``)."""
    claims = valid(token)
    if claims is not None:
        _known[claims.peer_id] = max(_known.get(claims.peer_id, 0.0), claims.expires)


async def admits(dht, peer) -> bool:
    """Whether ``peer`` (a PeerID or its base58) may take part: always when the gate is off."""
    global _last_fetch
    if not active():
        return True
    peer_id = peer if isinstance(peer, str) else peer.to_base58()
    if _known.get(peer_id, 0.0) > time.time():
        return True
    if time.monotonic() - _last_fetch >= REFETCH_S:
        _last_fetch = time.monotonic()
        try:
            found = await dht.get(registry_key(_run_id), latest=True, return_future=True)
        except Exception as exc:  # a failed read admits no one new
            logger.debug("Reading the invite registry failed: %s", exc)
            found = None
        if found is not None and isinstance(found.value, dict):
            for entry in found.value.values():
                if isinstance(entry.value, str) and len(entry.value) <= _MAX_TOKEN:
                    learn(entry.value)
    admitted = _known.get(peer_id, 0.0) > time.time()
    if not admitted:
        logger.info("Refused peer %s: no valid invite token for run %s", peer_id, _run_id)
    return admitted


def publish(dht, token: str, subkey) -> None:
    """Store this peer's token in the registry (under ``subkey``: the peer's ``[owner:...]`` key
    when the DHT has an RSASignatureValidator, so no other peer can overwrite it)."""
    claims = valid(token)
    if claims is None:
        raise invites.InviteError("token_invalid", "This peer's token is not valid for this swarm.")
    learn(token)
    dht.store(registry_key(_run_id), subkey=subkey, value=token,
              expiration_time=get_dht_time() + claims.remaining(), return_future=True)


class TokenHolder:
    """This peer's current token in shared memory (readable by the DHT and averagers, threads or forked processes)."""

    def __init__(self, token: str = ""):
        self._buffer = mp.Array("c", _MAX_TOKEN)
        self.set(token)

    def set(self, token: str) -> None:
        data = token.encode()
        if len(data) >= _MAX_TOKEN:
            raise ValueError("token too long")
        with self._buffer.get_lock():
            self._buffer.value = data

    def get(self) -> str:
        with self._buffer.get_lock():
            return self._buffer.value.decode()


class InviteAuthorizer(TokenAuthorizerBase):
    """hivemind's DHT authorizer for an invite-only swarm: a request or response counts only with a
    valid token bound to the peer id of the RSA key that signed it (the libp2p identity key)."""

    def __init__(self, identity_key, holder: TokenHolder):
        super().__init__(identity_key)
        self.holder = holder
        self._checked: dict[tuple[str, bytes], float] = {}

    async def get_token(self) -> AccessToken:
        return AccessToken(username=self.holder.get(), public_key=self.local_public_key.to_bytes())

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return access_token.username != self.holder.get()

    async def refresh_token_if_needed(self) -> None:
        # unlike hivemind's, no assert on our own token: a peer whose token lapsed just gets refused
        if self._local_access_token is None or self.does_token_need_refreshing(self._local_access_token):
            self._local_access_token = await self.get_token()

    def is_token_valid(self, access_token: AccessToken) -> bool:
        key = (access_token.username, bytes(access_token.public_key))
        now = time.time()
        expires = self._checked.get(key)
        if expires is not None:
            return expires > now
        claims = valid(access_token.username)
        ok = False
        if claims is not None:
            try:
                der = _der(RSAPublicKey.from_bytes(access_token.public_key))
                ok = invites.peer_id_of_der(der) == claims.peer_id
            except Exception:  # a malformed key is just invalid
                ok = False
        if len(self._checked) > 10_000:
            self._checked.clear()
        self._checked[key] = claims.expires if ok else now + 5.0  # a bad token stays bad for a while
        if not ok:
            logger.debug("DHT message with an invalid invite token refused")
        return ok and claims.expires > now


def _der(public_key: RSAPublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key._public_key.public_bytes(serialization.Encoding.DER,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
