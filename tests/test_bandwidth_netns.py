"""Bandwidth caps on the wire: three real workers train together, each in its own network
namespace. Once the swarm runs, one peer gets upload and download caps (``set_limits``); its own
veth then shows at most cap x 1.15 bytes per second sent and received over 120 s. After the caps
are lifted (``set_limits`` with 0) the same peer goes above them over some 20 s within 90 s, so the test can fail.

Why 120 s: the download cap paces what this peer reads, but a sender pushes ahead of the reader as
much as the stream's flow-control window (yamux: 256 KiB, growing to MBs) and the TCP buffers take,
and bytes of a round that fails are never read at all. A capped peer on a busy machine falls behind
and loads the swarm's state (about 5 MB here), which lands at link speed and is read at the cap:
over 60 s the wire showed up to 1.26 x the cap (315.7 kB/s received, 1 run of 6 beside a CPU
burner; 1.159 x in another), while most runs stay near 0.6 x (the payload is paced at
``limits.WIRE_SHARE`` of the cap). Over 120 s such a burst weighs half as much. That download
lasts some 14 s at the cap, while the swarm takes about 5 steps: the peer then goes on from the
swarm's step (downloading the state again and again, it would send little else: 23-41 kB/s
beside a CPU burner, where the test wants more than 50).

The caps come after joining because a capped newcomer first downloads the whole state (about
10 MB here: 40 s at the cap), longer than the test should take."""

from __future__ import annotations

import json
import os
import shutil
import time
from importlib import resources
from pathlib import Path

import netns_mini
import pytest
from conftest import tiny_experiment

from dedloc_core.protocol import Limits, SetLimits, Start
from dedloc_core.workerproc import WorkerProcess

CAP = 250_000  # bytes per second, each way
WINDOW = 120.0  # the capped window
FREE_WINDOW = 20.0
TOLERANCE = 1.15
MANIFEST = json.loads(resources.files("resources").joinpath("corpus", "manifest.json").read_text())


def experiment() -> dict:
    # about 0.45M parameters (0.9 MB in fp16): averaging moves a few MB per round. The uncapped
    # check needs the swarm to send well above the cap, so rounds must come often: a round takes at
    # least matchmaking_time. At 5 s the peers sent 255-267 kB/s at best (the test command failed
    # twice against 287.5); at 1 s (``pacing.pace``'s least) a 20 s window above 287.5 came in every
    # run, at 0.3-1 MB/s. A capped peer's chunks get 5 s whatever the matchmaking time (``chunk_timeout``)
    return tiny_experiment(
        id="netns-cap-test", run_id=f"netns_cap_{os.getpid()}",
        recipe_params={"d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 64, "lr": 0.001,
                       "warmup_steps": 0},
        target_batch_size=48, batch_size_per_step=8, matchmaking_time=1.0, averaging_timeout=60.0,
    )


def prefill_cache(home: Path) -> None:
    """Put the corpus shards in the worker's cache (verified there), so it needs no HTTP server."""
    cache = home / "cache" / "shards"
    cache.mkdir(parents=True, exist_ok=True)
    with resources.as_file(resources.files("resources").joinpath("corpus")) as corpus:
        for shard in MANIFEST["shards"][:2]:
            shutil.copy(Path(corpus) / shard["name"], cache / shard["sha256"])


def busiest(lab: netns_mini.Lab, peer: int, window: float, longest: float, above: float) -> tuple[float, float]:
    """(the highest rate, sent or received, over any ``window`` seconds within ``longest`` seconds,
    the seconds it took); it stops as soon as one exceeds ``above`` (a loaded machine may need a
    while for a large round)."""
    samples = [(time.monotonic(), *lab.counters(peer))]
    best = 0.0
    while samples[-1][0] - samples[0][0] < longest:
        time.sleep(1.0)
        samples.append((time.monotonic(), *lab.counters(peer)))
        for t0, tx0, rx0 in samples:
            t1, tx1, rx1 = samples[-1]
            if t1 - t0 < window:
                break
            best = max(best, (tx1 - tx0) / (t1 - t0), (rx1 - rx0) / (t1 - t0))
        if best > above:
            break
    return best, samples[-1][0] - samples[0][0]


def rate(lab: netns_mini.Lab, peer: int, seconds: float) -> tuple[float, float]:
    """(sent, received) bytes per second on peer ``peer``'s own veth over ``seconds``."""
    tx0, rx0 = lab.counters(peer)
    began = time.monotonic()
    time.sleep(seconds)
    tx1, rx1 = lab.counters(peer)
    elapsed = time.monotonic() - began
    return (tx1 - tx0) / elapsed, (rx1 - rx0) / elapsed


def what_it_did(home: Path) -> str:
    """How often the peer's log says it downloaded the swarm's state, sat a step out or went on."""
    log = (home / "worker.log").read_text(errors="replace")
    return (f"{log.count('Downloading parameters')} state downloads, {log.count('sitting step')} steps sat out,"
            f" {log.count('going on')} times gone on at the swarm's step")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_capped_peer_stays_under_its_caps_on_the_wire(tmp_path):
    why = netns_mini.available()
    if why:
        pytest.skip(why)
    workers: list[WorkerProcess] = []
    with netns_mini.Lab(3) as lab:
        try:
            peers: list[str] = []
            for i in range(3):
                home = tmp_path / f"peer{i}"
                prefill_cache(home)
                env = {**os.environ, "DEDLOC_HOME": str(home), "DEDLOC_LOG_LEVEL": "INFO",
                       "DEDLOC_WORKER_NICE": "0"}  # a shared test machine: do not starve the swarm
                worker = WorkerProcess(env=env, stderr=open(home / "worker.log", "w"),
                                       launcher=lab.prefix(i))
                worker.start()
                workers.append(worker)
                worker.send(Start(
                    experiment=experiment(), initial_peers=peers, data_base_url="http://127.0.0.1:9/",
                    identity_path=str(home / "identity.key"), host_maddrs=[f"/ip4/{lab.addresses[i]}/tcp/0"],
                    seed=i, progress_period=1.0,
                    limits=Limits(cpu_threads=1),
                ))
                state = worker.wait_for(lambda e: e.type == "state" and e.state == "training", 240)
                assert state is not None, f"peer {i} did not start; see {home / 'worker.log'}"
                if not peers:
                    peers = list(state.maddrs)
            for worker in workers:
                assert worker.wait_for(lambda e: e.type == "progress" and e.num_peers >= 3, 120), "no 3-peer swarm"
            workers[2].send(SetLimits(limits=Limits(upload_bps=CAP, download_bps=CAP)))
            time.sleep(5)
            capped_tx, capped_rx = rate(lab, 2, WINDOW)
            workers[2].send(SetLimits(limits=Limits(upload_bps=0, download_bps=0)))
            time.sleep(5)
            free, took = busiest(lab, 2, FREE_WINDOW, 90.0, CAP * TOLERANCE)
        finally:
            for worker in workers:
                worker.stop(timeout=20)
    print(f"cap {CAP / 1000:.0f} kB/s: capped sent {capped_tx / 1000:.1f} kB/s, received {capped_rx / 1000:.1f} kB/s;"
          f" uncapped {free / 1000:.1f} kB/s over {FREE_WINDOW:.0f} s (after {took:.0f} s);"
          f" {what_it_did(tmp_path / 'peer2')}")
    assert capped_tx <= CAP * TOLERANCE and capped_rx <= CAP * TOLERANCE
    assert free > CAP * TOLERANCE, "without the cap the peer should exceed it"
    assert min(capped_tx, capped_rx) > CAP * 0.2, "the capped peer should still take part"
