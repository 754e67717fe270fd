"""A crowd at the backbone: N simulated volunteers publishing their DHT records, 50 dashboard viewers.

The real backbone (``dedloc backbone --experiment tiny-lm-demo``, the shipped catalog, loopback, HTTP
on) runs as an organizer starts it; its run folder is seeded with a full learning curve (1,000
points, what ``/swarm.json`` carries after a long run). For each N of ``--volunteers`` the bench
runs N simulated volunteers and ``--viewers`` dashboard viewers for ``--seconds`` (after a warm-up
of ``--warmup`` seconds) and measures the backbone's whole process tree (the backbone, its hivemind
helper processes, p2pd): cores (CPU seconds / wall seconds), RSS and PSS summed over the tree, the
latency of ``/swarm.json`` (p50, p95) and the DHT answer latency (a separate client's
``dht.get`` of the progress key, with validation, as a newcomer's tracker does, every 2 s).

What one simulated volunteer sends, at a real worker's periods (volunteers are DHT clients: the
catalog's ``volunteer_dht`` is ``client``, so the backbone serves every record and every request):

- its training progress (``{run_id}_progress``, subkey ``[owner:<its RSA key>]``, hivemind's
  ``LocalTrainingProgress`` signed with that key, 60 s lifetime): every
  ``SwarmConfig.progress_report_period`` (6 s) while it accumulates, and at once at each global step;
- its metrics (``{run_id}_metrics``, ``metrics.PeerMetrics`` signed the same way, its peer id the one
  of its key, a display name of its own): at each global step at least ``METRICS_GAP`` (5 s) apart,
  and every ``METRICS_PERIOD`` (30 s) in between;
- its state averager's "I can share my state" record (``{run_id}_state_averager.all_averagers``,
  unsigned, subkey its peer id): at each global step (the priority changes) and at half its 30 s
  lifetime (``hivemind_ext.state_records``);
- its tracker's reads of the progress at hivemind's refresh schedule (the time left to the step
  x N / (N + drift), clipped to the catalog's 2..10 s), plus one at each step's end
  (``RoundCountingOptimizer._look_at_the_swarm``): a request for the backbone's digest of the
  record (``progress_digest``), as a volunteer's tracker makes it;
- the search a store does once per key per ``nearest_cache.NEAREST_TTL`` (30 s): a find of the id
  beside the key's, which the backbone answers with its nearest nodes and no record.

Global steps last ``--step-seconds`` (20 s), all volunteers together (a synchronous swarm), each
publishing 0-1 s after the step's end. How it differs from N real peers:

- ``--per-process`` (125) volunteers share one client-mode ``DHTNode`` (one p2pd, one connection to
  the backbone) in a process of their own; each volunteer signs with its own RSA key (one
  ``RSASignatureValidator`` per identity inside ``MultiKeySigner``: a DHT keeps only one), so the
  bytes the backbone receives, checks and stores are a real volunteer's. The backbone sees a few
  connections and a few p2pd peers instead of N (N real volunteers would also each hold a libp2p
  connection, with its keep-alives and identify, and p2pd's own DHT traffic).
- The store searches go out as raw ``rpc_find`` requests and the reads as raw digest requests (the
  backbone does the same work; the generator skips turning the answers back into records).
- No averaging: matchmaking declarations and polls of the group key (per round, while a group forms)
  and the all-reduce traffic are ``bench/scale_averaging.py``'s; the state records carry no priority
  (None, as a peer that shares nothing stores), so the backbone, catching up with the simulated
  steps, finds no one to download the state from instead of dialling N peers that do not exist.
- Viewers poll ``/swarm.json`` like the dashboard page: the next request ``POLL_SECONDS`` (5 s) after
  the last answer, one connection per request.

The load generators run on the same cores; the cores figure is the backbone tree's own CPU time.

    PYTHONPATH=. .venv/bin/python bench/backbone_crowd.py --volunteers 50,100,250,500   # about 8 minutes
    PYTHONPATH=. .venv/bin/python bench/backbone_crowd.py --quick        # 20 volunteers, 30 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dedloc_core import proctree  # noqa: E402
from dedloc_core.backboneproc import BackboneProcess  # noqa: E402

EXPERIMENT, RUN_ID = "tiny-lm-demo", "tiny_lm_demo"
PROGRESS_PERIOD = 6.0  # SwarmConfig.progress_report_period
PROGRESS_LIFETIME = 60.0  # hivemind ProgressTracker.metadata_expiration
METRICS_GAP, METRICS_PERIOD, METRICS_LIFETIME = 5.0, 30.0, 600.0  # engine/training.py, engine/metrics.py
STATE_PERIOD = 30.0  # DecentralizedAverager.declare_state_period (renewed at half)
REFRESH_MIN, REFRESH_MAX, DRIFT_PEERS, DRIFT_RATE = 2.0, 10.0, 3, 0.2  # SwarmConfig and hivemind's tracker
NEAREST_TTL = 30.0  # hivemind_ext.nearest_cache
VIEWER_PERIOD = 5.0  # organizer/dashboard.py POLL_SECONDS
PROBE_PERIOD = 2.0


# ---------------------------------------------------------------- the load generator (a child process)

def load_keys(folder: Path, first: int, count: int):
    """RSA keys ``first``..``first+count-1``, kept as PEM in ``folder`` (created once: 70 ms each)."""
    from cryptography.hazmat.primitives import serialization
    from hivemind.utils.crypto import RSAPrivateKey

    folder.mkdir(parents=True, exist_ok=True)
    keys = []
    for i in range(first, first + count):
        path = folder / f"{i}.pem"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(RSAPrivateKey()._private_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
            os.replace(tmp, path)
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key._private_key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        keys.append(key)
    return keys


def multi_key_signer(keys):
    """An ``RSASignatureValidator`` that signs each record with the key named in its subkey."""
    from hivemind.dht.crypto import RSASignatureValidator

    class MultiKeySigner(RSASignatureValidator):
        def __init__(self):
            super().__init__(keys[0])
            self._signers = {RSASignatureValidator(k).local_public_key: RSASignatureValidator(k) for k in keys}

        def sign_value(self, record):
            found = self._PUBLIC_KEY_RE.findall(record.subkey)
            if not found:
                return record.value
            owner = self.PUBLIC_KEY_FORMAT.replace(b"_key_", found[0])
            signer = self._signers.get(owner)
            return record.value if signer is None else signer.sign_value(record)

    return MultiKeySigner()


class Counters:
    def __init__(self):
        self.stores = self.stored = self.store_failed = self.finds = self.find_failed = 0
        self.reads = self.read_failed = 0
        self.find_seconds: list[float] = []
        self.read_seconds: list[float] = []


async def generate(args) -> None:
    """Run ``args.count`` volunteers (identities ``args.first``...) until SIGTERM; print counters."""
    from google.protobuf.wrappers_pb2 import StringValue
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2
    from hivemind.utils import get_dht_time

    from dedloc_core.engine import hivemind_ext, metrics, progress_digest
    from dedloc_core.engine.hivemind_ext.nearest_cache import beside_key

    hivemind_ext.install()
    keys = load_keys(Path(args.keys), args.first, args.count)
    signer = multi_key_signer(keys)
    node = await DHTNode.create(initial_peers=args.maddrs, client_mode=True, record_validator=signer,
                                host_maddrs=["/ip4/127.0.0.1/tcp/0"], cache_locally=False, cache_on_store=False)
    backbone = PeerID.from_base58(args.backbone_peer)
    counts, stop = Counters(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    progress_key, metrics_key = f"{RUN_ID}_progress", f"{RUN_ID}_metrics"
    state_key = f"{RUN_ID}_state_averager.all_averagers"
    key_ids = {k: DHTID.generate(source=k) for k in (progress_key, metrics_key, state_key)}
    tasks: set[asyncio.Task] = set()

    async def store(key, subkey, value, lifetime):
        counts.stores += 1
        try:
            ok = await node.store(key, value, get_dht_time() + lifetime, subkey=subkey)
            counts.stored += bool(ok)
            counts.store_failed += not ok
        except Exception:
            counts.store_failed += 1

    async def find(key):  # a store's search: it asks beside the key (hivemind_ext.nearest_cache)
        counts.finds += 1
        request = dht_pb2.FindRequest(keys=[beside_key(key_ids[key]).to_bytes()], peer=node.protocol.node_info)
        began = time.perf_counter()
        try:
            await node.protocol.get_stub(backbone).rpc_find(request, timeout=10.0)
            counts.find_seconds.append(time.perf_counter() - began)
        except Exception:
            counts.find_failed += 1

    async def read(me):  # a tracker's read of the progress: the backbone's digest (progress_digest)
        counts.reads += 1
        request = StringValue(value=json.dumps({"me": progress_digest.subkey_hash(me)}))
        began = time.perf_counter()
        try:
            call = node.p2p.call_protobuf_handler(backbone, progress_digest.DIGEST, request, StringValue)
            answer = json.loads((await asyncio.wait_for(call, 10.0)).value)
            counts.read_seconds.append(time.perf_counter() - began)
            counts.read_failed += "error" in answer
        except Exception:
            counts.read_failed += 1

    def spawn(coro):
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def volunteer(index: int, key):
        rng = random.Random(index)
        owner = RSASignatureValidator(key).local_public_key
        peer = metrics.peer_id_of(owner)
        peer_bytes = PeerID.from_base58(peer).to_bytes()
        sps = rng.uniform(5.0, 50.0)
        n = args.peers_total
        step_s, t0 = args.step_seconds, args.t0

        def epoch_at(t):
            return int((t - t0) // step_s)

        def progress(epoch, now):
            since = max(0.0, now - (t0 + epoch * step_s))
            return {"peer_id": peer_bytes, "epoch": epoch, "samples_accumulated": int(sps * since),
                    "samples_per_second": sps, "time": get_dht_time(), "client_mode": False}

        def metric(epoch):
            return {"peer_id": peer, "step": epoch, "loss": round(rng.uniform(2.0, 6.0), 4),
                    "samples": int(sps * step_s * epoch), "samples_per_second": sps, "compute_seconds": step_s * epoch,
                    "time": time.time(), "display_name": f"volunteer {index:04d}"}

        def refresh(now):
            left = t0 + (epoch_at(now) + 1) * step_s - now
            return min(REFRESH_MAX, max(REFRESH_MIN, left * n / max(n + DRIFT_PEERS, n * (1 + DRIFT_RATE))))

        now = time.time()
        epoch = epoch_at(now)
        jitter = rng.uniform(0.0, 1.0)  # how late after a step's end this volunteer publishes
        due = {"progress": now + rng.uniform(0, PROGRESS_PERIOD), "metrics": now + rng.uniform(0, METRICS_PERIOD),
               "state": now + rng.uniform(0, STATE_PERIOD / 2), "fetch": now + rng.uniform(0, REFRESH_MIN)}
        searches = {k: now + rng.uniform(0, NEAREST_TTL) for k in key_ids}
        last_metrics = -math.inf
        while not stop.is_set():
            now = time.time()
            if epoch_at(now - jitter) != epoch:  # a global step: report at once, as the worker does
                epoch = epoch_at(now - jitter)
                spawn(store(progress_key, owner, progress(epoch, now), PROGRESS_LIFETIME))
                spawn(store(state_key, peer_bytes, None, STATE_PERIOD))
                spawn(read(owner))
                due["progress"] = now + PROGRESS_PERIOD
                due["state"] = now + STATE_PERIOD / 2
                if now - last_metrics >= METRICS_GAP:
                    spawn(store(metrics_key, owner, metric(epoch), METRICS_LIFETIME))
                    last_metrics, due["metrics"] = now, now + METRICS_PERIOD
            if now >= due["progress"]:
                spawn(store(progress_key, owner, progress(epoch, now), PROGRESS_LIFETIME))
                due["progress"] = now + PROGRESS_PERIOD
            if now >= due["metrics"]:
                spawn(store(metrics_key, owner, metric(epoch), METRICS_LIFETIME))
                last_metrics, due["metrics"] = now, now + METRICS_PERIOD
            if now >= due["state"]:
                spawn(store(state_key, peer_bytes, None, STATE_PERIOD))
                due["state"] = now + STATE_PERIOD / 2
            if now >= due["fetch"]:
                spawn(read(owner))
                due["fetch"] = now + refresh(now)
            for k, when in searches.items():
                if now >= when:
                    spawn(find(k))
                    searches[k] = now + NEAREST_TTL
            next_step = t0 + (epoch + 1) * step_s + jitter
            wake = min(min(due.values()), min(searches.values()), next_step)
            try:
                await asyncio.wait_for(stop.wait(), max(0.01, wake - time.time()))
            except TimeoutError:
                pass

    runners = [asyncio.create_task(volunteer(args.first + i, key)) for i, key in enumerate(keys)]
    print("ready", flush=True)
    await stop.wait()
    await asyncio.gather(*runners, return_exceptions=True)
    for task in list(tasks):
        task.cancel()
    finds, reads = sorted(counts.find_seconds), sorted(counts.read_seconds)
    print(json.dumps({"stores": counts.stores, "stored": counts.stored, "store_failed": counts.store_failed,
                      "finds": counts.finds, "find_failed": counts.find_failed,
                      "find_p95_ms": 1000 * finds[int(0.95 * (len(finds) - 1))] if finds else None,
                      "reads": counts.reads, "read_failed": counts.read_failed,
                      "read_p95_ms": 1000 * reads[int(0.95 * (len(reads) - 1))] if reads else None}), flush=True)
    await node.shutdown()


# ---------------------------------------------------------------- the orchestrator

def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


class Viewers:
    """``count`` threads polling ``url`` like the dashboard page: the next request 5 s after an answer."""

    def __init__(self, url: str, count: int):
        self.url, self.count = url, count
        self.stop = threading.Event()
        self.samples: list[tuple[float, float]] = []  # (when, seconds)
        self.failures: list[float] = []
        self.size = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def start(self):
        for thread in self.threads:
            thread.start()

    def _run(self, i: int):
        if self.stop.wait(VIEWER_PERIOD * i / self.count):  # spread over one period, as browsers would be
            return
        while not self.stop.is_set():
            began = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=30) as response:
                    self.size = len(response.read())
                self.samples.append((time.time(), time.perf_counter() - began))
            except OSError:
                self.failures.append(time.time())
            self.stop.wait(VIEWER_PERIOD)

    def latencies(self, since: float) -> list[float]:
        return [s for when, s in self.samples if when >= since]


class Probe:
    """A DHT client that reads the progress key every 2 s, as a newcomer's tracker does; times each."""

    def __init__(self, maddrs: list[str]):
        import hivemind
        from hivemind.dht.schema import RSASignatureValidator, SchemaValidator
        from hivemind.optim.progress_tracker import TrainingProgressSchema

        from dedloc_core.engine import metrics

        self.dht = hivemind.DHT(initial_peers=maddrs, client_mode=True, start=True,
                                host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.dht.add_validators([SchemaValidator(TrainingProgressSchema, prefix=RUN_ID), RSASignatureValidator(),
                                 *metrics.validators(RUN_ID)])
        self.stop = threading.Event()
        self.samples: list[tuple[float, float, int]] = []  # (when, seconds, entries)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(PROBE_PERIOD):
            began = time.perf_counter()
            try:
                found = self.dht.get(f"{RUN_ID}_progress", latest=True)
            except Exception:
                continue
            entries = len(found.value) if found is not None and isinstance(found.value, dict) else 0
            self.samples.append((time.time(), time.perf_counter() - began, entries))

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.dht.shutdown()


class TreeMeter:
    """CPU seconds, RSS and PSS of a process group (the backbone's tree)."""

    def __init__(self, pgid: int):
        self.pgid = pgid

    def members(self) -> list[psutil.Process]:
        return [p for p in proctree.group_members(self.pgid)]

    def cpu(self) -> float:
        return sum(self.cpu_by_process().values())

    def cpu_by_process(self) -> dict[tuple[int, str], float]:
        """CPU seconds of each member, by (pid, what it is)."""
        out = {}
        for proc in self.members():
            try:
                t = proc.cpu_times()
                out[proc.pid, self.what(proc)] = t.user + t.system
            except psutil.Error:
                continue
        return out

    @staticmethod
    def what(proc: psutil.Process) -> str:
        try:
            if proc.name() == "p2pd":
                return "p2pd"
            return "backbone" if proc.pid == os.getpgid(proc.pid) else "helper " + proc.name()[:20]
        except (psutil.Error, OSError):
            return "?"

    def memory_by_process(self) -> list[tuple[str, float, float]]:
        out = []
        for proc in self.members():
            try:
                info = proc.memory_full_info()
                out.append((self.what(proc), info.rss / 2**20, info.pss / 2**20))
            except psutil.Error:
                continue
        return out

    def memory(self) -> tuple[float, float, int]:
        rss = pss = 0
        count = 0
        for proc in self.members():
            try:
                info = proc.memory_full_info()
                rss, pss, count = rss + info.rss, pss + info.pss, count + 1
            except psutil.Error:
                continue
        return rss / 2**20, pss / 2**20, count


def seed_curve(run_dir: Path, points: int = 1000) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    with (run_dir / "learning_curve.jsonl").open("w") as f:
        for step in range(points):
            f.write(json.dumps({"time": now - 30 * (points - step), "step": step, "num_peers": 500,
                                "samples_per_second": 12000.0, "loss": round(2 + 6 / (1 + step / 50), 5)}) + "\n")


def start_generators(n: int, per_process: int, ready: dict, args, t0: float, keys: Path) -> list[subprocess.Popen]:
    procs = []
    for first in range(0, n, per_process):
        count = min(per_process, n - first)
        cmd = [sys.executable, __file__, "--generate", "--first", str(first), "--count", str(count),
               "--peers-total", str(n), "--step-seconds", str(args.step_seconds), "--t0", repr(t0),
               "--keys", str(keys), "--backbone-peer", ready["peer_id"], "--maddrs", *ready["maddrs"]]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
    for proc in procs:
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"a load generator did not start (code {proc.poll()})")
    return procs


def stop_generators(procs: list[subprocess.Popen]) -> dict:
    counted = ("stores", "stored", "store_failed", "finds", "find_failed", "reads", "read_failed")
    totals = {**{k: 0 for k in counted}, "find_p95_ms": [], "read_p95_ms": []}
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        for line in out.splitlines():
            if line.startswith("{"):
                data = json.loads(line)
                for k in counted:
                    totals[k] += data[k]
                for k in ("find_p95_ms", "read_p95_ms"):
                    if data[k] is not None:
                        totals[k].append(data[k])
    for k in ("find_p95_ms", "read_p95_ms"):
        totals[k] = max(totals[k], default=math.nan)
    return totals


def measure(n: int, backbone: BackboneProcess, args, keys: Path, t0: float) -> dict:
    """One N: ``t0`` is the simulated swarm's step 0 (one clock for the whole sweep)."""
    meter = TreeMeter(backbone.pid)
    started = time.time()
    generators = start_generators(n, args.per_process, backbone.ready, args, t0, keys)
    viewers = Viewers(backbone.http_url + "swarm.json", args.viewers)
    viewers.start()
    probe = Probe(backbone.maddrs)
    try:
        time.sleep(args.warmup)
        began, cpu0 = time.time(), meter.cpu_by_process()
        peak = (0.0, 0.0, 0)
        while time.time() < began + args.seconds:
            time.sleep(min(10.0, began + args.seconds - time.time()))
            rss = meter.memory()
            peak = max(peak, rss)
            if not backbone.running():
                raise RuntimeError(f"the backbone exited:\n{backbone.log_tail()}")
        cpu1 = meter.cpu_by_process()
        wall = time.time() - began
        by_process = {f"{what} {pid}": round((cpu1[pid, what] - cpu0.get((pid, what), 0.0)) / wall, 3)
                      for pid, what in cpu1}
        cpu = sum(cpu1[k] - cpu0.get(k, 0.0) for k in cpu1)
        memory = [f"{what} rss {rss:.0f} pss {pss:.0f}" for what, rss, pss in meter.memory_by_process()]
    finally:
        viewers.stop.set()
        probe.close()
        sent = stop_generators(generators)
    http = viewers.latencies(began)
    gets = [(s, e) for when, s, e in probe.samples if when >= began]
    return {"volunteers": n, "cores": cpu / wall, "rss_mb": peak[0], "pss_mb": peak[1], "processes": peak[2],
            "http_p50_ms": 1000 * percentile(http, 0.5), "http_p95_ms": 1000 * percentile(http, 0.95),
            "http_requests": len(http), "http_failed": sum(w >= began for w in viewers.failures),
            "swarm_json_kb": viewers.size / 1024,
            "dht_p50_ms": 1000 * percentile([s for s, _ in gets], 0.5),
            "dht_p95_ms": 1000 * percentile([s for s, _ in gets], 0.95),
            "entries": max((e for _, e in gets), default=0), **sent,
            "cores_by_process": by_process, "memory_by_process": memory,
            "ops_per_s": (sent["stores"] + sent["finds"] + sent["reads"]) / (time.time() - started)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--volunteers", default="50,100,250,500", help="comma-separated N to sweep")
    p.add_argument("--viewers", type=int, default=50)
    p.add_argument("--seconds", type=float, default=60.0, help="measured seconds per N")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds per N before measuring")
    p.add_argument("--step-seconds", type=float, default=20.0, help="length of a simulated global step")
    p.add_argument("--per-process", type=int, default=125, help="volunteers per load-generator process")
    p.add_argument("--keys", default=str(Path(tempfile.gettempdir()) / "backbone_crowd_keys"))
    p.add_argument("--quick", action="store_true", help="20 volunteers, 10 viewers, 30 s")
    p.add_argument("--keep", type=Path, default=None, help="keep the backbone's run folder and log here")
    # the load generator (this script re-run as a child)
    p.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--peers-total", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--backbone-peer", default="", help=argparse.SUPPRESS)
    p.add_argument("--maddrs", nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.generate:
        asyncio.run(generate(args))
        return
    if args.quick:
        args.volunteers, args.viewers, args.seconds, args.warmup = "20", 10, 30.0, 20.0
    sweep = [int(x) for x in args.volunteers.split(",")]
    keys = Path(args.keys)
    load_keys(keys, 0, max(sweep))  # before the clock starts: 70 ms of CPU per new key
    folder = args.keep or Path(tempfile.mkdtemp(prefix="backbone_crowd."))
    seed_curve(folder / "backbone")
    backbone = BackboneProcess(["--experiment", EXPERIMENT, "--listen", "/ip4/127.0.0.1/tcp/0", "--http-port", "0"],
                               folder / "backbone", folder / "backbone.log",
                               env={**os.environ, "DEDLOC_HOME": str(folder / "home")})
    backbone.start(timeout=180)
    rows, t0 = [], time.time()
    try:
        time.sleep(5)
        idle = TreeMeter(backbone.pid)
        c0 = idle.cpu()
        time.sleep(10)
        print(f"idle backbone: cores {(idle.cpu() - c0) / 10:.3f}, rss {idle.memory()[0]:.0f} MB", flush=True)
        for n in sweep:
            row = measure(n, backbone, args, keys, t0)
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        backbone.stop()
    print()
    print("| volunteers | backbone cores | RSS MB | PSS MB | /swarm.json p50 / p95 ms | size kB | DHT get p50 / p95 ms "
          "| digest read p95 ms | entries | ops/s | failed stores / finds / reads |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['volunteers']} | {r['cores']:.3f} | {r['rss_mb']:.0f} | {r['pss_mb']:.0f} "
              f"| {r['http_p50_ms']:.0f} / {r['http_p95_ms']:.0f} | {r['swarm_json_kb']:.0f} "
              f"| {r['dht_p50_ms']:.0f} / {r['dht_p95_ms']:.0f} | {r['read_p95_ms']:.0f} | {r['entries']} "
              f"| {r['ops_per_s']:.0f} | {r['store_failed']} / {r['find_failed']} / {r['read_failed']} |")
    print()
    for r in rows:
        print(f"backbone_crowd: volunteers {r['volunteers']}, cores {r['cores']:.3f}, rss {r['rss_mb']:.0f} MB, "
              f"pss {r['pss_mb']:.0f} MB, "
              f"swarm.json p95 {r['http_p95_ms']:.0f} ms, dht get p95 {r['dht_p95_ms']:.0f} ms")


if __name__ == "__main__":
    main()
