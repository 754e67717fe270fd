"""How often a hivemind stream loses its last answers, with and without hivemind_ext.stream_end.

    PYTHONPATH=. .venv/bin/python bench/stream_cut.py [--rounds 400] [--streams 16] [--answers 4]
                                                     [--size 300000] [--busy 2]

Two real P2P peers on loopback. Each round the caller opens ``--streams`` streams at once, sends
``--answers`` requests on each and reads the handler's answers of ``--size`` bytes slowly (5 ms
apart), while ``--busy`` processes keep the cores busy. A stream that ends with fewer answers than
requests was cut by p2pd's reset (see stream_end's docstring). Both modes run in fresh
interpreters, one after the other, under the same load. Last line:
``stream_cut: without N of M streams cut, with K of M``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CALLS = """
import asyncio, json, sys
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2
from dedloc_core.engine import hivemind_ext
skip, rounds, streams, answers, size = sys.argv[1], *map(int, sys.argv[2:6])
hivemind_ext.install(skip=[skip] if skip else [])

async def main():
    server = await P2P.create()
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())

    async def handler(stream, context):
        async for _ in stream:
            yield averaging_pb2.AveragingData(group_id=b"x" * size)

    await server.add_protobuf_handler("cut", handler, averaging_pb2.AveragingData, stream_input=True,
                                      stream_output=True)

    async def one():
        async def requests():
            for _ in range(answers):
                yield averaging_pb2.AveragingData(group_id=b"r")
        got = 0
        async for _ in await client._iterate_protobuf_stream_handler(server.peer_id, "cut", requests(),
                                                                     averaging_pb2.AveragingData):
            got += 1
            await asyncio.sleep(0.005)
        return got

    cut = 0
    for _ in range(rounds):
        cut += sum(got != answers for got in await asyncio.gather(*[one() for _ in range(streams)]))
    print(json.dumps({"cut": cut, "streams": rounds * streams}))
    await client.shutdown()
    await server.shutdown()

asyncio.run(main())
"""


def _busy() -> None:
    while True:
        pass


def run(skip: str, args) -> dict:
    out = subprocess.run([sys.executable, "-c", CALLS, skip, str(args.rounds), str(args.streams),
                          str(args.answers), str(args.size)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--answers", type=int, default=4)
    parser.add_argument("--size", type=int, default=300_000)
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the peers")
    args = parser.parse_args()
    load = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.busy)]
    for process in load:
        process.start()
    try:
        without, with_ = run("stream_end", args), run("", args)
    finally:
        for process in load:
            process.terminate()
    print(f"stream_cut: without {without['cut']} of {without['streams']} streams cut, "
          f"with {with_['cut']} of {with_['streams']}")


if __name__ == "__main__":
    main()
