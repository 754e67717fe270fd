"""One write per daemon message.

Upstream: ``hivemind/p2p/p2p_daemon_bindings/utils.py``, ``write_pbmsg`` (replaced whole, also
where ``p2p_daemon_bindings/control.py`` imported it).

Without it: a message's length (a varint) is written one byte at a time, each byte its own
``write`` and ``drain`` (a send on p2pd's unix socket, a wake of its reader), then the body:
three sends for most requests and replies of a unary call.

Fix: the length and the body go in one write.

Kind: bug fix (belongs upstream; docs/hivemind/one_write.patch)

Shown: ``tests/test_hivemind_ext.py`` (sends per message, read back intact).
"""

from __future__ import annotations

import asyncio

REPLACES = ["hivemind.p2p.p2p_daemon_bindings.utils.write_pbmsg"]


def install() -> None:
    import varint  # hivemind's own dependency (multiaddr's varints)
    from hivemind.p2p.p2p_daemon_bindings import control, utils

    async def write_pbmsg(stream: asyncio.StreamWriter, pbmsg) -> None:
        body = pbmsg.SerializeToString()
        stream.write(varint.encode(len(body)) + body)
        await stream.drain()

    control.write_pbmsg = utils.write_pbmsg = write_pbmsg
