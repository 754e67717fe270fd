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
dht = hivemind.DHT(initial_peers=sys.argv[2:], client_mode=True, start=True)
dht.add_validators([RSASignatureValidator()])  # progress records are signed: it strips the signatures
found = {}
for _ in range(60):
    entry = dht.get(sys.argv[1] + "_progress", latest=True)
    if entry is not None and isinstance(entry.value, dict) and entry.value:
        for record in entry.value.values():
            value = record.value
            found[PeerID(value["peer_id"]).to_base58()] = value["samples_accumulated"]
        break
    time.sleep(0.5)
print(json.dumps({"peers": sorted(found), "samples": list(found.values())}), flush=True)
os._exit(0)  # no graceful shutdown needed: the reader is done
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plain_hivemind_client_reads_an_open_experiments_progress(spawn_worker, corpus_server, tmp_path):
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
            code = reader.wait(timeout=120)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the reader's p2pd, which plain hivemind leaves
                os.killpg(reader.pid, signal.SIGKILL)
            reader.wait()
    text = out.read_text()
    assert code == 0, text[-3000:]
    seen = json.loads(text.strip().splitlines()[-1])
    assert peer_id in seen["peers"], (peer_id, seen)
    assert all(samples >= 0 for samples in seen["samples"]), seen
