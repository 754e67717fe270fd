"""Matchmaking polls the DHT at a pace.

Upstream: ``hivemind/averaging/matchmaking.py``, ``PotentialLeaders._update_queue_periodically``
(wrapped: it is given a key manager whose ``get_averagers`` waits; this relies on its loop
calling ``get_averagers`` and on ``min_matchmaking_time`` and ``search_end_time``).

Without it: while an averager looks for a group, the loop fetches the group key's averagers again
as soon as ``pop_next_leader`` finds no better leader than itself, which is at once: a DHT get (a
search over every node) back to back for the whole matchmaking time (a lone averager on
loopback: 750 a second; in a network lab run with failing rounds one averager averages 7 a
second, two thirds of the searches its DHT sends).

Fix: a fetch starts at most every ``LEADER_POLL_SECONDS`` (a quarter of the matchmaking time if
that is less); the first of a search at once, as before.

Kind: bug fix (belongs upstream; docs/hivemind/leader_poll.patch)

Shown: ``tests/test_hivemind_ext.py`` (fetches in 4 s of a lone search, with and without).
"""

from __future__ import annotations

import asyncio
from typing import Any

REPLACES = ["hivemind.averaging.matchmaking.PotentialLeaders._update_queue_periodically"]

LEADER_POLL_SECONDS = 0.5  # the shortest time between two fetches of a group's averagers


class _PacedKeys:
    """A ``GroupKeyManager`` whose ``get_averagers`` waits until the pause since its last call is over."""

    def __init__(self, leaders: Any, keys: Any) -> None:
        self._leaders, self._keys, self._last = leaders, keys, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._keys, name)

    async def get_averagers(self, *args: Any, **kwargs: Any) -> Any:
        from hivemind.utils import get_dht_time

        if self._last is not None:
            pause = min(LEADER_POLL_SECONDS, self._leaders.min_matchmaking_time / 4)
            wait = min(self._last + pause, self._leaders.search_end_time) - get_dht_time()
            if wait > 0:
                await asyncio.sleep(wait)
        self._last = get_dht_time()
        return await self._keys.get_averagers(*args, **kwargs)


def install() -> None:
    from hivemind.averaging.matchmaking import PotentialLeaders

    update = PotentialLeaders._update_queue_periodically

    async def _update_queue_periodically(self, key_manager) -> None:
        await update(self, _PacedKeys(self, key_manager))

    PotentialLeaders._update_queue_periodically = _update_queue_periodically  # type: ignore[method-assign]
