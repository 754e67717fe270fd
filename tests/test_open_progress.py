"""Open experiments stay open: a worker trains an experiment without ``needs_token``, and a plain
hivemind client (hivemind's public API only, no project code, no token) reads its progress records
from the DHT, as any dashboard or tool could."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import start_command
from swarmpeer import SwarmPeer, wait_until

# Plain hivemind: a client-mode DHT that reads ``<run id>_progress`` (hivemind's ProgressTracker
# records, signed with RSASignatureValidator as hivemind does); prints the peers it found.
READER = """
import json, os, sys, time
import hivemind
from hivemind.dht.schema import RSASignatureValidator
from hivemind.p2p import PeerID
async def routing_table_size(_dht, node):  # defined before a DHT's process forks: it runs there
    return len(node.protocol.routing_table.uid_to_peer_id)
def connect():
    # wait_timeout: a busy peer may take seconds to answer, and one that does not is dropped from the
    # routing table (a client learns of no other), so a reader that lost its only peer connects again
    for attempt in range(3):
        try:
            dht = hivemind.DHT(initial_peers=sys.argv[2:], client_mode=True, wait_timeout=10, start=True)
        except RuntimeError as exc:  # no initial peer answered the bootstrap ping in wait_timeout
            print(f"connect {attempt + 1}: {exc}", flush=True)
            continue
        dht.add_validators([RSASignatureValidator()])  # progress records are signed: it strips the signatures
        return dht
    sys.exit("no initial peer answered")
dht, found, tries, restarts, began = connect(), {}, [], 0, time.monotonic()
while not found and time.monotonic() - began < 75:
    entry = dht.get(sys.argv[1] + "_progress", latest=True)
    tries.append(None if entry is None else type(entry.value).__name__)
    if entry is not None and isinstance(entry.value, dict) and entry.value:
        for record in entry.value.values():
            value = record.value
            found[PeerID(value["peer_id"]).to_base58()] = value["samples_accumulated"]
    elif dht.run_coroutine(routing_table_size) == 0:
        dht.shutdown()
        dht, restarts = connect(), restarts + 1
    else:
        time.sleep(0.5)
print(json.dumps({"peers": sorted(found), "samples": list(found.values()), "tries": len(tries),
                  "got": sorted(set(map(str, tries))), "restarts": restarts,
                  "seconds": round(time.monotonic() - began, 1)}), flush=True)
os._exit(0)  # no graceful shutdown needed: the reader is done
"""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_plain_hivemind_client_reads_an_open_experiments_progress(spawn_worker, corpus_server, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("DEDLOC_TEST_LOG_LEVEL", "INFO")  # hivemind's news in worker.log, for a failure's message
    worker = spawn_worker("open")
    assert worker.send(start_command(corpus_server, worker.home, run_id="open_progress_test"))
    peer = SwarmPeer(worker)
    wait_until([peer], lambda: len(peer.progress) >= 2, 180, "the worker did not train")
    peer_id = next(s.peer_id for s in peer.states if s.peer_id)
    out = tmp_path / "reader.out"
    # to a file, not a pipe: plain hivemind's p2pd outlives the reader's os._exit and would hold a pipe open
    with out.open("w") as sink:
        reader = subprocess.Popen([sys.executable, "-c", READER, "open_progress_test", *peer.maddrs],
                                  stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = reader.wait(timeout=150)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the reader's p2pd, which plain hivemind leaves
                os.killpg(reader.pid, signal.SIGKILL)
            reader.wait()
    text = out.read_text()
    assert code == 0, text[-3000:]
    seen = json.loads(text.strip().splitlines()[-1])
    log = (worker.home / "worker.log").read_text(errors="replace")
    assert peer_id in seen["peers"], f"{peer_id} {seen}\n{text[-2000:]}\n--- worker.log\n{log[-6000:]}"
    assert all(samples >= 0 for samples in seen["samples"]), seen
