"""Delay every packet of one NFQUEUE queue by a fixed time, in pure Python (no NetfilterQueue).

Usage: ``python delay.py QUEUE_NUM DELAY_MS`` inside a namespace; prints ``ready`` once bound,
then an iptables rule ``-j NFQUEUE --queue-num QUEUE_NUM`` sends packets here. Used where the kernel
has no ``netem``. It speaks nfnetlink_queue directly: it asks for packet metadata only (no
payload), and since the delay is constant packets leave in the order they came, so one batch
verdict (``NFQNL_MSG_VERDICT_BATCH``: accept every id up to N) releases all that are due.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2


def _attr(kind: int, payload: bytes) -> bytes:
    data = struct.pack("=HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _message(msg_type: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = struct.pack("=BB", socket.AF_INET, 0) + struct.pack("!H", queue) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, seq, 0) + body


def _config(sock: socket.socket, queue: int, attrs: bytes, seq: int) -> None:
    sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK, seq))
    reply = sock.recv(65536)
    length, kind = struct.unpack_from("=IH", reply)
    if kind == NLMSG_ERROR:
        (error,) = struct.unpack_from("=i", reply, 16)
        if error:
            raise OSError(-error, f"nfqueue config failed: {os.strerror(-error)}")


def _packet_ids(data: bytes):
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16:
            return
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            pos, end = offset + 20, offset + length
            while pos + 4 <= end:
                alen, atype = struct.unpack_from("=HH", data, pos)
                if alen < 4:
                    break
                if atype & 0x3FFF == NFQA_PACKET_HDR:
                    yield struct.unpack_from("!I", data, pos + 4)[0]
                    break
                pos += (alen + 3) & ~3
        offset += (length + 3) & ~3


def main(queue: int, delay_ms: float) -> None:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    _config(sock, queue, _attr(NFQA_CFG_CMD, struct.pack("=BB", NFQNL_CFG_CMD_BIND, 0) +
                                struct.pack("!H", socket.AF_INET)), 1)
    _config(sock, queue, _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)), 2)
    _config(sock, queue, _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536)), 3)
    print("ready", flush=True)
    delay = delay_ms / 1000.0
    waiting: collections.deque[tuple[float, int]] = collections.deque()
    while True:
        timeout = max(0.0, waiting[0][0] - time.monotonic()) if waiting else None
        ready, _, _ = select.select([sock], [], [], timeout)
        if ready:
            try:
                data = sock.recv(1 << 20)
            except OSError:  # ENOBUFS: the kernel dropped packets (they are lost, as on a real link)
                continue
            due = time.monotonic() + delay
            waiting.extend((due, packet_id) for packet_id in _packet_ids(data))
        now, last = time.monotonic(), None
        while waiting and waiting[0][0] <= now:
            last = waiting.popleft()[1]
        if last is not None:
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))
            sock.send(_message(NFQNL_MSG_VERDICT_BATCH, queue, verdict))


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
