"""The swarm's progress in a few bytes: the backbone answers volunteers' reads of it.

Each volunteer's tracker reads the progress key every 2-10 s, and a DHT get is answered with the
whole signed record: about 890 bytes per peer, mostly its RSA key and signature. The bytes the
backbone sends so grow with the square of the swarm: 445 kB per read at 500 volunteers, and its DHT
process and p2pd spent 0.54 cores on it (``bench/backbone_crowd.py``).

The backbone checked every entry's signature when it was stored. What hivemind's tracker computes
from the entries (the step, peers and clients, samples at the step, samples/s, the samples made
since each report) depends on sums over the peers of each step and mode only, so the backbone
answers ``DIGEST`` with those sums (a few numbers per step the swarm's peers are at) and the asker's
own entry, from one DHT get per ``CACHE_SECONDS``. The volunteer turns the answer back into a record
that gives hivemind's parser the same figures (``metadata``). A volunteer asks its initial peers
(the catalog's backbones: libp2p authenticates their peer ids). It falls back to the DHT get when
none answers (an older backbone, or none up) and asks again after ``RETRY`` seconds. In an
invite-only swarm the backbone answers token holders only, as its DHT does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time

from hivemind.utils import ValueWithExpiration

logger = logging.getLogger(__name__)

DIGEST = "dedloc.progress_digest"
CACHE_SECONDS = 0.1  # how stale an answer may be: a peer that steps publishes at once, and the others look
TIMEOUT = 2.0  # seconds a volunteer waits for a backbone's answer before its own DHT get
RETRY = 60.0  # seconds before a backbone that did not answer is asked again
MAX_PEERS = 100_000  # peers an answer may count: past it, it is broken and the DHT is read instead


def subkey_hash(subkey) -> str:
    raw = subkey if isinstance(subkey, bytes) else str(subkey).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


# ---- the backbone's side (in its DHT process) --------------------------------------------------

def serve(dht, run_id: str) -> None:
    """Answer ``DIGEST`` requests for ``run_id``'s progress on ``dht``'s p2p."""
    dht.run_coroutine(_Serve(run_id))


class _Serve:
    def __init__(self, run_id: str):
        self.key = f"{run_id}_progress"

    async def __call__(self, _dht, node) -> None:
        from google.protobuf.wrappers_pb2 import StringValue

        digest = _Digest(node, self.key)

        async def handler(request, context):
            from . import gate

            try:
                body = json.loads(request.value)
            except ValueError:
                body = None
            if not isinstance(body, dict):
                return StringValue(value=json.dumps({"error": "bad request"}))
            token = body.get("token")
            if gate.active() and (not isinstance(token, str)
                                  or gate.valid(token, context.remote_id.to_base58()) is None):
                return StringValue(value=json.dumps({"error": "no valid invite token"}))
            answer = answer_for(*await digest.read(), body.get("me"))
            return StringValue(value=json.dumps(answer, separators=(",", ":")))

        await node.p2p.add_protobuf_handler(DIGEST, handler, StringValue)


class _Digest:
    """The record's live entries, summed per (step, client mode), read at most every ``CACHE_SECONDS``
    (one read at a time): ``({(epoch, client): sums}, expiration, {subkey hash: row})``."""

    def __init__(self, node, key: str):
        self.node, self.key = node, key
        self.until = -float("inf")
        self.answer: tuple[dict, float | None, dict] = ({}, None, {})
        self.reading: asyncio.Task | None = None

    async def read(self) -> tuple[dict, float | None, dict]:
        if time.monotonic() < self.until:
            return self.answer
        if self.reading is None or self.reading.done():
            self.reading = asyncio.create_task(self._read())
        return await asyncio.shield(self.reading)

    async def _read(self):
        found = await asyncio.wait_for(self.node.get(self.key, latest=True), TIMEOUT)
        groups, rows, expiration = {}, {}, None
        if found is not None and isinstance(found.value, dict):
            expiration = found.expiration_time
            groups, rows = summed({subkey: entry.value for subkey, entry in found.value.items()})
        self.answer = (groups, expiration, rows)
        self.until = time.monotonic() + CACHE_SECONDS
        return self.answer


def _row(value) -> list | None:
    """An entry's epoch, samples, samples/s, time and client mode; None if it is no live progress record."""
    if not isinstance(value, dict):
        return None
    try:
        row = [int(value["epoch"]), int(value["samples_accumulated"]), float(value["samples_per_second"]),
               float(value["time"]), bool(value["client_mode"])]
    except (KeyError, TypeError, ValueError):
        return None
    return row


def summed(entries: dict) -> tuple[dict, dict]:
    """``({(epoch, client): sums}, {subkey hash: row})`` of a record's entries ({subkey: value})."""
    groups, rows = {}, {}
    for subkey, value in entries.items():
        row = _row(value)
        if row is not None:
            rows[subkey_hash(subkey)] = row
            groups[row[0], row[4]] = _plus(groups.get((row[0], row[4]), (0, 0, 0.0, 0.0, 0.0)), row)
    return groups, rows


def answer_for(groups: dict, expiration: float | None, rows: dict, me: str | None) -> dict:
    """The answer to the peer whose subkey hashes to ``me``: the others' sums and its own entry."""
    mine = rows.get(me)
    if mine is not None:
        groups = dict(groups)
        groups[mine[0], mine[4]] = _minus(groups[mine[0], mine[4]], mine)
    return {"expiration": expiration, "mine": mine,
            "groups": [[epoch, client, *sums] for (epoch, client), sums in groups.items() if sums[0]]}


# a group's sums: (peers, samples, samples/s, sum of time x samples/s, latest time)
def _plus(sums: tuple, row: list) -> tuple:
    n, samples, sps, weighted, latest = sums
    return n + 1, samples + row[1], sps + row[2], weighted + row[3] * row[2], max(latest, row[3])


def _minus(sums: tuple, row: list) -> tuple:
    n, samples, sps, weighted, latest = sums
    return n - 1, samples - row[1], max(0.0, sps - row[2]), weighted - row[3] * row[2], latest


# ---- the volunteer's side (in its DHT process) -------------------------------------------------

_silent_until: dict[str, float] = {}  # backbone peer id -> when to ask it again


class Read:
    """A picklable coroutine for ``DHT.run_coroutine``: the progress record, as a DHT get returns it
    (``ValueWithExpiration`` of {subkey: entry}), from a backbone's digest or the DHT."""

    def __init__(self, key: str, me, backbones: list[str], token: str | None = None):
        self.key, self.me = key, me
        self.backbones, self.token = backbones, token

    async def __call__(self, _dht, node):
        from google.protobuf.wrappers_pb2 import StringValue
        from hivemind.p2p import PeerID

        request = StringValue(value=json.dumps({"me": subkey_hash(self.me), "token": self.token}))
        for peer in self.backbones:
            if _silent_until.get(peer, 0.0) > time.monotonic():
                continue
            try:
                call = node.p2p.call_protobuf_handler(PeerID.from_base58(peer), DIGEST, request, StringValue)
                answer = json.loads((await asyncio.wait_for(call, TIMEOUT)).value)
                if "error" in answer:
                    raise ValueError(answer["error"])
                return metadata(answer, self.me)
            except Exception as exc:  # an older backbone without the handler, a timeout, a refusal
                _silent_until[peer] = time.monotonic() + RETRY
                logger.info("Progress digest from %s failed (%r): reading the DHT", peer, exc)
        return await node.get(self.key, latest=True)


def metadata(answer: dict, me) -> ValueWithExpiration | None:
    """The record a DHT get would return, as hivemind's tracker reads it, from a digest: ours under our
    own subkey; per group of k others, one entry with the group's samples and samples/s, reported at
    the time that extrapolates them as the k entries would (their samples/s-weighted mean), and k - 1
    entries with none (so that the peers are counted). The placeholders' subkeys are "#0", "#1"..."""
    if answer.get("expiration") is None:
        return None
    expiration = float(answer["expiration"])
    if sum(int(group[2]) for group in answer["groups"]) > MAX_PEERS:
        raise ValueError(f"a digest that counts over {MAX_PEERS} peers")
    records: dict = {}

    def add(key, epoch, samples, sps, when, client):
        record = dict(epoch=int(epoch), samples_accumulated=int(samples), samples_per_second=float(sps),
                      time=float(when), client_mode=bool(client), peer_id=b"")
        records[key] = ValueWithExpiration(record, expiration)

    for epoch, client, n, samples, sps, weighted, latest in answer["groups"]:
        add(f"#{len(records)}", epoch, samples, sps, weighted / sps if sps > 0 else latest, client)
        for _ in range(int(n) - 1):
            add(f"#{len(records)}", epoch, 0, 0.0, latest, client)
    if answer.get("mine") is not None:
        add(me, *answer["mine"])
    return ValueWithExpiration(records, expiration)


def backbone_ids(initial_peers: list[str]) -> list[str]:
    """The peer ids in the initial peers' multiaddrs."""
    from hivemind.utils.multiaddr import Multiaddr

    ids = []
    for maddr in initial_peers:
        try:
            peer = Multiaddr(maddr).value_for_protocol("p2p")
        except Exception:
            continue
        if peer and peer not in ids:
            ids.append(peer)
    return ids

