"""A store goes where the key's last store went.

Upstream: ``hivemind/dht/node.py``, ``DHTNode.find_nearest_nodes`` (wrapped; it relies on
``DHTNode.store_many`` being the only caller that passes ``found_callback``, and using only the
callback, not the result: gets call ``traverse_dht`` themselves).

Without it: ``store_many`` searches the DHT for a key's nearest nodes before every store (a find to
each node it visits), although a peer stores the same keys again and again (its progress every
few seconds, its group declarations, its metrics, its state record): in the network lab half of
all DHT requests (a volunteer sends 150 finds and 75 stores in 30 s).

Fix: a store keeps the nodes its search found for ``NEAREST_TTL`` seconds and the next store of
that key goes to them directly, unless one of them has left the routing table (a request to it
failed), then it searches again. Gets still search every time. The search asks for the id beside
the key's (``beside_key``): the same nearest nodes, but no node answers with the record, which a
store does not read and which grows with the swarm (a find of the progress key brought every
peer's signed entry, 445 kB at 500 volunteers in ``bench/backbone_crowd.py``).

Kind: our policy

Shown: ``tests/test_hivemind_ext.py`` (finds per store among four DHTs, with and without).
"""

from __future__ import annotations

import asyncio
import time

REPLACES = ["hivemind.dht.node.DHTNode.find_nearest_nodes", "hivemind.dht.node.DHTNode.store_many"]

NEAREST_TTL = 30.0  # how long a store reuses the nodes its last search for the key found


def install() -> None:
    from hivemind.dht.node import DHTNode

    find = DHTNode.find_nearest_nodes

    async def find_nearest_nodes(self, queries, k_nearest=None, beam_size=None, num_workers=None,
                                 node_to_peer_id=None, exclude_self=False, **kwargs):
        found = kwargs.get("found_callback")
        if found is None or node_to_peer_id is None:
            return await find(self, queries, k_nearest, beam_size, num_workers, node_to_peer_id, exclude_self,
                              **kwargs)
        known = self.__dict__.setdefault("_nearest_by_key", {})  # key id -> (valid until, {node id: peer id})
        now, table = time.monotonic(), self.protocol.routing_table
        if len(known) > 256:  # keys of past rounds
            for key_id in [k for k, (until, _) in known.items() if until <= now]:
                del known[key_id]
        cached, search = {}, []
        for key_id in queries:
            until, nearest = known.get(key_id, (0.0, {}))
            if until > now and nearest and all(node in table for node in nearest):
                cached[key_id] = nearest
            else:
                search.append(key_id)
        stores = []
        for key_id, nearest in cached.items():
            node_to_peer_id.update(nearest)
            stores.append(asyncio.create_task(found(key_id, list(nearest), {self.node_id})))
        result = {}
        if search:
            beside = {beside_key(key_id): key_id for key_id in search}

            async def remember(query, nearest_nodes, visited):
                key_id = beside[query]
                known[key_id] = (time.monotonic() + NEAREST_TTL, {n: node_to_peer_id[n] for n in nearest_nodes})
                await found(key_id, nearest_nodes, visited)

            kwargs["found_callback"] = remember
            found_nodes = await find(self, list(beside), k_nearest, beam_size, num_workers, node_to_peer_id,
                                     exclude_self, **kwargs)
            result = {beside[query]: nodes for query, nodes in found_nodes.items()}
        if stores:
            await asyncio.gather(*stores)
        return result

    DHTNode.find_nearest_nodes = find_nearest_nodes  # type: ignore[method-assign]


def beside_key(key_id):
    """The id next to ``key_id`` (its last bit flipped): its nearest nodes are the key's, unless two
    nodes' ids differ in their last bit alone (one chance in 2**159), and no node holds a record under it."""
    return type(key_id)(int(key_id) ^ 1)
