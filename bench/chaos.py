"""Chaos soak in the network lab (root, Linux; see tests/netlab): crashes, a cut link, a full disk.

A real backbone (``dedloc backbone``, a checkpoint every global step) and four volunteers on the
lab's public segment. A volunteer is ``bench/chaos_volunteer.py``: the app's supervising side
without Qt (a real worker process, the real stats recorder writing the real SQLite file in its
``data`` folder). For ``--minutes`` (12; ``--short``: 3), beginning ``--settle`` s (60; 45) after the
swarm's first global step:

- every minute (at 0:30, 1:30, ...) v0 or v1, in turn, is killed with SIGKILL (the volunteer and
  its worker tree at once), its stats database is checked, and it is started again;
- once, v3's link is cut for 30 s;
- once, v2's ``data`` folder (a 16 MB tmpfs holding its stats database) is filled to the last byte
  for ``--full-seconds``, then freed.

Checks: the backbone's global step advances with no gap longer than ``--stall`` s; every checkpoint
the backbone wrote (each version is hard-linked as it appears) loads into the model; each volunteer's
database opens, passes ``PRAGMA integrity_check`` and holds every ``stats`` event the volunteer
received before the kill, minus at most those of the last 2 s (a lost row: an event whose totals
the database does not reach); v2 and v3, stopped gracefully at the end, hold every event; the
long-lived peers (backbone, v2, v3) grow their memory (``heap_mb`` summed over each process tree)
by less than 200 MB in total between the start of the chaos and its end. Last line:
``chaos: N kills, M link cuts, steps advanced S, lost rows L, corrupt checkpoints C, memory growth G MB``.
Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from conftest import tiny_experiment  # noqa: E402
from netlab import Lab  # noqa: E402
from netlab.lab import Host  # noqa: E402
from netlab.peers import Backbone  # noqa: E402

from dedloc_core.stats.db import StatsStore  # noqa: E402

GRACE = 2.0  # seconds of events a crash may lose
MEMORY_LIMIT_MB = 200
TMPFS = "16m"


@dataclass
class Volunteer:
    name: str
    host: Host
    home: Path
    proc: subprocess.Popen | None = None
    events: list[dict] = field(default_factory=list)  # this incarnation's lines
    lock: threading.Lock = field(default_factory=threading.Lock)
    base: tuple[int, float] = (0, 0.0)  # (samples, cpu s) in the database when this incarnation began
    incarnations: int = 0

    @property
    def db(self) -> Path:
        return self.home / "data" / "stats.sqlite3"

    def lines(self) -> list[dict]:
        with self.lock:
            return list(self.events)

    def step(self) -> int:
        return max((e["step"] for e in self.lines() if e["kind"] == "progress"), default=0)


class Chaos:
    def __init__(self, args, lab: Lab, folder: Path):
        self.args, self.lab, self.folder = args, lab, folder
        self.exp = tiny_experiment(id="chaos", run_id="chaos_run", target_batch_size=args.target_batch,
                                   averaging_timeout=15.0, matchmaking_time=2.0)
        self.exp_file = folder / "experiment.json"
        self.exp_file.write_text(json.dumps(self.exp))
        self.log = (folder / "chaos.log").open("w")
        self.kills = self.cuts = self.lost = self.tail = self.overcounted = 0
        self.problems: list[str] = []
        self.snapshots: list[Path] = []
        self._ckpt_ino: int | None = None
        self.mounted: list[Path] = []
        self.timeline: list[tuple[float, int, dict[str, float]]] = []
        self._next_sample = 0.0

    def say(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        print(line, file=sys.stderr, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    # ---- the swarm ---------------------------------------------------------------------------------

    def start(self) -> None:
        self.backbone = Backbone(self.lab, self.lab.public("bb"), self.exp, self.folder, "--checkpoint-every", "1")
        self.ready = self.backbone.wait_ready(240)
        self.ready_file = self.folder / "ready.json"
        self.ready_file.write_text(json.dumps(self.ready))
        self.volunteers = [Volunteer(f"v{i}", self.lab.public(f"v{i}"), self.folder / f"v{i}") for i in range(4)]
        for v in self.volunteers:
            (v.home / "data").mkdir(parents=True)
        disk = self.volunteers[2]
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS}", "tmpfs", str(disk.home / "data")], check=True)
        self.mounted.append(disk.home / "data")
        for v in self.volunteers:
            self.launch(v)

    def launch(self, v: Volunteer) -> None:
        v.incarnations += 1
        with v.lock:
            v.events = []
        v.proc = self.lab.popen(v.host, [sys.executable, str(ROOT / "bench" / "chaos_volunteer.py"), str(self.exp_file),
                                         str(self.ready_file), f"chaos {v.name}"],
                                stdout=subprocess.PIPE, stderr=(v.home / "volunteer.log").open("a"), text=True,
                                env={**os.environ, "DEDLOC_HOME": str(v.home), "PYTHONPATH": str(ROOT)})
        threading.Thread(target=self._read, args=(v, v.proc), daemon=True).start()

    def _read(self, v: Volunteer, proc: subprocess.Popen) -> None:
        journal = (v.home / "journal.jsonl").open("a")
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            journal.write(line)
            journal.flush()
            with v.lock:
                if v.proc is proc:
                    v.events.append(event)
            if event["kind"] in ("error", "exit", "stats_off"):
                self.say(f"{v.name}: {event}")

    def kill(self, v: Volunteer) -> None:
        """SIGKILL the volunteer and its whole tree at once, check its database, start it again."""
        tree = [v.proc.pid]
        try:
            tree += [c.pid for c in psutil.Process(v.proc.pid).children(recursive=True)]
        except psutil.Error:
            pass
        t_kill = time.time()
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        v.proc.wait(10)
        time.sleep(0.5)  # the reader thread takes the last lines
        self.kills += 1
        db = self.check_db(v, t_kill, f"kill {self.kills}")
        if db is not None:
            v.base = db  # the next incarnation adds to what is there
        self.launch(v)

    def check_db(self, v: Volunteer, until: float, what: str, grace: float = GRACE) -> tuple[int, float] | None:
        """Every stats event received before ``until - grace`` must be in ``v``'s database."""
        try:
            with StatsStore(v.db, compact=False) as store:
                check = store.db.execute("PRAGMA integrity_check").fetchone()[0]
                totals = store.totals(experiment=self.exp["id"])
        except Exception as exc:  # a database that does not open is the finding
            self.problems.append(f"{v.name} ({what}): the stats database does not open: {exc}")
            self.say(self.problems[-1])
            return None
        if check != "ok":
            self.problems.append(f"{v.name} ({what}): integrity_check: {check}")
        db = (totals.samples, totals.cpu_seconds)
        events = v.lines()
        lost = tail = 0
        done = (0, 0.0)  # totals of this incarnation's earlier workers
        current = (0, 0.0)
        last_cum = v.base
        for e in events:
            if e["kind"] == "hello":
                done = (done[0] + current[0], done[1] + current[1])
                current = (0, 0.0)
            elif e["kind"] == "stats":
                current = (e["samples"], e["cpu"])
                cum = (v.base[0] + done[0] + current[0], v.base[1] + done[1] + current[1])
                last_cum = cum
                held = db[0] >= cum[0] and db[1] >= cum[1] - 1e-6
                if not held and e["t"] <= until - grace:
                    lost += 1
                elif not held:
                    tail += 1
        if db[0] > last_cum[0]:
            self.overcounted += 1
            self.problems.append(f"{v.name} ({what}): the database holds {db[0]} samples, more than the "
                                 f"{last_cum[0]} reported")
        stats = sum(e["kind"] == "stats" for e in events)
        self.lost += lost
        self.tail += tail
        self.say(f"{v.name} {what}: db {check}, {stats} stats events since its start, {lost} lost, {tail} of the "
                 f"last {grace:.0f} s not held; db samples {db[0]} (reported {last_cum[0]})")
        return db

    # ---- faults ------------------------------------------------------------------------------------

    def fill(self, v: Volunteer) -> Path:
        filler = v.home / "data" / "filler"
        self.say(f"{v.name}: data folder before filling: {listing(v.home / 'data')}")
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        size = 65536
        try:
            while size:
                try:
                    os.write(fd, b"\0" * size)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    size //= 2
        finally:
            os.close(fd)
        usage = os.statvfs(v.home / "data")
        self.say(f"{v.name}: data folder full ({usage.f_bavail} blocks free)")
        return filler

    # ---- measuring ---------------------------------------------------------------------------------

    def poll_checkpoint(self) -> None:
        path = self.folder / "backbone" / "checkpoint.pt"
        try:
            ino = path.stat().st_ino
            if ino != self._ckpt_ino:
                snap = self.folder / "checkpoints" / f"{len(self.snapshots):04d}.pt"
                snap.parent.mkdir(exist_ok=True)
                os.link(path, snap)
                self._ckpt_ino = ino
                self.snapshots.append(snap)
        except FileNotFoundError:
            pass

    def curve(self) -> list[tuple[float, int]]:
        path = self.folder / "backbone" / "learning_curve.jsonl"
        out = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    out.append((entry["time"], entry["step"]))
                except (ValueError, KeyError):
                    continue
        return out

    def global_step(self) -> int:
        curve = self.curve()
        return curve[-1][1] if curve else 0

    def memory(self) -> dict[str, float]:
        """Each long-lived peer's process tree's heap and shared tensors in MB (``heap_mb``); each
        process in the log."""
        roots = {"backbone": self.backbone.proc.pid, "v2": self.volunteers[2].proc.pid,
                 "v3": self.volunteers[3].proc.pid}
        out, detail = {}, []
        for name, pid in roots.items():
            total = 0
            try:
                root = psutil.Process(pid)
                for p in [root, *root.children(recursive=True)]:
                    try:
                        mb = heap_mb(p.pid)
                        total += mb
                        detail.append(f"{name}/{p.pid}:{p.name()} {mb:.0f}")
                    except (psutil.Error, OSError):
                        pass
            except psutil.Error:
                pass
            out[name] = total
        self.log.write(f"memory {time.time():.0f}: " + ", ".join(detail) + "\n")
        return out

    def sample(self) -> None:
        """Every 30 s: the global step and the long-lived peers' memory (the run's timeline)."""
        if time.monotonic() >= self._next_sample:
            self._next_sample = time.monotonic() + 30
            self.timeline.append((time.time(), self.global_step(), self.memory()))

    def wait(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.poll_checkpoint()
            if self.timeline:
                self.sample()
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))

    # ---- the run -----------------------------------------------------------------------------------

    def run(self) -> int:
        began = time.monotonic()
        self.say("starting the backbone and four volunteers")
        self.start()
        deadline = time.monotonic() + self.args.warmup
        while not (all(v.step() >= 1 for v in self.volunteers) and self.global_step() >= 1):
            if time.monotonic() > deadline:
                raise RuntimeError("the swarm did not reach its first global step:\n"
                                   + "\n".join(f"{v.name}: step {v.step()}" for v in self.volunteers))
            self.wait(1)
        self.say(f"first global step after {time.monotonic() - began:.0f} s; settling for {self.args.settle:.0f} s")
        self.sample()
        self.wait(self.args.settle)
        step0, t0 = self.global_step(), time.time()
        mem0 = self.memory()
        self.say(f"chaos begins at global step {step0}; memory {fmt(mem0)}")
        plan = self.plan()
        start = time.monotonic()
        for at, action, what in plan:
            self.wait(at - (time.monotonic() - start))
            self.say(f"t={time.monotonic() - start:5.0f} s  {what}  (global step {self.global_step()})")
            action()
        self.wait(self.args.minutes * 60 - (time.monotonic() - start))
        step1, t1 = self.global_step(), time.time()
        mem1 = self.memory()
        self.say(f"chaos over at global step {step1}; memory {fmt(mem1)}")
        self.finish()
        return self.report(step0, t0, step1, t1, mem0, mem1)

    def plan(self) -> list[tuple[float, object, str]]:
        minutes, v = self.args.minutes, self.volunteers
        plan = [(30 + 60 * k, (lambda k=k: self.kill(v[k % 2])), f"SIGKILL {v[k % 2].name}")
                for k in range(minutes) if 30 + 60 * k < minutes * 60]
        cut_at = 60 if self.args.short else 210
        plan += [(cut_at, lambda: self.cut(v[3], True), "cut v3's link"),
                 (cut_at + 30, lambda: self.cut(v[3], False), "restore v3's link")]
        full_at = 100 if self.args.short else 330
        plan += [(full_at, lambda: self.set_full(v[2], True), "fill v2's data folder"),
                 (full_at + self.args.full_seconds, lambda: self.set_full(v[2], False), "free v2's data folder")]
        return sorted(plan, key=lambda p: p[0])

    def cut(self, v: Volunteer, down: bool) -> None:
        if down:
            self.lab.cut(v.host)
            self.cuts += 1
        else:
            self.lab.restore(v.host)

    def set_full(self, v: Volunteer, full: bool) -> None:
        if full:
            self.filler = self.fill(v)
            return
        self.filler.unlink()
        time.sleep(3)  # the recorder's next commit
        log = (v.home / "volunteer.log").read_text(errors="replace")
        retries = log.count("Could not write statistics")
        self.say(f"{v.name}: data folder freed; the recorder logged {retries} error line(s) meanwhile "
                 f"({_first(log, 'Could not write statistics')}); worker exits: "
                 f"{sum(e['kind'] == 'exit' for e in v.lines())}")
        self.check_db(v, time.time(), "3 s after the full disk")  # it runs on: what came 2 s before now is in

    def finish(self) -> None:
        """Stop the volunteers gracefully (v2's and v3's databases must then hold every event), then
        the backbone (it writes a last checkpoint)."""
        for v in self.volunteers:
            v.proc.send_signal(signal.SIGTERM)
        for v in self.volunteers:
            try:
                v.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.problems.append(f"{v.name} did not stop within 60 s of SIGTERM")
        time.sleep(0.5)
        for v in self.volunteers[2:]:
            self.check_db(v, time.time() + GRACE, "graceful stop")
        self.backbone.proc.send_signal(signal.SIGTERM)
        try:
            self.backbone.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.problems.append("the backbone did not stop within 60 s of SIGTERM")
        self.poll_checkpoint()

    def report(self, step0, t0, step1, t1, mem0, mem1) -> int:
        corrupt = check_checkpoints(self.snapshots, self.exp)
        for name, problem in corrupt:
            self.problems.append(f"checkpoint {name}: {problem}")
        curve = [(t, s) for t, s in self.curve() if t0 <= t <= t1]
        times = [t0] + [t for (t, s), (_, prev) in zip(curve[1:], curve, strict=False) if s > prev] + [t1]
        stall = max(b - a for a, b in zip(times, times[1:], strict=False))
        growth = {k: mem1.get(k, 0.0) - mem0.get(k, 0.0) for k in mem0}
        total_growth = sum(growth.values())
        steps = step1 - step0
        if steps <= 0 or stall > self.args.stall:
            self.problems.append(f"the global step stalled: {steps} steps, longest gap {stall:.0f} s")
        if self.lost:
            self.problems.append(f"{self.lost} stats events lost")
        if total_growth >= MEMORY_LIMIT_MB:
            self.problems.append(f"memory grew by {total_growth:.0f} MB")
        print(f"global steps: {step0} -> {step1} over {t1 - t0:.0f} s; longest gap between steps {stall:.0f} s")
        print(f"checkpoints written and checked: {len(self.snapshots)}, corrupt {len(corrupt)}")
        print(f"stats events lost {self.lost}; in the last {GRACE:.0f} s before a kill and not held {self.tail}; "
              f"over-counted databases {self.overcounted}")
        print("memory (heap + shared tensors of the process tree, MB): " + ", ".join(
            f"{k} {mem0[k]:.0f} -> {mem1.get(k, 0):.0f} ({growth[k]:+.0f})" for k in mem0))
        print("timeline (s after the first global step: global step, memory MB backbone/v2/v3):")
        first = self.timeline[0][0] if self.timeline else t0
        print("  " + "; ".join(f"{t - first:.0f}: {step}, {'/'.join(f'{m:.0f}' for m in mem.values())}"
                               for t, step, mem in self.timeline))
        for p in self.problems:
            print(f"PROBLEM: {p}")
        print(f"chaos: {self.kills} kills, {self.cuts} link cuts, steps advanced {steps}, lost rows {self.lost}, "
              f"corrupt checkpoints {len(corrupt)}, memory growth {total_growth:.0f} MB")
        return 1 if self.problems else 0

    def close(self) -> None:
        for path in self.mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def check_checkpoints(snapshots: list[Path], exp: dict) -> list[tuple[str, str]]:
    """Load every checkpoint into the experiment's model: [(name, problem)] for those that fail."""
    import torch

    from dedloc_core.engine.recipes import load_recipe

    recipe = load_recipe(exp["recipe"], exp["recipe_params"])
    bad, last_epoch = [], -1
    for snap in snapshots:
        try:
            state = torch.load(snap, map_location="cpu", weights_only=True)
            recipe.build_model(seed=0).load_state_dict(state["model"])
            if not isinstance(state["optimizer"], dict) or state["epoch"] < last_epoch:
                raise ValueError(f"optimizer state or epoch wrong (epoch {state['epoch']} after {last_epoch})")
            last_epoch = state["epoch"]
        except Exception as exc:  # any failure is a corrupt checkpoint
            bad.append((snap.name, f"{type(exc).__name__}: {exc}"))
    return bad


def heap_mb(pid: int) -> float:
    """A process's share of anonymous and shared memory (``Pss_Anon + Pss_Shmem``): summed over a tree
    it is the RAM the tree's heaps and shared tensors take, pages shared after a fork counted once.
    Not USS (a page a forked child copies leaves the parent's original private: counted twice) nor
    plain PSS (it moves when other processes on the machine map torch's libraries)."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Pss_Anon", "Pss_Shmem"):
                fields[key] = int(rest.split()[0])
    return sum(fields.values()) / 1024


def listing(folder: Path) -> str:
    usage = os.statvfs(folder)
    files = ", ".join(f"{p.name} {p.stat().st_size // 1024} kB" for p in sorted(folder.iterdir()))
    return f"{files}; {usage.f_bavail * usage.f_frsize // 1024} kB free"


def fmt(mem: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f} MB" for k, v in mem.items())


def _first(text: str, needle: str) -> str:
    for line in text.splitlines():
        if needle in line:
            return line.split(needle, 1)[1].strip()[:120]
    return "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="3 minutes of chaos (about 5 minutes in all)")
    parser.add_argument("--minutes", type=int, default=None, help="minutes of chaos (default 12; --short: 3)")
    parser.add_argument("--full-seconds", type=float, default=None, help="how long v2's disk stays full "
                        "(default 90; --short: 40)")
    parser.add_argument("--target-batch", type=int, default=1024, help="samples per global step")
    parser.add_argument("--stall", type=float, default=150.0, help="longest gap between global steps allowed")
    parser.add_argument("--warmup", type=float, default=420.0, help="seconds allowed to the first global step")
    parser.add_argument("--settle", type=float, default=None, help="seconds between the first global step and "
                        "the chaos (memory is measured from there; default 60, --short: 45)")
    parser.add_argument("--keep", type=Path, default=None, help="keep logs, databases and checkpoints here")
    args = parser.parse_args(argv)
    args.minutes = args.minutes or (3 if args.short else 12)
    args.settle = args.settle if args.settle is not None else (45.0 if args.short else 60.0)
    args.full_seconds = args.full_seconds or (40.0 if args.short else 90.0)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        folder_cm = None
        folder = args.keep
    else:
        folder_cm = tempfile.TemporaryDirectory(prefix="chaos-")
        folder = Path(folder_cm.name)
    chaos = None
    try:
        with Lab() as lab:
            chaos = Chaos(args, lab, folder)
            try:
                return chaos.run()
            finally:
                lab.close()
                chaos.close()
    finally:
        if folder_cm is not None:
            folder_cm.cleanup()


if __name__ == "__main__":
    sys.exit(main())
