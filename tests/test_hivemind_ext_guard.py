"""hivemind_ext as a whole: the install order against ``WRAPS`` (declared, and found by installing
one extension at a time), the version guard, and the extensions shown with and without here
(``child_lifetime``, ``optimizer_client_mode``, ``socket_dir``). Every probe is a fresh
interpreter: the extensions are never installed in pytest's process (``conftest`` checks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from probes import ROOT, probe_json

from dedloc_core.engine import hivemind_ext

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast


def test_the_install_order_installs_what_an_extension_wraps_first():
    hivemind_ext.check_order()
    order = list(hivemind_ext.ORDER)
    order.remove("bandwidth_caps")
    order.append("bandwidth_caps")  # after traffic_count, which wraps it
    with pytest.raises(ValueError, match="traffic_count wraps bandwidth_caps"):
        hivemind_ext.check_order(order)


def test_an_unknown_extension_cannot_be_skipped():
    with pytest.raises(ValueError, match="no extension named"):
        hivemind_ext.install(skip=("no_such_extension",))
    assert hivemind_ext.installed() == ()


# Installs the extensions one at a time (the helpers as threads too, so every one changes all it
# can) and prints, for each attribute of hivemind (and asyncio) that more than one changed, who did.
OVERLAPS = """
import asyncio, importlib, json, sys
from dedloc_core.engine import hivemind_ext
import hivemind, hivemind.compression.quantization, hivemind.p2p.p2p_daemon_bindings.control
import hivemind.optim.state_averager

def owners():
    objs = {"asyncio": asyncio, "StreamReaderProtocol": asyncio.streams.StreamReaderProtocol}
    for name, mod in list(sys.modules.items()):
        if name.startswith("hivemind") and mod is not None:
            objs[name] = mod
            for value in list(vars(mod).values()):
                if isinstance(value, type) and value.__module__ == name:
                    objs[f"{name}.{value.__qualname__}"] = value
    return objs

def snapshot(objs):
    return {f"{where}.{attr}": id(value) for where, obj in objs.items() for attr, value in list(vars(obj).items())}

objs = owners()
touched = {}
for name in hivemind_ext.ORDER:
    before = snapshot(objs)
    importlib.import_module(f"dedloc_core.engine.hivemind_ext.{name}").install()
    after = snapshot(objs)
    for key, value in after.items():
        if before.get(key) != value:
            touched.setdefault(key, []).append(name)
print(json.dumps({key: names for key, names in touched.items() if len(names) > 1}))
"""


def test_every_attribute_two_extensions_change_is_a_declared_wrap():
    env = {**os.environ, "DEDLOC_HELPER_THREADS": "all"}
    out = subprocess.run([sys.executable, "-c", OVERLAPS], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    shared = json.loads(out.stdout.strip().splitlines()[-1])
    assert shared, "no attribute changed twice: the probe no longer sees what the extensions change"
    for key, names in shared.items():
        for inner, outer in zip(names, names[1:], strict=False):
            assert hivemind_ext.WRAPS.get(outer) == inner, f"{outer} and {inner} both change {key}: declare it"


VERSION = """
import asyncio, json, sys
import hivemind
hivemind.__version__ = "1.2.0"
from dedloc_core.engine import hivemind_ext
from dedloc_core.errors import DedlocError, user_message
create_task = asyncio.create_task
try:
    hivemind_ext.install()
except DedlocError as exc:
    message = user_message(exc)
    print(message.text())
    print(json.dumps(dict(code=message.code, exit=message.exit_code, installed=list(hivemind_ext.installed()),
                          create_task=asyncio.create_task is create_task)))
"""


def test_another_hivemind_version_is_refused_before_anything_changes():
    out = subprocess.run([sys.executable, "-c", VERSION], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    *text, last = out.stdout.strip().splitlines()
    got = json.loads(last)
    assert got == dict(code="hivemind_version", exit=3, installed=[], create_task=True), got
    text = "\n".join(text)
    assert text.startswith("Unsupported hivemind version: hivemind 1.2.0 is installed"), text
    assert "written for hivemind 1.1.12" in text and "pip install hivemind==1.1.12" in text, text


# child_lifetime: a peer (a DHT: its forked process and its p2pd) whose parent is killed.
LIFETIME = """
import json, sys, time, psutil, hivemind
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=sys.argv[1:])
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
helper = psutil.Process(dht.pid)
print(json.dumps([dht.pid] + [p.pid for p in helper.children(recursive=True)]), flush=True)
time.sleep(120)
"""


def orphans_after_kill(*skip: str) -> list[psutil.Process]:
    """The helpers of a killed peer still running 5 s after its SIGKILL (at least the DHT and p2pd)."""
    proc = subprocess.Popen([sys.executable, "-c", LIFETIME, *skip], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert len(pids) >= 2, pids  # the DHT's process and its p2pd
    helpers = [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(helpers, timeout=5)
    return alive


def test_a_killed_peers_helpers_die_with_it():
    assert orphans_after_kill() == []


def test_without_child_lifetime_a_killed_peers_helpers_linger():
    alive = orphans_after_kill("child_lifetime")
    names = sorted(p.name() for p in alive)
    for proc in alive:
        proc.kill()
    psutil.wait_procs(alive, timeout=5)
    assert any("p2pd" in name for name in names), names


# optimizer_client_mode: an Optimizer asked for client-mode averagers, on a DHT that is not a client.
CLIENT_MODE = """
import json, sys, torch, hivemind
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=sys.argv[1:])
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
model = torch.nn.Linear(2, 1)
opt = hivemind.Optimizer(dht=dht, run_id="client_mode", params=model.parameters(), target_batch_size=8,
                         batch_size_per_step=4, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), client_mode=True)
print(json.dumps(dict(dht=dht.client_mode, state=opt.state_averager.client_mode, grad=opt.grad_averager.client_mode)))
opt.shutdown()
dht.shutdown()
"""


def test_an_optimizers_averagers_take_the_client_mode_it_is_given():
    assert probe_json(CLIENT_MODE, timeout=120) == dict(dht=False, state=True, grad=True)


def test_without_optimizer_client_mode_the_averagers_take_the_dhts_mode():
    assert probe_json(CLIENT_MODE, "optimizer_client_mode", timeout=120) == dict(dht=False, state=False, grad=False)


# socket_dir: where a DHT's unix sockets go with DEDLOC_SOCKET_DIR set (a folder the supervisor owns).
SOCKETS = """
import json, pathlib, sys, hivemind
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=sys.argv[2:])
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
print(json.dumps(sorted(p.name.split("-")[1] for p in pathlib.Path(sys.argv[1]).iterdir())))
dht.shutdown()
"""


def sockets_in_folder(*skip: str) -> list[str]:
    from dedloc_core.workerproc import SOCKET_DIR_ENV

    folder = tempfile.mkdtemp(prefix="hx")  # short: a unix socket's path holds at most 107 bytes
    env = {**os.environ, SOCKET_DIR_ENV: folder}
    out = subprocess.run([sys.executable, "-c", SOCKETS, folder, *skip], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    time.sleep(0.1)
    for leftover in Path(folder).iterdir():
        leftover.unlink()
    Path(folder).rmdir()
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_dhts_sockets_go_in_the_supervisors_folder():
    assert sockets_in_folder() == ["p2pclient", "p2pd"]


def test_without_socket_dir_the_sockets_go_elsewhere():
    assert sockets_in_folder("socket_dir") == []


def test_every_extension_is_small_and_says_what_it_is():
    import ast

    folder = ROOT / "dedloc_core/engine/hivemind_ext"
    for name in hivemind_ext.ORDER:
        path = folder / f"{name}.py"
        text = path.read_text()
        assert len(text.splitlines()) <= 200, f"{name}: over 200 lines"
        doc = ast.get_docstring(ast.parse(text)) or ""
        assert "Upstream:" in doc and "Without it:" in doc and "Fix:" in doc, name
        assert "Kind: bug fix (belongs upstream; docs/hivemind/" in doc or "Kind: our policy" in doc, name
        assert "Shown:" in doc or "Not shown without:" in doc, name
