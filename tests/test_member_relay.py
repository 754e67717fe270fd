"""The backbone's circuit relay in an invite-only experiment serves members only (issue 49, item 5;
``engine/member_relay.py``). A real ``dedloc backbone`` on loopback, and pairs of real p2pd daemons:
a target that cannot be dialled (no listen address: like a peer behind NAT, reachable only through
the relay), whose daemon reserves a slot on the backbone (autorelay, the backbone its static relay),
and a source that dials the target's ``/p2p-circuit`` address and opens a stream to it.

- Open experiment (p2pd's relay, the contrast): a stranger gets a reservation, and a second stranger
  reaches the first through it.
- Invite-only: a stranger's RESERVE gets PERMISSION_DENIED and a second stranger cannot reach the
  first; a stranger cannot open a circuit to a member either. Two members (tokens in the DHT) get
  reservations and one reaches the other through the circuit; once the organizer revokes a member,
  its next RESERVE is refused.
- In the network lab (a member behind a masquerading router): its daemon shows the ``/p2p-circuit``
  address that ``reachability.join`` waits for; a stranger's shows none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_experiment
from swarmpeer import start_backbone

from dedloc_core import invites as tokens
from dedloc_core.organizer import invites as org

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
OK, PERMISSION_DENIED = 100, 202

# A target and a source (argv: the backbone's maddr, then JSON: the gate's run id and issuer key or
# null, and each side's identity file and token, "" for a stranger). Members join the DHT and
# publish their tokens; strangers run bare daemons (the DHT of an invite-only swarm refuses them).
# It prints one JSON line: the source's own RESERVE status, whether it reached the target through
# the circuit, over which address, and the target's echo. Then, for each line on stdin: "reserve"
# prints the source's RESERVE status again; "connect PEER" the status of a CONNECT to PEER.
PAIR = r"""
import asyncio, json, sys
from dedloc_core.engine import hivemind_ext
hivemind_ext.install()
import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time
from dedloc_core.engine import gate, member_relay as mr, metrics

backbone, cfg = sys.argv[1], json.loads(sys.argv[2])
relay = PeerID.from_base58(backbone.rsplit("/p2p/", 1)[1])
ECHO = "/dedloc-test/echo/1.0.0"
if cfg["run"]:
    gate.configure(cfg["run"], cfg["key"])

async def start(identity, token, target):
    # the target, like a NATed volunteer: the backbone is its relay (reachability.py); on loopback it
    # listens nowhere, so only the relay reaches it
    where = dict(host_maddrs=["/ip4/0.0.0.0/tcp/0"]) if cfg.get("listen") else dict(no_listen=True)
    opts = dict(use_relay=True, use_auto_relay=True, trusted_relays=[backbone], force_reachability="private",
                **where) if target else {}
    hivemind_ext.set_p2pd_options(relayDiscovery=False)
    if not token:
        return None, await P2P.create(initial_peers=[backbone], identity_path=identity,
                                      check_if_identity_free=False, **opts)
    auth = gate.InviteAuthorizer(metrics.load_identity_key(identity), gate.TokenHolder(token))
    dht = hivemind.DHT(start=True, initial_peers=[backbone], identity_path=identity, authorizer=auth,
                       client_mode=target, check_if_identity_free=False, **opts)
    subkey = metrics.add_validators(dht, cfg["run"], metrics.load_identity_key(identity))
    gate.publish(dht, token, subkey=subkey)
    return dht, await dht.replicate_p2p()

async def hop(p2p, message):
    _, reader, writer = await p2p.call_binary_stream_handler(relay, mr.RELAY_HOP)
    try:
        await mr.write_message(writer, message)
        reply = await asyncio.wait_for(mr.read_message(reader), 20)
        return mr.int_field(reply, 5)
    except Exception:
        return None  # the stream closed without an answer
    finally:
        writer.close()

# /ip4/.../p2p/RELAY/p2p-circuit/p2p/TARGET as p2pd reads it: hivemind's codec writes /p2p/ as a CID,
# which p2pd cannot parse ("length greater than remaining number of bytes in buffer")
class Raw:
    def __init__(self, data):
        self.data = data
    def to_bytes(self):
        return self.data

def p2p(peer):
    multihash = peer.to_bytes()
    return b"\xa5\x03" + bytes([len(multihash)]) + multihash

async def echo(info, reader, writer):
    data = await reader.read(100)
    writer.write(data + b" from " + info.peer_id.to_base58().encode())
    await writer.drain()
    writer.close()

async def main():
    target_dht, target = await start(*cfg["target"], True)
    await target.add_binary_stream_handler(ECHO, echo)
    source_dht, source = await start(*cfg["source"], False)
    out = {"reserve": await hop(source, b""), "reached": False, "via": [], "echo": None}
    circuit = Raw(Multiaddr(backbone.rsplit("/p2p/", 1)[0]).to_bytes() + p2p(relay) + b"\xa2\x02" + p2p(target.peer_id))
    for _ in range(10):  # the target's reservation comes once its daemon and token are up
        try:
            await asyncio.wait_for(source._client.connect(target.peer_id, [circuit]), 10)
            out["reached"] = True
            break
        except Exception as exc:
            out["error"] = repr(exc)[:300]
            await asyncio.sleep(1.0)
    if out["reached"]:
        out["via"] = [str(a) for info in await source.list_peers() if info.peer_id == target.peer_id
                      for a in info.addrs]
        _, reader, writer = await source.call_binary_stream_handler(target.peer_id, ECHO)
        writer.write(b"hello")
        await writer.drain()
        out["echo"] = (await asyncio.wait_for(reader.read(1000), 10)).decode()
        writer.close()
    out["target"] = target.peer_id.to_base58()
    out["circuit_addrs"] = []  # what reachability.join waits for (with a public-looking relay address)
    for _ in range(40 if cfg.get("listen") else 0):
        out["circuit_addrs"] = [str(m) for m in await target.get_visible_maddrs(latest=True) if "p2p-circuit" in str(m)]
        if out["circuit_addrs"]:
            break
        await asyncio.sleep(0.5)
    print(json.dumps(out), flush=True)
    loop = asyncio.get_running_loop()
    while line := (await loop.run_in_executor(None, sys.stdin.readline)).split():
        if line[0] == "reserve":
            print(json.dumps(await hop(source, b"")), flush=True)
        else:
            peer = PeerID.from_base58(line[1]).to_bytes()
            connect = mr.encode((1, mr.CONNECT), (2, mr.encode((1, peer))))
            print(json.dumps(await hop(source, connect)), flush=True)
    for dht in (target_dht, source_dht):
        if dht is not None:
            dht.shutdown()

asyncio.run(main())
"""


class Pair:
    """The PAIR probe in a session of its own (its DHT processes and daemons go with it)."""

    def __init__(self, maddr: str, cfg: dict, launcher: list[str] | None = None):
        self.proc = subprocess.Popen([*(launcher or []), sys.executable, "-c", PAIR, maddr, json.dumps(cfg)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)

    def read(self):
        line = self.proc.stdout.readline()
        assert line, self.stop()
        return json.loads(line)

    def ask(self, command: str):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> str:
        """Stop it; the end of its stderr."""
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        return self.proc.stderr.read()[-3000:]


def identity(folder: Path, name: str) -> tuple[str, str]:
    """A fresh libp2p identity file: (path, peer id)."""
    from hivemind.p2p import P2P

    path = folder / f"{name}.key"
    P2P.generate_identity(str(path))
    return str(path), tokens.peer_id_of_der(tokens.public_der(tokens.load_identity(path.read_bytes())))


def strangers(tmp_path: Path) -> dict:
    return {"run": None, "key": None, "target": [identity(tmp_path, "t")[0], ""],
            "source": [identity(tmp_path, "s")[0], ""]}


def test_open_backbone_relays_for_strangers(tmp_path):
    """The contrast: p2pd's own relay (an open experiment) gives a stranger a reservation, and a
    second stranger reaches the first through it."""
    backbone, ready, _ = start_backbone(tiny_experiment(), tmp_path)
    pair = None
    try:
        pair = Pair(ready["maddrs"][0], strangers(tmp_path))
        out = pair.read()
        assert out["reserve"] == OK, json.dumps(out)
        assert out["reached"] and all("/p2p-circuit" in a for a in out["via"]), json.dumps(out)
        assert out["echo"].startswith("hello from "), json.dumps(out)
    finally:
        if pair is not None:
            pair.stop()
        backbone.stop(timeout=30)


class Closed:
    """An invite-only experiment whose issuer key lives in ``tmp_path / "backbone"`` (the backbone's
    run dir), and its members: ``member(name)`` is [identity file, token], as the backbone issues them."""

    def __init__(self, tmp_path: Path, monkeypatch):
        monkeypatch.setenv("DEDLOC_INVITE_PASSPHRASE", "pw")
        self.tmp_path, run_dir = tmp_path, tmp_path / "backbone"
        self.key = org.generate_key(run_dir, "pw")
        self.exp = tiny_experiment(id="closed-relay", run_id="closed_relay", needs_token=True, invite_key=self.key,
                                   invite_url="http://127.0.0.1:9/")
        self.issuer = org.Issuer(org.InviteStore(run_dir), org.load_key(run_dir, "pw"), "closed_relay", 600.0)
        self.code, self.invite_id = self.issuer.store.create(uses=10)

    def member(self, name: str) -> list[str]:
        path, peer = identity(self.tmp_path, name)
        self.issuer.store.redeem(self.code, peer)
        return [path, self.issuer.token_for(peer, self.invite_id)]

    def members(self, **extra) -> dict:
        return {"run": self.exp["run_id"], "key": self.key, "target": self.member("a"), "source": self.member("b"),
                **extra}

    def peer_of(self, token: str) -> str:
        return tokens.read(token, tokens.load_public_key(self.key)).peer_id


def test_closed_backbone_relays_for_members_only(tmp_path, monkeypatch):
    closed = Closed(tmp_path, monkeypatch)
    backbone, ready, _ = start_backbone(closed.exp, tmp_path)
    bb = ready["maddrs"][0]
    pairs = []
    try:
        # two strangers: no reservation, no circuit
        pairs.append(Pair(bb, strangers(tmp_path)))
        out = pairs[-1].read()
        assert out["reserve"] == PERMISSION_DENIED, json.dumps(out)
        assert not out["reached"] and out["echo"] is None, json.dumps(out)
        pairs[-1].stop()

        # two members: reservations, and one reaches the other through the circuit
        cfg = closed.members()
        members = Pair(bb, cfg)
        pairs.append(members)
        out = members.read()
        assert out["reserve"] == OK, json.dumps(out)
        assert out["reached"] and out["via"] and all("/p2p-circuit" in v for v in out["via"]), json.dumps(out)
        assert out["echo"] == "hello from " + closed.peer_of(cfg["source"][1]), json.dumps(out)

        # a stranger cannot open a circuit to a member
        stranger = Pair(bb, strangers(tmp_path))
        pairs.append(stranger)
        assert stranger.read()["reserve"] == PERMISSION_DENIED
        assert stranger.ask(f"connect {out['target']}") == PERMISSION_DENIED

        # the organizer revokes the source: the keeper's revocation list reaches the relay
        closed.issuer.store.revoke(closed.peer_of(cfg["source"][1]))
        deadline = time.monotonic() + 30
        while (status := members.ask("reserve")) == OK and time.monotonic() < deadline:
            time.sleep(1.0)
        assert status == PERMISSION_DENIED, status
        assert "Relaying for members only" in backbone.log.read_text(), backbone.log_tail()
    finally:
        for pair in pairs:
            pair.stop()
        backbone.stop(timeout=30)


def test_in_the_lab_a_nated_member_is_reachable_through_the_closed_backbone(netlab, tmp_path, monkeypatch):
    """Behind a masquerading router, with the backbone on a public-looking address: a member's daemon
    shows the ``/p2p-circuit`` address that ``reachability.join`` waits for (on loopback libp2p shows
    none), and is reached through it; a stranger's shows none."""
    from netlab.peers import Backbone

    closed = Closed(tmp_path, monkeypatch)
    backbone = Backbone(netlab, netlab.public("bb"), closed.exp, tmp_path)
    bb = backbone.wait_ready()["maddrs"][0]
    launcher = netlab.launcher(netlab.home("h1"))
    pairs = []
    try:
        pairs.append(Pair(bb, {**strangers(tmp_path), "listen": True}, launcher))
        out = pairs[-1].read()
        assert out["reserve"] == PERMISSION_DENIED and not out["reached"], json.dumps(out)
        assert out["circuit_addrs"] == [], json.dumps(out)
        pairs[-1].stop()

        pairs.append(Pair(bb, closed.members(listen=True), launcher))
        out = pairs[-1].read()
        relay_id = bb.rsplit("/p2p/", 1)[1]
        assert any(f"/p2p/{relay_id}/p2p-circuit" in a for a in out["circuit_addrs"]), json.dumps(out)
        assert out["reached"] and all("/p2p-circuit" in v for v in out["via"]), json.dumps(out)
        assert out["echo"].startswith("hello from "), json.dumps(out)
    finally:
        for pair in pairs:
            pair.stop()
