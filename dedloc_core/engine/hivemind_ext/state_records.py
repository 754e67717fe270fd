"""State records never lapse, and are stored only when they change or are due.

Upstream: ``hivemind/averaging/averager.py``,
``DecentralizedAverager._declare_for_download_periodically`` (replaced whole).

Without it: an averager stores its "I can share my state" record with a lifetime of
``declare_state_period`` and renews it only when it expires, through a DHT store that takes a
while (seconds, when the routing table still holds peers that left). Meanwhile the record is
gone: a newcomer that looks then finds no peer to load the state from and starts from scratch
(a DiLoCo newcomer whose only source is the backbone starts at round 0). The loop also stores
the record again each time its event wakes it, and hivemind's all-reduce sets that event after
every averaged tensor: a gradient round of the network lab's tiny-lm stores it about 20 times in
0.1 s (2.5 stores a second per volunteer, each a DHT search and a store to every node).

Fix: the record is renewed halfway through its lifetime (a peer that left still drops out within
one period), and stored only when what it says changes (sharing allowed, the priority) or when
it is due for renewal.

Kind: bug fix (belongs upstream; docs/hivemind/state_records.patch)

Shown: ``tests/test_hivemind_ext.py`` (renewal before expiry; no stores during rounds).
"""

from __future__ import annotations

import asyncio

REPLACES = ["hivemind.averaging.averager.DecentralizedAverager._declare_for_download_periodically"]


def install() -> None:
    from hivemind.averaging import averager
    from hivemind.utils import get_dht_time

    async def _declare_for_download_periodically(self):
        download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        declared: tuple | None = None  # (allowed, priority) in the record last stored
        renew_at = float("inf")
        while True:
            allowed = self.allow_state_sharing
            wanted = (allowed, self.state_sharing_priority if allowed else None)
            # a changed declaration, or a record at half its life; a switch-off is stored once (None)
            if (allowed or (declared is not None and declared[0])) and (wanted != declared
                                                                        or get_dht_time() >= renew_at - 0.01):
                expiration_time = get_dht_time() + self.declare_state_period
                asyncio.create_task(asyncio.wait_for(
                    self.dht.store(download_key, subkey=self.peer_id.to_bytes(), value=wanted[1],
                                   expiration_time=expiration_time, return_future=True),
                    timeout=expiration_time - get_dht_time()))
                declared = wanted
                renew_at = expiration_time - self.declare_state_period / 2 if allowed else float("inf")
            self._state_updated.clear()
            wait = min(renew_at, get_dht_time() + self.declare_state_period) - get_dht_time()
            try:
                await asyncio.wait_for(self._state_updated.wait(), timeout=max(0.0, wait))
            except TimeoutError:
                pass

    averager.DecentralizedAverager._declare_for_download_periodically = _declare_for_download_periodically
