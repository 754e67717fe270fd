"""A peer that leaves right after its round first sends the averages it still owes
(``hivemind_ext.leave_drain``). Four averagers on home-like links in the network lab (root), set up
as the worker's gradient averager (fp16, declared bandwidth for our load balancing, no target
group size): the slowest peer gets no part to reduce, so hivemind sends it its results only after
its whole input has arrived. The fastest peer shuts its averager down the moment its own step
returns, as a volunteer that stops does. With the drain the slowest peer's round succeeds;
without it (``DRAIN_SECONDS`` 0) that peer gets no results and the round fails. A warm-up round
comes first: a fresh swarm's first round can leave a peer without a group (libp2p's dial backoff)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

BOOTSTRAP = """
import sys, time, hivemind
from dedloc_core.engine import swarm
swarm.prepare_process()
dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{sys.argv[1]}/tcp/0"])
print(" ".join(str(a) for a in dht.get_visible_maddrs()), flush=True)
time.sleep(600)
"""

PEER = """
import json, sys, time
from pathlib import Path
import torch, hivemind
from hivemind.compression import Float16Compression
from dedloc_core.engine import swarm
from dedloc_core.engine.hivemind_ext import leave_drain
a = json.loads(sys.argv[1])
swarm.prepare_process()
leave_drain.DRAIN_SECONDS = a["drain"]
dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{a['ip']}/tcp/0"], initial_peers=[a["bootstrap"]])
averager = hivemind.averaging.DecentralizedAverager(
    [torch.full((2**18,), float(a["index"]))], dht=dht, prefix="drain", target_group_size=None,
    min_matchmaking_time=3.0, request_timeout=1.0, next_chunk_timeout=5.0, compression=Float16Compression(),
    bandwidth=a["bandwidth"], start=True)
out, go = Path(a["out"]), Path(a["go"])
out.write_text("ready")
while not go.exists():
    time.sleep(0.05)
for at in map(float, go.read_text().split()):  # a warm-up round (first dials), then the one that counts
    time.sleep(max(0.0, at - time.time()))
    with averager.get_tensors() as tensors:
        tensors[0].fill_(float(a["index"]))
    try:
        group = averager.step(timeout=30, allow_retries=False)  # the round alone: no_rerun's rerun would mend it
        with averager.get_tensors() as tensors:
            mean = float(tensors[0].mean())
        result = {"ok": True, "group": len(group), "mean": mean}
    except Exception as exc:
        result = {"ok": False, "error": repr(exc)[:300]}
if a["leave"]:
    averager.shutdown()
    dht.shutdown()
    out.write_text(json.dumps(result))
else:
    out.write_text(json.dumps(result))
    time.sleep(30)
"""

# up, down Mbit/s, one-way ms; the leaver (last) is by far the fastest: our load balancing makes it
# the only reducer, and the others get their results from it only after their whole input
LINKS = [(2.0, 10.0, 39), (9.7, 48.6, 57), (10.0, 50.0, 94), (40.0, 100.0, 20)]


def round_with_a_leaver(lab, tmp_path: Path, drain: float, attempts: int = 3) -> list[dict]:
    """Each peer's result of the round with a leaver. A round shows nothing of the drain, and runs
    again on fresh hosts (up to ``attempts`` times), where the four did not find one group or the
    leaver did not average all four inputs: on a loaded machine a starved peer can find no group,
    or miss the 5 s chunk timeout and be averaged without (then, as in hivemind, it gets no
    results, drain or not)."""
    everyone = sum(range(len(LINKS))) / len(LINKS)
    for attempt in range(attempts):
        results = one_round(lab, tmp_path / f"try{attempt}", drain, f"t{attempt}")
        leaver = results[-1]
        if leaver.get("group") == len(LINKS) and abs(leaver.get("mean", -1.0) - everyone) < 0.01:
            break
    return results


def one_round(lab, tmp_path: Path, drain: float, tag: str) -> list[dict]:
    from netlab.lab import Shape

    tmp_path.mkdir()
    boot_host = lab.public(f"boot{tag}")
    boot = lab.popen(boot_host, [sys.executable, "-c", BOOTSTRAP, boot_host.ip], cwd=ROOT, stdout=subprocess.PIPE,
                     text=True)
    bootstrap = boot.stdout.readline().split()[0]
    go, outs = tmp_path / "go", []
    for i, (up, down, delay) in enumerate(LINKS):
        host = lab.public(f"p{i}{tag}", Shape(up_mbit=up, down_mbit=down, delay_ms=delay))
        out = tmp_path / f"peer{i}.out"
        outs.append(out)
        args = dict(index=i, ip=host.ip, bootstrap=bootstrap, bandwidth=up, out=str(out), go=str(go), drain=drain,
                    leave=i == len(LINKS) - 1)
        lab.popen(host, [sys.executable, "-c", PEER, json.dumps(args)], cwd=ROOT,
                  stdout=(tmp_path / f"peer{i}.log").open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not all(o.exists() for o in outs):
        assert time.monotonic() < deadline, "the peers did not start"
        time.sleep(0.2)
    go.write_text(f"{time.time() + 1.0} {time.time() + 40.0}")
    deadline = time.monotonic() + 130
    while not all(o.read_text().startswith("{") for o in outs):
        assert time.monotonic() < deadline, "the round did not end"
        time.sleep(0.2)
    return [json.loads(o.read_text()) for o in outs]


def test_a_peer_leaving_after_its_round_still_sends_the_slowest_peer_its_results(netlab, tmp_path):
    results = round_with_a_leaver(netlab, tmp_path, drain=4.0)
    assert all(r["ok"] and r["group"] == 4 and abs(r["mean"] - 1.5) < 0.01 for r in results), results


def test_without_the_drain_the_slowest_peer_fails_the_round(netlab, tmp_path):
    results = round_with_a_leaver(netlab, tmp_path, drain=0.0)
    assert results[-1]["ok"], results  # the leaver's own round went through
    failed = [r for r in results[:-1] if not r["ok"]]
    assert failed and all("not averaged" in r["error"] for r in failed), results
