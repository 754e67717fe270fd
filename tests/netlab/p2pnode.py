"""Bare hivemind P2P daemons for relay tests (each command runs in one lab namespace):

- ``serve IP PORT MODE``: listen on IP:PORT and print our multiaddr; MODE ``volunteer`` (refuses
  to relay, our default) or ``backbone`` (relays for others, as stock p2pd does);
- ``reserve RELAY_MADDR SECONDS``: join as a NATed peer with RELAY_MADDR as our relay; print our
  ``/p2p-circuit`` address through it (or ``none``), then wait;
- ``dial MADDR``: connect to MADDR; print ``connected`` or ``failed``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

from dedloc_core.engine import hivemind_ext


async def serve(ip: str, port: str, mode: str) -> None:
    from hivemind.p2p import P2P

    hivemind_ext.set_relay_service(mode != "volunteer")
    p2p = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/{port}"], identity_path=_identity())
    _forget()
    print([str(m) for m in await p2p.get_visible_maddrs()][0], flush=True)
    await asyncio.sleep(3600)


async def reserve(relay: str, seconds: str) -> None:
    from hivemind.p2p import P2P

    hivemind_ext.set_p2pd_options(relayDiscovery=False)
    p2p = await P2P.create(initial_peers=[relay], host_maddrs=["/ip4/0.0.0.0/tcp/0"], use_relay=True,
                           use_auto_relay=True, trusted_relays=[relay], force_reachability="private",
                           identity_path=_identity())
    _forget()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + float(seconds)
    relay_id = relay.rsplit("/p2p/", 1)[1]
    found = "none"
    while loop.time() < deadline and found == "none":
        found = next((str(m) for m in await p2p.get_visible_maddrs(latest=True)
                      if "p2p-circuit" in str(m) and relay_id in str(m)), "none")
        await asyncio.sleep(0.5)
    print(found, flush=True)
    await asyncio.sleep(3600)


async def dial(maddr: str) -> None:
    """Bootstrap from MADDR (p2pd parses it: hivemind's multiaddr codec mangles circuit addresses)."""
    from hivemind.p2p import P2P

    target = maddr.rsplit("/p2p/", 1)[1]
    for attempt in range(3):  # a circuit just reserved can refuse the first dial (seen once in CI)
        try:
            p2p = await P2P.create(initial_peers=[maddr], host_maddrs=["/ip4/0.0.0.0/tcp/0"],
                                   identity_path=_identity())
            break
        except Exception as exc:  # p2pd refuses to start when the bootstrap fails
            _forget()
            print("failed", attempt + 1, exc, file=sys.stderr, flush=True)
            await asyncio.sleep(2.0)
    else:
        print("failed", flush=True)
        return
    _forget()
    for _ in range(30):
        if any(str(info.peer_id) == target for info in await p2p.list_peers()):
            print("connected", flush=True)
            break
        await asyncio.sleep(0.5)
    else:
        print("failed", flush=True)
    await p2p.shutdown()


def _identity() -> str:
    """A fresh RSA identity file (what our peers use; hivemind's multiaddr codec cannot encode the
    ed25519 peer ids p2pd makes by default inside a circuit address). Removed by ``_forget``."""
    folder = tempfile.mkdtemp(prefix="p2pnode-")
    _made.append(folder)
    return os.path.join(folder, "identity.key")


_made: list[str] = []


def _forget() -> None:
    """Remove the identity files once the daemon has read them."""
    import shutil

    while _made:
        shutil.rmtree(_made.pop(), ignore_errors=True)


if __name__ == "__main__":
    hivemind_ext.install()
    command, *rest = sys.argv[1:]
    asyncio.run({"serve": serve, "reserve": reserve, "dial": dial}[command](*rest))
