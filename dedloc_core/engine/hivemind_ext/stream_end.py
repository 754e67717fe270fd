"""A stream's answers all arrive: its handler closes only after the caller has read them.

Upstream: ``hivemind/p2p/p2p_daemon.py``: ``P2P._add_protobuf_stream_handler`` and
``P2P._iterate_protobuf_stream_handler`` (replaced whole).

Without it: a stream handler closes its socket to p2pd as soon as it has written its last answer.
p2pd then closes the libp2p stream (``doStreamPipe``), and go-yamux's ``Stream.Close`` closes the
read side first: p2pd's other copy loop wakes with ``ErrStreamReset`` and calls ``Reset``. When
that reset reaches the caller's side before the stream's FIN, go-yamux drops what the caller's
p2pd had not yet passed on, and the caller reads the cut as a clean end (hivemind takes
``IncompleteReadError`` for the end of the stream). In an all-reduce that is "peer X sent 6
parts, but we expected 8": a round lost, with nothing wrong on either side. Under load (two busy
cores, 16 streams at once of four 300 kB answers read slowly) 9 streams of 6,400 were cut
(``bench/stream_cut.py``).

Fix: the caller ends its requests with ``ASK`` (an end of stream that an unchanged handler
takes as the plain one) and reads until ``END``; a handler that was asked sends ``END`` after its
last answer and closes only when the caller has closed (or after ``LINGER`` seconds), so nothing
is left in flight when p2pd resets. With a caller or handler of unchanged hivemind, the stream
behaves as upstream's.

Kind: bug fix (belongs upstream; docs/hivemind/stream_end.patch; p2pd's ``doStreamPipe`` too)

Shown: ``tests/test_stream_end.py`` (slow: cut streams under load without it, none with it; an
unchanged caller and an unchanged handler still work with a changed one).
"""

from __future__ import annotations

import asyncio
from contextlib import closing, suppress

REPLACES = [
    "hivemind.p2p.p2p_daemon.P2P._add_protobuf_stream_handler",
    "hivemind.p2p.p2p_daemon.P2P._iterate_protobuf_stream_handler",
]

ASK_TEXT = "hivemind: ask end"  # the caller reads until END
END_TEXT = "hivemind: end of answers"  # the handler's last message, only to a caller that asked
LINGER = 60.0  # how long a handler that sent END waits for the caller to close before it closes


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Until the caller closes; what it still sends is dropped, not kept."""
    while await reader.read(1 << 16):
        pass


def install() -> None:
    from hivemind.p2p.p2p_daemon import P2P, P2PContext, P2PHandlerError, logger
    from hivemind.proto.p2pd_pb2 import RPCError

    async def _add_protobuf_stream_handler(self, name, handler, input_protobuf_type, max_prefetch=5,
                                           balanced=False) -> None:
        async def _handle_stream(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            context = P2PContext(handle_name=name, local_id=self.peer_id, remote_id=stream_info.peer_id)
            requests: asyncio.Queue = asyncio.Queue(max_prefetch)
            asked = False

            async def _read_stream():
                while True:
                    request = await requests.get()
                    if request is None:
                        break
                    yield request

            async def _process_stream() -> bool:
                try:
                    async for response in handler(_read_stream(), context):
                        try:
                            await P2P.send_protobuf(response, writer)
                        except Exception:  # the caller went away; it sees its own error
                            logger.debug("Exception while sending response:", exc_info=True)
                            return False
                except Exception as e:
                    logger.warning("Handler failed with the exception:", exc_info=True)
                    with suppress(Exception):
                        await P2P.send_protobuf(RPCError(message=str(e)), writer)
                    return False
                return True

            with closing(writer):
                processing_task = asyncio.create_task(_process_stream())
                try:
                    while True:
                        receive_task = asyncio.create_task(P2P.receive_protobuf(input_protobuf_type, reader))
                        await asyncio.wait({processing_task, receive_task}, return_when=asyncio.FIRST_COMPLETED)
                        if processing_task.done():
                            receive_task.cancel()
                            if asked and processing_task.result():
                                await P2P.send_protobuf(RPCError(message=END_TEXT), writer)
                                with suppress(asyncio.TimeoutError, ConnectionError):
                                    await asyncio.wait_for(_until_closed(reader), LINGER)
                            return
                        try:
                            request, error = await receive_task
                        except asyncio.IncompleteReadError:  # the caller cancelled or died
                            return
                        asked = asked or (error is not None and error.message == ASK_TEXT)
                        await requests.put(request)  # None for the end of the stream
                except Exception:
                    logger.warning("Exception while receiving requests:", exc_info=True)
                finally:
                    processing_task.cancel()

        await self.add_binary_stream_handler(name, _handle_stream, balanced=balanced)

    async def _iterate_protobuf_stream_handler(self, peer_id, name, requests, output_protobuf_type):
        _, reader, writer = await self.call_binary_stream_handler(peer_id, name)

        async def _write_to_stream() -> None:
            async for request in requests:
                await P2P.send_protobuf(request, writer)
            await P2P.send_protobuf(RPCError(message=ASK_TEXT), writer)

        async def _read_from_stream():
            with closing(writer):
                try:
                    while True:
                        try:
                            response, error = await P2P.receive_protobuf(output_protobuf_type, reader)
                        except asyncio.IncompleteReadError:  # closed: an unchanged handler's end, or a cut
                            break
                        if error is not None:
                            if error.message == END_TEXT:
                                break
                            raise P2PHandlerError(f"Failed to call handler `{name}` at {peer_id}: {error.message}")
                        yield response
                    await writing_task
                finally:
                    writing_task.cancel()

        writing_task = asyncio.create_task(_write_to_stream())
        return _read_from_stream()

    P2P._add_protobuf_stream_handler = _add_protobuf_stream_handler  # type: ignore[method-assign]
    P2P._iterate_protobuf_stream_handler = _iterate_protobuf_stream_handler  # type: ignore[method-assign]
