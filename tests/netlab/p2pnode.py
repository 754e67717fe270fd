"""A bare hivemind P2P daemon for relay tests: ``serve IP PORT RELAY(0|1)`` prints its multiaddr and
waits; ``reserve RELAY_MADDR SECONDS`` joins through RELAY_MADDR as a NATed peer and prints
``circuit`` if it got a ``/p2p-circuit`` address through it within SECONDS, else ``none``."""

from __future__ import annotations

import asyncio
import sys

from dedloc_core import hivemind_patches


async def serve(ip: str, port: str, relay: str) -> None:
    from hivemind.p2p import P2P

    hivemind_patches.set_p2pd_options(relayService=relay == "1")
    p2p = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/{port}"])
    print([str(m) for m in await p2p.get_visible_maddrs()][0], flush=True)
    await asyncio.sleep(3600)


async def reserve(relay: str, seconds: str) -> None:
    from hivemind.p2p import P2P

    hivemind_patches.set_p2pd_options(relayDiscovery=False)
    p2p = await P2P.create(initial_peers=[relay], host_maddrs=["/ip4/0.0.0.0/tcp/0"], use_relay=True,
                           use_auto_relay=True, trusted_relays=[relay], force_reachability="private")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + float(seconds)
    relay_id = relay.rsplit("/p2p/", 1)[1]
    while loop.time() < deadline:
        if any("p2p-circuit" in str(m) and relay_id in str(m) for m in await p2p.get_visible_maddrs(latest=True)):
            print("circuit", flush=True)
            break
        await asyncio.sleep(0.5)
    else:
        print("none", flush=True)
    await p2p.shutdown()


if __name__ == "__main__":
    hivemind_patches.install()
    command, *rest = sys.argv[1:]
    asyncio.run({"serve": serve, "reserve": reserve}[command](*rest))
