"""Volunteers read the swarm's progress from the backbone's digest (``progress_digest``): the same
global progress a DHT get gives, in a fraction of the bytes, and the DHT when the backbone does not
answer. Real DHTs on loopback: a backbone serving the digest, volunteers as DHT clients."""

from __future__ import annotations

import pytest
from probes import probe_json

PROBE = """
import json, time
import hivemind
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from dedloc_core.engine import hivemind_ext, progress_digest, swarm
from tests.probes import FAST_TRACKER, until

hivemind_ext.install()
run = "digest_probe"

async def record_bytes(_dht, node):  # what a DHT get of the record carries: the stored entries
    from hivemind.dht.routing import DHTID
    found = node.protocol.storage.get(DHTID.generate(source=run + "_progress"))
    return len(found.value.packb())

class AnswerBytes:
    def __init__(self, me, peer):
        self.me, self.peer = me, peer
    async def __call__(self, _dht, node):
        from google.protobuf.wrappers_pb2 import StringValue
        from hivemind.p2p import PeerID
        request = StringValue(value=json.dumps({"me": progress_digest.subkey_hash(self.me)}))
        answer = await node.p2p.call_protobuf_handler(PeerID.from_base58(self.peer), progress_digest.DIGEST,
                                                      request, StringValue)
        return len(answer.value)

async def silent(_dht, _node):
    return sorted(progress_digest._silent_until)

backbone = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
backbone.add_validators([RSASignatureValidator()])  # as the backbone's own tracker adds it
progress_digest.serve(backbone, run)
peers = [str(m) for m in backbone.get_visible_maddrs()]
dhts = [hivemind.DHT(start=True, client_mode=True, initial_peers=peers) for _ in range(4)]
ids = progress_digest.backbone_ids(peers)
stranger = [str(dhts[2].peer_id)]  # a peer that serves no digest: its asker falls back to the DHT
kw = dict(prefix=run, target_batch_size=10**6, start=True, **FAST_TRACKER)
digest = [swarm.SwarmTracker(dht=dhts[i], private_key=RSAPrivateKey(), progress_from=ids, **kw) for i in (0, 1)]
plain = ProgressTracker(dht=dhts[2], private_key=RSAPrivateKey(), **kw)
fallback = swarm.SwarmTracker(dht=dhts[3], private_key=RSAPrivateKey(), progress_from=stranger, **kw)
trackers = digest + [plain, fallback]

try:
    for step in range(1, 4):
        for i, tracker in enumerate(trackers):
            tracker.report_local_progress(local_epoch=2, samples_accumulated=10 * (i + 1) * step)
        time.sleep(0.3)
    total = 10 * (1 + 2 + 3 + 4) * 3
    seen = lambda t: (t.global_progress.num_peers, t.global_progress.samples_accumulated)
    until(lambda: all(seen(t) == (4, total) for t in trackers), "not every tracker saw all four peers")
    mine = digest[0]._last_metadata[digest[0]._local_public_key].value
    out = dict(
        views=[[t.global_progress.epoch, t.global_progress.num_peers, t.global_progress.num_clients,
                t.global_progress.samples_accumulated] for t in trackers],
        mine=[mine["epoch"], mine["samples_accumulated"]],
        placeholders=sorted(str(k) for k in digest[0]._last_metadata if k != digest[0]._local_public_key),
        silent=[dhts[i].run_coroutine(silent) for i in (0, 3)],
        record=backbone.run_coroutine(record_bytes),
        answer=dhts[0].run_coroutine(AnswerBytes(digest[0]._local_public_key, ids[0])),
    )
    print(json.dumps(out))
finally:
    for t in trackers:
        t.shutdown()
    for d in dhts + [backbone]:
        d.shutdown()
"""


@pytest.mark.slow  # starts hivemind peers: not in make test-fast
def test_volunteers_read_the_backbones_digest_and_see_what_the_dht_says():
    out = probe_json(PROBE)
    # every tracker, digest, plain DHT or fallback, sees the same step, peers and samples
    assert out["views"] == [[2, 4, 4, 300]] * 4
    assert out["mine"] == [2, 30]  # our own entry comes back under our subkey, the others as placeholders
    assert out["placeholders"] == ["#0", "#1", "#2"]
    # the digest readers never gave up on the backbone; the fallback reader gave up on the stranger
    assert out["silent"][0] == [] and len(out["silent"][1]) == 1
    # four entries: the digest is several times smaller than the record a DHT get carries
    assert out["answer"] * 4 < out["record"], out


CLOSED = """
import json, tempfile, time
import hivemind
from hivemind.p2p import P2P, PeerID
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from dedloc_core import invites
from dedloc_core.engine import gate, progress_digest

RUN = "digest-closed"
issuer = Ed25519PrivateKey.generate()
gate.configure(RUN, invites.public_key_text(issuer))  # before the backbone's DHT forks

class Ask:
    def __init__(self, peer, token):
        self.peer, self.token = peer, token
    async def __call__(self, _dht, node):
        from google.protobuf.wrappers_pb2 import StringValue
        request = StringValue(value=json.dumps({"me": "0" * 16, "token": self.token}))
        answer = await node.p2p.call_protobuf_handler(PeerID.from_base58(self.peer), progress_digest.DIGEST,
                                                      request, StringValue)
        return sorted(json.loads(answer.value))

backbone = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
progress_digest.serve(backbone, RUN)
path = tempfile.mkdtemp() + "/id.key"
P2P.generate_identity(path)
member = hivemind.DHT(start=True, client_mode=True, identity_path=path,
                      initial_peers=[str(m) for m in backbone.get_visible_maddrs()])
member_id = PeerID.from_identity(open(path, "rb").read()).to_base58()

def token(peer):
    now = time.time()
    return invites.issue(issuer, invites.Claims(RUN, peer, now, now + 300, "inv-test"))

ask = lambda tok: member.run_coroutine(Ask(str(backbone.peer_id), tok))
print(json.dumps({"own": ask(token(member_id)), "none": ask(None), "anothers": ask(token(str(backbone.peer_id)))}))
member.shutdown(); backbone.shutdown()
"""


@pytest.mark.slow
def test_a_closed_experiments_backbone_gives_its_digest_to_token_holders_only():
    out = probe_json(CLOSED)
    assert out["own"] == ["expiration", "groups", "mine"]
    assert out["none"] == ["error"] and out["anothers"] == ["error"]


def test_the_digest_gives_hiveminds_parser_the_figures_of_the_whole_record(monkeypatch):
    """Peers at three steps, some clients, reports of different ages: hivemind's tracker parses the
    digest's record into the figures it reads from the whole record (ETA and fetch time included)."""
    import random
    import types

    from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
    from hivemind.utils import ValueWithExpiration, get_dht_time

    from dedloc_core.engine import progress_digest

    rng, now = random.Random(5), get_dht_time()
    entries = {f"[owner:key{i}]".encode(): dict(
        peer_id=b"x", epoch=rng.choice([7, 8, 8, 8, 9]), samples_accumulated=rng.randrange(0, 5000),
        samples_per_second=rng.uniform(0.0, 300.0), time=now - rng.uniform(0.0, 6.0),
        client_mode=rng.random() < 0.3) for i in range(40)}
    entries[b"[owner:gone]"] = None  # a withdrawn peer's record
    me = b"[owner:key3]"
    groups, rows = progress_digest.summed(entries)
    answer = progress_digest.answer_for(groups, now + 60, rows, progress_digest.subkey_hash(me))
    rebuilt = progress_digest.metadata(answer, me)

    local = LocalTrainingProgress(peer_id=b"x", epoch=8, samples_accumulated=100, samples_per_second=50.0,
                                  time=now, client_mode=False)
    tracker = types.SimpleNamespace(  # the attributes hivemind's parser reads
        local_progress=local, performance_ema=types.SimpleNamespace(eps=1e-9, samples_per_second=50.0),
        target_batch_size=100_000, expected_drift_peers=3, expected_drift_rate=0.2, min_refresh_period=0.5,
        max_refresh_period=30.0, default_refresh_period=3.0, status_loglevel=0, prefix="p")
    whole = {k: ValueWithExpiration(v, now + 60) for k, v in entries.items()}
    # the parser reads the clock itself: both parses must see the same instant
    monkeypatch.setattr("hivemind.optim.progress_tracker.get_dht_time", lambda: now)
    expected = ProgressTracker._parse_swarm_progress_data(tracker, whole)
    got = ProgressTracker._parse_swarm_progress_data(tracker, rebuilt.value)
    assert (got.epoch, got.num_peers, got.num_clients, got.samples_accumulated) == \
        (expected.epoch, expected.num_peers, expected.num_clients, expected.samples_accumulated) == \
        (9, 40, expected.num_clients, expected.samples_accumulated)
    assert abs(got.eta_next_epoch - expected.eta_next_epoch) < 1e-3
    assert abs(got.next_fetch_time - expected.next_fetch_time) < 1e-3
    assert rebuilt.value[me].value["samples_accumulated"] == entries[me]["samples_accumulated"]
    assert len(answer["groups"]) <= 6  # three steps, two modes: the answer does not grow with the swarm


def test_a_digest_that_counts_absurdly_many_peers_is_refused():
    from dedloc_core.engine import progress_digest

    answer = {"expiration": 1.0, "mine": None, "groups": [[3, False, 10**9, 0, 0.0, 0.0, 0.0]]}
    with pytest.raises(ValueError, match="peers"):
        progress_digest.metadata(answer, b"me")  # (Read then falls back to the DHT)
