"""Invite-only averaging: the averagers of an invite-only experiment deal only with invited peers.

Upstream: ``hivemind/averaging/matchmaking.py``: ``Matchmaking.rpc_join_group``,
``_request_join_group`` and ``follower_assemble_group`` (wrapped);
``hivemind/averaging/averager.py``: ``DecentralizedAverager.rpc_aggregate_part`` and
``rpc_download_state`` (wrapped, keeping their names and annotations: hivemind builds its
handlers from them).

Without it: hivemind checks tokens only in the DHT (``TokenAuthorizerBase``, see ``engine/gate.py``);
its averagers answer anyone who knows the group key: an intruder joins groups, sends parts into
the average and downloads the model.

Fix: when ``gate.active()``, ``rpc_join_group`` refuses a follower without a valid token,
``_request_join_group`` does not ask a leader without one, ``follower_assemble_group`` leaves a
group that holds a peer without one, and ``rpc_aggregate_part`` and ``rpc_download_state`` refuse
parts from and state downloads by such a peer. The checks read the tokens peers publish in the
DHT (``gate.admits``). With the gate off (open experiments) nothing changes. Installed after
``robust_reduce``: both wrap ``_request_join_group``, this one outside.

Kind: our policy

Shown: ``tests/test_invite_swarm.py`` (slow: intruders running plain hivemind stay out of the
invited peers' groups; with the gate off the same intruders get in).
"""

from __future__ import annotations

import functools

REPLACES = [
    "hivemind.averaging.matchmaking.Matchmaking.rpc_join_group",
    "hivemind.averaging.matchmaking.Matchmaking._request_join_group",
    "hivemind.averaging.matchmaking.Matchmaking.follower_assemble_group",
    "hivemind.averaging.averager.DecentralizedAverager.rpc_aggregate_part",
    "hivemind.averaging.averager.DecentralizedAverager.rpc_download_state",
]


def install() -> None:
    from hivemind.averaging import averager, matchmaking
    from hivemind.p2p import P2PHandlerError
    from hivemind.proto import averaging_pb2

    from dedloc_core.engine import gate

    mm = matchmaking.Matchmaking
    join, request, assemble = mm.rpc_join_group, mm._request_join_group, mm.follower_assemble_group

    async def rpc_join_group(self, request_msg, context):
        if not await gate.admits(self.group_key_manager.dht, context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in join(self, request_msg, context):
            yield message

    async def _request_join_group(self, leader):
        if not await gate.admits(self.group_key_manager.dht, leader):
            return None
        return await request(self, leader)

    async def follower_assemble_group(self, leader, msg):
        for raw in msg.ordered_peer_ids:
            peer = matchmaking.PeerID(raw)
            if peer != self.peer_id and not await gate.admits(self.group_key_manager.dht, peer):
                raise P2PHandlerError(f"the group of {leader} holds {peer}, who has no valid invite token")
        return await assemble(self, leader, msg)

    mm.rpc_join_group = rpc_join_group
    mm._request_join_group = _request_join_group
    mm.follower_assemble_group = follower_assemble_group

    avg = averager.DecentralizedAverager
    aggregate, download = avg.rpc_aggregate_part, avg.rpc_download_state

    # hivemind builds its handlers from these functions' argument names and annotations: keep both
    @functools.wraps(aggregate)
    async def rpc_aggregate_part(self, stream, context):
        if not await gate.admits(self.dht, context.remote_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in aggregate(self, stream, context):
            yield message

    @functools.wraps(download)
    async def rpc_download_state(self, _request, _context):
        if not await gate.admits(self.dht, _context.remote_id):
            return
        async for message in download(self, _request, _context):
            yield message

    avg.rpc_aggregate_part = rpc_aggregate_part
    avg.rpc_download_state = rpc_download_state
