"""``swarm._warm_up_optim`` imports torch._dynamo on a thread while the DHT starts; a fork meanwhile
(hivemind forks its DHT and averagers) waits for the import, so no child inherits a half-imported
module and the import locks the thread holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import os, sys, threading
from dedloc_core.engine import swarm
if sys.argv[1] == "warm-up":
    swarm._warm_up_optim()  # begins importing torch._dynamo on a thread (about a second)
else:  # the same import on a thread the at-fork hook does not know of
    threading.Thread(target=swarm._import_dynamo, daemon=True).start()
pid = os.fork()  # as hivemind forks its DHT right after
if pid == 0:
    mod = sys.modules.get("torch._dynamo")
    print("complete" if mod is not None and hasattr(mod, "disable") else "partial", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


def probe(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_a_fork_during_the_warm_up_waits_for_the_import():
    assert probe("warm-up") == "complete"


def test_a_fork_during_an_unwatched_import_gets_a_half_imported_module():
    assert probe("plain") == "partial"
