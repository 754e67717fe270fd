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
  expires). A peer not (yet) known is looked up at once, for its own request: in the DHT, and if the
  search misses it (a newcomer's token may not have reached the nodes it asked), in the asking
  peer's own DHT node, which holds it from the moment it published. At most one lookup a second
  per peer id (a request within that second waits for the rest of it) and ``READS_PER_S`` in all;
  an averager forgets the read times it inherits when hivemind forks it. A throttle shared by all peers would refuse a
  member whose request comes within a second of a read for another peer: right after joining, and
  when its cached token expires and the renewed one has to be read.
- revocation: the backbone's keeper publishes the organizer's signed revocation list under
  ``{run_id}_revoked`` (``publish_revocations``: the peers revoked within the last token lifetime,
  refreshed every ``REVOKED_PUBLISH_S`` and on change). ``RevocationWatcher``, a thread of the main
  process started by the first ``publish``, reads it every ``REVOKED_READ_S`` and puts the newest
  list signed by the issuer into shared memory (``configure`` makes it, before hivemind forks), where
  ``admits`` and ``InviteAuthorizer`` in every process read it: a listed peer is refused from then on,
  valid token or not. A list whose signature fails is ignored with a warning. Without it a revoked
  worker that ignores the refusal of its renewal goes on until its token expires (the default
  lifetime is half an hour).

``TokenHolder`` keeps this peer's current token in shared memory, so the DHT and the averagers see
each renewal, whether threads or forked processes; ``publish`` stores it in the DHT for the other
peers and returns once it is stored, so a peer's token is readable before its averagers ask anyone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import os
import threading
import time
from collections import deque

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import get_dht_time
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPublicKey

from dedloc_core import invites

logger = logging.getLogger(__name__)

REFETCH_S = 1.0  # at most one registry read a second for each peer not (yet) known
READS_PER_S = 10  # and at most this many registry reads a second in all (a flood of unknown peer ids)
PUBLISH_WAIT_S = 10.0  # how long ``publish`` waits for the DHT to store a token
REVOKED_READ_S = 15.0  # every peer reads the revocation list this often
REVOKED_PUBLISH_S = 30.0  # the keeper stores it again this often (and at once when it changes)
REVOKED_TTL_S = 120.0  # a stored list lives this long in the DHT; peers keep the last one they read
_MAX_TOKEN = 4096
_MAX_REVOKED = 256 * 1024  # bytes of peer ids in shared memory: about 5,000 revoked peers

_run_id: str | None = None
_public_key = None
_known: dict[str, float] = {}  # peer id -> expiry of its valid token (per process)
_fetched: dict[str, float] = {}  # peer id -> monotonic time of the last registry read for it (per process)
_reads: deque[float] = deque()  # monotonic times of the registry reads in the last second (per process)
_revoked: _RevokedBoard | None = None
_watchers: dict[int, RevocationWatcher] = {}  # id(dht) -> its watcher (main process)


def _forget_reads() -> None:
    """In a forked child (an averager): the parent's read times say nothing of the child's reads, and
    inherited they would throttle the child's first read of a peer the parent missed."""
    _fetched.clear()
    _reads.clear()


os.register_at_fork(after_in_child=_forget_reads)


def configure(run_id: str, invite_key: str) -> None:
    """Turn the checks on for ``run_id`` with the issuer key from the catalog (base64 Ed25519)."""
    global _run_id, _public_key, _revoked
    _stop_watchers()
    _public_key = invites.load_public_key(invite_key)
    _run_id = run_id
    _known.clear()
    _fetched.clear()
    _revoked = _RevokedBoard()  # shared with the DHT and averagers that hivemind forks after this


def disable() -> None:
    global _run_id, _public_key, _revoked
    _stop_watchers()
    _run_id, _public_key, _revoked = None, None, None
    _known.clear()


def active() -> bool:
    return _run_id is not None


def registry_key(run_id: str) -> str:
    return f"{run_id}_invites"


def revoked_key(run_id: str) -> str:
    return f"{run_id}_revoked"


def is_revoked(peer_id: str) -> bool:
    """Whether the organizer's revocation list (as last read by this peer) names ``peer_id``."""
    return _revoked is not None and peer_id in _revoked.peers()


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


async def _may_read_for(peer_id: str) -> bool:
    """Whether an unknown ``peer_id`` gets a registry read: not within ``REFETCH_S`` of its last one
    (it waits for the rest of that second: a member's requests come in bursts, and refusing the
    burst's later ones would refuse a member whose token the next read finds), and not over
    ``READS_PER_S`` reads in the last second."""
    wait = REFETCH_S - (time.monotonic() - _fetched.get(peer_id, float("-inf")))
    if wait > 0:
        await asyncio.sleep(wait)
        if _known.get(peer_id, 0.0) > time.time():  # a read meanwhile found it
            return False
    now = time.monotonic()
    while _reads and now - _reads[0] >= 1.0:
        _reads.popleft()
    if len(_reads) >= READS_PER_S:
        return False
    if len(_fetched) > 10_000:
        _fetched.clear()
    _fetched[peer_id] = now
    _reads.append(now)
    return True


async def admits(dht, peer) -> bool:
    """Whether ``peer`` (a PeerID or its base58) may take part: always when the gate is off."""
    if not active():
        return True
    peer_id = peer if isinstance(peer, str) else peer.to_base58()
    if is_revoked(peer_id):
        logger.info("Refused peer %s: the organizer revoked it", peer_id)
        return False
    if _known.get(peer_id, 0.0) > time.time():
        return True
    if await _may_read_for(peer_id):
        try:
            found = await dht.get(registry_key(_run_id), latest=True, return_future=True)
        except Exception as exc:  # a failed read admits no one new
            logger.debug("Reading the invite registry failed: %s", exc)
            found = None
        if found is not None and isinstance(found.value, dict):
            for entry in found.value.values():
                if isinstance(entry.value, str) and len(entry.value) <= _MAX_TOKEN:
                    learn(entry.value)
        if _known.get(peer_id, 0.0) <= time.time():
            # a newcomer's token may not have reached the nodes this search asked; its own node
            # holds it from the moment it published: ask that node (its DHT has the same peer id)
            try:
                for token in await dht.run_coroutine(functools.partial(_tokens_at, _run_id, peer_id),
                                                     return_future=True):
                    learn(token)
            except Exception as exc:
                logger.debug("Asking %s for its invite token failed: %s", peer_id, exc)
    admitted = _known.get(peer_id, 0.0) > time.time()
    if not admitted:
        logger.info("Refused peer %s: no valid invite token for run %s", peer_id, _run_id)
    return admitted


async def _tokens_at(run_id: str, peer_id: str, _dht, node) -> list[str]:
    """The registry's tokens in the local storage of ``peer_id``'s DHT node (run in the DHT)."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.p2p import PeerID

    key_id = DHTID.generate(source=registry_key(run_id))
    found = await node.protocol.call_find(PeerID.from_base58(peer_id), [key_id])
    value = (found or {}).get(key_id, (None, None))[0]
    if value is None or not isinstance(value.value, DictionaryDHTValue):
        return []
    tokens = []
    for _subkey, entry in value.value.items():
        try:
            token = node.protocol.serializer.loads(entry.value)
        except Exception:  # not ours to parse: skip it
            continue
        if isinstance(token, str) and len(token) <= _MAX_TOKEN:
            tokens.append(token)
    return tokens


def publish(dht, token: str, subkey) -> None:
    """Store this peer's token in the registry (under ``subkey``: the peer's ``[owner:...]`` key
    when the DHT has an RSASignatureValidator, so no other peer can overwrite it)."""
    claims = valid(token)
    if claims is None:
        raise invites.InviteError("token_invalid", "This peer's token is not valid for this swarm.")
    learn(token)
    stored = dht.store(registry_key(_run_id), subkey=subkey, value=token,
                       expiration_time=get_dht_time() + claims.remaining(), return_future=True)
    _watch(dht)
    try:  # stored before this peer asks anyone to admit it (a state download, matchmaking)
        if not stored.result(timeout=PUBLISH_WAIT_S):
            logger.warning("No DHT peer took this peer's invite token; peers may refuse it for a while")
    except Exception as exc:  # the other peers find the token later, when the DHT takes it
        logger.warning("Publishing this peer's invite token failed: %s", exc)


def publish_revocations(dht, private_key, peers, subkey) -> None:
    """The keeper's side: store the revocation list naming ``peers``, signed with the issuer's
    ``private_key`` (under ``subkey``: the keeper's ``[owner:...]`` key, so no member can overwrite
    it with an older list), and refuse them here at once."""
    text = invites.sign_revocations(private_key, _run_id, peers)
    if _revoked is not None:
        _revoked.put(invites.read_revocations(text, _public_key, _run_id))
    dht.store(revoked_key(_run_id), subkey=subkey, value=text, expiration_time=get_dht_time() + REVOKED_TTL_S,
              return_future=True)


def refresh_revocations(dht, timeout: float = 10.0) -> invites.Revocations | None:
    """Read the revocation list from the DHT and keep the newest one the issuer signed in shared
    memory (lists signed by anyone else are ignored, with a warning); that list, or None."""
    if not active():
        return None
    key = revoked_key(_run_id)
    found = dht.get(key, latest=True, return_future=True).result(timeout=timeout)
    newest = None
    if found is not None and isinstance(found.value, dict):
        for entry in found.value.values():
            if not isinstance(entry.value, str) or len(entry.value) > _MAX_REVOKED:
                continue
            try:
                revocations = invites.read_revocations(entry.value, _public_key, _run_id)
            except invites.InviteError as exc:
                logger.warning("Ignored a revocation list under %s: %s", key, exc.message)
                continue
            if newest is None or revocations.issued > newest.issued:
                newest = revocations
    if newest is not None and _revoked is not None and _revoked.put(newest):
        logger.info("Revocation list of %s: %d revoked peer(s)", time.strftime("%H:%M:%S",
                    time.localtime(newest.issued)), len(newest.peers))
    return newest


class RevocationWatcher:
    """Reads the revocation list every ``REVOKED_READ_S`` (``refresh_revocations``) on a thread of the
    main process while ``dht`` runs, so this peer's DHT and averagers refuse revoked peers."""

    def __init__(self, dht, period: float = REVOKED_READ_S):
        self.dht, self.period = dht, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="revocation-list", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and self.dht.is_alive():
            try:
                refresh_revocations(self.dht)
            except Exception as exc:  # the DHT is down or slow: keep the last list, try again
                logger.debug("Reading the revocation list failed: %s", exc)
            self._stop.wait(self.period)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


def _watch(dht) -> None:
    """Watch the revocation list while ``dht`` runs (once per DHT: the first ``publish`` starts it)."""
    watcher = _watchers.get(id(dht))
    if watcher is None or not watcher.alive() or watcher.dht is not dht:
        _watchers[id(dht)] = RevocationWatcher(dht)


def _stop_watchers() -> None:
    for watcher in _watchers.values():
        watcher.stop()
    _watchers.clear()


class _RevokedBoard:
    """The newest revocation list this peer read, in shared memory: written by the main process,
    read by the DHT and the averagers (threads or forked processes), each parsing it once per change."""

    def __init__(self):
        self._buffer = mp.Array("c", _MAX_REVOKED)
        self._issued = mp.RawValue("d", 0.0)
        self._version = mp.RawValue("q", 0)
        self._seen, self._peers = 0, frozenset()  # this process's copy

    def put(self, revocations: invites.Revocations) -> bool:
        """Keep ``revocations`` if it is newer than the list held; whether it was."""
        data = "\n".join(sorted(revocations.peers)).encode()
        if len(data) >= _MAX_REVOKED:
            logger.error("The revocation list names %d peers, more than this peer can hold: the first %d "
                         "bytes are used", len(revocations.peers), _MAX_REVOKED)
            data = data[:data.rfind(b"\n", 0, _MAX_REVOKED - 1)]
        with self._buffer.get_lock():
            if revocations.issued <= self._issued.value:
                return False
            self._buffer.value = data
            self._issued.value = revocations.issued
            self._version.value += 1
        return True

    def peers(self) -> frozenset[str]:
        if self._version.value != self._seen:
            with self._buffer.get_lock():
                self._seen, raw = self._version.value, self._buffer.value
            self._peers = frozenset(raw.decode().split("\n")) - {""}
        return self._peers


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
        checked = self._checked.get(key)
        if checked is None:
            checked = self._check(access_token)
            if len(self._checked) > 10_000:
                self._checked.clear()
            self._checked[key] = checked
        expires, peer_id = checked
        if peer_id is not None and is_revoked(peer_id):  # not cached: the list may name it later
            logger.debug("DHT message from revoked peer %s refused", peer_id)
            return False
        if expires <= now and peer_id is not None:
            logger.debug("DHT message with an expired invite token of %s refused", peer_id)
        return expires > now

    @staticmethod
    def _check(access_token: AccessToken) -> tuple[float, str | None]:
        """(until when the token counts, its peer id). A bad token never counts: its signature, run
        and key binding cannot change, so it is cached as expired since 0."""
        claims = valid(access_token.username)
        ok = False
        if claims is not None:
            try:
                der = _der(RSAPublicKey.from_bytes(access_token.public_key))
                ok = invites.peer_id_of_der(der) == claims.peer_id
            except Exception:  # a malformed key is just invalid
                ok = False
        if not ok:
            logger.debug("DHT message with an invalid invite token refused")
            return 0.0, None
        return claims.expires, claims.peer_id


def _der(public_key: RSAPublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key._public_key.public_bytes(serialization.Encoding.DER,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
