"""Averaging round time with and without invite tokens, in one run on one machine.

Two swarms of ``--peers`` raw hivemind averagers (``--size`` floats each) on loopback, side by side
in this process: an open one (plain DHT, no gate) and an invite-only one (every DHT message carries
and checks a token, ``engine/gate.py``; matchmaking, all-reduce parts and state downloads check the
peers' tokens, hivemind_ext.invite_gate). Their rounds alternate (open, gated, open, ...), so load
on the machine hits both alike. Prints the median and mean round time of each.

    PYTHONPATH=. python bench/invite_overhead.py --rounds 10
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import hivemind
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P, PeerID

from dedloc_core import invites
from dedloc_core.engine import gate, hivemind_ext, metrics


def swarm(n: int, size: int, prefix: str, issuer=None, run_id: str = "") -> list:
    home = tempfile.mkdtemp()
    dhts = []
    for i in range(n):
        path = f"{home}/id{i}.key"
        P2P.generate_identity(path)
        extra, token = {}, None
        if issuer is not None:
            peer = PeerID.from_identity(open(path, "rb").read()).to_base58()
            now = time.time()
            token = invites.issue(issuer, invites.Claims(run_id, peer, now, now + 3600, "bench"))
            extra["authorizer"] = gate.InviteAuthorizer(metrics.load_identity_key(path), gate.TokenHolder(token))
        initial = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
        dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=path,
                                 initial_peers=initial, **extra))
        if token:
            gate.publish(dhts[-1], token, subkey=str(dhts[-1].peer_id))
    averagers = [hivemind.averaging.DecentralizedAverager([torch.randn(size)], dht=d, prefix=prefix,
                                                          target_group_size=n, min_matchmaking_time=2.0,
                                                          request_timeout=1.0, start=True) for d in dhts]
    return [dhts, averagers]


def one_round(averagers) -> float | None:
    began = time.perf_counter()
    futures = [a.step(wait=False, timeout=30, allow_retries=False) for a in averagers]
    try:
        sizes = [len(f.result()) for f in futures]
    except Exception:  # a failed round is not timed
        return None
    return time.perf_counter() - began if min(sizes) == len(averagers) else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--size", type=int, default=1_000_000, help="floats per peer")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    hivemind_ext.install()
    open_swarm = swarm(args.peers, args.size, "open")  # built before the gate is on: its averagers never check
    issuer = Ed25519PrivateKey.generate()
    gate.configure("bench-run", invites.public_key_text(issuer))
    gated_swarm = swarm(args.peers, args.size, "gated", issuer, "bench-run")
    times: dict[str, list[float]] = {"open": [], "gated": []}
    failed = {"open": 0, "gated": 0}
    for _ in range(args.rounds):
        for name, (_, averagers) in (("open", open_swarm), ("gated", gated_swarm)):
            took = one_round(averagers)
            if took is None:
                failed[name] += 1
            else:
                times[name].append(took)
    for name, values in times.items():
        if values:
            print(f"{name:>5}: median {statistics.median(values):.3f} s, mean {statistics.mean(values):.3f} s over "
                  f"{len(values)} rounds ({failed[name]} failed) of {args.peers} peers x {args.size} floats")
        else:
            print(f"{name:>5}: every round failed")
    for _, averagers in (open_swarm, gated_swarm):
        for a in averagers:
            a.shutdown()
    for dhts, _ in (open_swarm, gated_swarm):
        for d in dhts:
            d.shutdown()


if __name__ == "__main__":
    main()
