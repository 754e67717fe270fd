"""Signed per-peer metrics on real hivemind DHT nodes (real p2pd on 127.0.0.1): the leaderboard
takes only records signed by the peer they name."""

from __future__ import annotations

import time

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from dedloc_core.engine import metrics
from dedloc_core.stats.swarmview import SwarmView

RUN = "forgery_test"


class ForgingSigner(RSASignatureValidator):
    """An attacker's signer: signs every record with its own key, whoever's subkey it is under."""

    def sign_value(self, record):
        signature = self._private_key.sign(self._serialize_record(record))
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)


def record(peer_id: str, samples: int, name: str = "") -> dict:
    return metrics.PeerMetrics(peer_id=peer_id, step=3, loss=2.5, samples=samples, samples_per_second=10.0,
                               compute_seconds=samples / 10, time=time.time(), display_name=name).dict()


def node(tmp_path, name: str, initial_peers=None, signer=None) -> tuple[hivemind.DHT, bytes]:
    identity = str(tmp_path / f"{name}.key")
    key = metrics.load_identity_key(identity)
    dht = hivemind.DHT(initial_peers=initial_peers or [], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       identity_path=identity, start=True)
    if signer is None:
        public_key = metrics.add_validators(dht, RUN, key)
    else:
        dht.add_validators([metrics.validators(RUN)[0], signer(key)])
        public_key = signer(key).local_public_key
    return dht, public_key


@pytest.fixture
def swarm(tmp_path):
    nodes: list[hivemind.DHT] = []
    yield nodes
    for dht in nodes:
        dht.shutdown()


def test_forged_records_are_ignored(tmp_path, swarm):
    observer, _ = node(tmp_path, "observer")
    swarm.append(observer)
    peers = [str(m) for m in observer.get_visible_maddrs()]
    alice, alice_key = node(tmp_path, "alice", peers)
    mallory, mallory_key = node(tmp_path, "mallory", peers, signer=ForgingSigner)
    swarm += [alice, mallory]
    alice_id, mallory_id = str(alice.peer_id), str(mallory.peer_id)
    assert metrics.peer_id_of(alice_key) == alice_id  # the owner key names the peer

    metrics.publish(alice, RUN, alice_key, metrics.PeerMetrics.parse_obj(record(alice_id, 800, "Alice")))
    expiration = get_dht_time() + 600
    key = f"{RUN}_metrics"
    # 1. Mallory overwrites Alice's record: Alice's subkey, a newer value, signed with Mallory's key
    stored_over = mallory.store(key, subkey=alice_key, value=record(alice_id, 1, "Alice"),
                                expiration_time=expiration + 1)
    # 2. Mallory claims Alice's peer id under her own (validly signed) subkey
    stored_claim = mallory.store(key, subkey=mallory_key, value=record(alice_id, 10**9, "Alice"),
                                 expiration_time=expiration)
    assert not stored_over  # every node refused the forged signature
    assert stored_claim  # a valid signature: the DHT keeps it, the reader must drop it

    def board():
        found = metrics.fetch(observer, RUN)
        return {m.peer_id: m for m in found}

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen = board()
        if alice_id in seen:
            break
        time.sleep(0.5)
    assert set(seen) == {alice_id}
    assert (seen[alice_id].samples, seen[alice_id].display_name) == (800, "Alice")
    raw = observer.get(key, latest=True).value
    assert alice_key in raw and mallory_key in raw  # the claim was in the DHT, and fetch dropped it

    # Mallory's honest record of her own counts, under her own name
    mallory.store(key, subkey=mallory_key, value=record(mallory_id, 50, "Mallory"), expiration_time=expiration + 2)
    view = SwarmView(RUN)
    for m in metrics.fetch(observer, RUN):
        view.add_record(m.peer_id, m.display_name, m.samples, m.compute_seconds, m.time)
    names = [(c.name, c.samples) for c in view.summary().leaderboard]
    assert names == [("Alice", 800), ("Mallory", 50)]


def test_forged_signature_is_refused_even_for_a_new_subkey(tmp_path, swarm):
    """A record under a key nobody holds, signed by someone else, never enters the DHT."""
    observer, _ = node(tmp_path, "observer")
    swarm.append(observer)
    mallory, _ = node(tmp_path, "mallory", [str(m) for m in observer.get_visible_maddrs()], signer=ForgingSigner)
    swarm.append(mallory)
    victim = RSASignatureValidator(metrics.load_identity_key(str(tmp_path / "victim.key")))
    victim_id = metrics.peer_id_of(victim.local_public_key)
    ok = mallory.store(f"{RUN}_metrics", subkey=victim.local_public_key, value=record(victim_id, 5),
                       expiration_time=get_dht_time() + 600)
    assert not ok
    assert metrics.fetch(observer, RUN) == []
