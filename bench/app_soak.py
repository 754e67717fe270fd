"""Does the tray app's GUI process grow while it runs for weeks? A soak of the real app.

Starts a real desktop (Xvfb, openbox, trayer), serves a signed catalog with one small experiment and
the shipped corpus over HTTP on 127.0.0.1, and starts `dedloc app --hidden` joined to it (consent
given, contribute any time, nobody else in the swarm). The real worker trains and reports with a
progress period of 1 ms (`DEDLOC_PROGRESS_PERIOD`), so it sends its progress and stats events at
every micro-batch instead of once a second: each micro-batch stands for one second of a normal
worker's events, and a simulated day is 86,400 micro-batches. The micro-batches are counted from
the app's own stats database (samples / batch size).

Every `--every` seconds it samples the GUI process's RSS (not the worker's). After the warm-up
(`--warmup` minutes, default a fifth of the run) it fits RSS against micro-batches and prints,
last:

    gui growth MB per simulated day: X        (target: X <= 1)

    .venv/bin/python bench/app_soak.py                # 60 minutes
    .venv/bin/python bench/app_soak.py --minutes 10   # a shorter soak

Needs: xvfb openbox trayer xdotool x11-utils (apt).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path

import msgspec
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dedloc_core.catalog import Catalog, generate_keypair, load_private_key, public_key_line, sign_catalog  # noqa: E402
from dedloc_core.organizer.httpserve import FileServer  # noqa: E402
from dedloc_core.stats.db import StatsStore  # noqa: E402
from tests.desktop import stop, xvfb  # noqa: E402

BATCH = 2
SIMULATED_DAY = 86_400  # micro-batches: one a second at the default progress period of 1 s


def experiment() -> dict:
    manifest = json.loads(resources.files("resources").joinpath("corpus", "manifest.json").read_text())
    return {
        "id": "soak", "title": "Soak", "description": "bench/app_soak.py", "organizer": "bench",
        "recipe": "tiny-lm",
        "recipe_params": {"d_model": 32, "n_layers": 1, "n_heads": 1, "seq_len": 16, "warmup_steps": 0},
        "run_id": "soak_bench", "initial_peers": [], "target_batch_size": 4096, "batch_size_per_step": BATCH,
        "matchmaking_time": 2.0, "averaging_timeout": 15.0,
        "hardware": {"ram_gb": 1, "cpu_cores": 1, "disk_gb": 1, "gpu_required": False},
        "data": {"base_url": None, "shards": [{"url": f"data/{s['name']}", "sha256": s["sha256"], "size": s["size"]}
                                             for s in manifest["shards"][:1]]},
        "needs_token": False, "status": "active", "expires_at": None,
    }


def serve_catalog(server: FileServer, keys: Path) -> None:
    pem, _ = generate_keypair("soak", "soak")
    key = load_private_key(pem, "soak")
    keys.mkdir(parents=True, exist_ok=True)
    (keys / "soak.pub").write_text(public_key_line(key.public_key(), "soak") + "\n")
    now = datetime.now(UTC)
    catalog = msgspec.convert({"schema_version": 1, "catalog_id": "soak", "issued_at": now,
                               "expires_at": now + timedelta(days=2), "experiments": [experiment()]}, Catalog)
    server.add("/catalog.json", sign_catalog(catalog, key))


def micro_batches(db: Path) -> int:
    if not db.exists():
        return 0
    with StatsStore(db, compact=False) as store:
        return store.totals().samples // BATCH


def fit(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=None, help="minutes left out of the fit (default: a fifth)")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    args = parser.parse_args()
    warmup = args.minutes / 5 if args.warmup is None else args.warmup
    for tool in ("Xvfb", "openbox", "trayer", "xdotool"):
        if shutil.which(tool) is None:
            print(f"needs {tool} (apt-get install xvfb openbox trayer xdotool x11-utils)")
            return 2
    work = Path(tempfile.mkdtemp(prefix="dedloc-soak-"))
    home = work / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "preferences.json").write_text(json.dumps({
        "version": 1, "consent": True, "experiment_id": "soak", "idle_only": False, "other_cpu_limit": None}))
    db = home / "data" / "stats.sqlite3"
    samples: list[tuple[float, int, float]] = []  # (seconds since start, micro-batches, RSS MB)
    with resources.as_file(resources.files("resources").joinpath("corpus")) as corpus:
        server = FileServer()
        server.serve_dir("/data/", Path(corpus))
        serve_catalog(server, work / "keys")
        with server, xvfb(tray=True) as display:
            env = dict(os.environ, DISPLAY=display, DEDLOC_HOME=str(home), QT_QPA_PLATFORM="xcb",
                       DEDLOC_CATALOG_URL=f"{server.url}catalog.json", DEDLOC_TRUSTED_KEYS=str(work / "keys"),
                       DEDLOC_LISTEN="/ip4/127.0.0.1/tcp/0", DEDLOC_PROGRESS_PERIOD="0.001")
            app = subprocess.Popen([sys.executable, "-m", "dedloc_core.cli", "app", "--hidden"], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                proc = psutil.Process(app.pid)
                began = time.monotonic()
                end = began + args.minutes * 60
                while time.monotonic() < end:
                    time.sleep(args.every)
                    if app.poll() is not None:
                        print(f"the app exited with {app.returncode}")
                        return 1
                    row = (time.monotonic() - began, micro_batches(db), proc.memory_info().rss / 2**20)
                    samples.append(row)
                    print(f"{row[0]:7.0f} s  {row[1]:9d} micro-batches  {row[1] / SIMULATED_DAY:6.2f} sim. days  "
                          f"GUI RSS {row[2]:6.1f} MB", flush=True)
            finally:
                stop(app, 60)
                shutil.rmtree(work, ignore_errors=True)
    fitted = [(b, rss) for t, b, rss in samples if t >= warmup * 60]
    if len(fitted) < 3 or fitted[-1][0] == fitted[0][0]:
        print("too few samples after the warm-up (no training?)")
        return 1
    slope = fit([b for b, _ in fitted], [rss for _, rss in fitted])  # MB per micro-batch
    days = samples[-1][1] / SIMULATED_DAY
    print(f"length: {args.minutes:.0f} min, warm-up {warmup:.0f} min; {samples[-1][1]} micro-batches "
          f"= {days:.2f} simulated days; GUI RSS {fitted[0][1]:.1f} -> {fitted[-1][1]:.1f} MB after the warm-up")
    print(f"gui growth MB per simulated day: {slope * SIMULATED_DAY:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
