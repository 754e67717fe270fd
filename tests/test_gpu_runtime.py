"""The GPU runtime (``dedloc_core.gpu_runtime``): wheels from a real HTTP index, checked against a
pinned list, unpacked into a versioned folder, switched to atomically, with a way back. Small wheels
made here test the mechanism; the real CPU wheel of torch stands in for a CUDA build (slow): the
worker then imports torch from the runtime and says what it trains on."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import start_command

from dedloc_core import gpu_runtime
from dedloc_core.organizer.httpserve import FileServer

TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")


def make_wheel(folder: Path, name: str, version: str, body: str) -> Path:
    """A small wheel of package ``name`` (``__init__`` holding ``body``), one module in .data/purelib."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", body)
        archive.writestr(f"{name}-{version}.data/purelib/{name}_extra.py", "EXTRA = True\n")
        archive.writestr(f"{name}-{version}.data/scripts/{name}-tool", "#!/bin/sh\n")
        archive.writestr(f"{name}-{version}.dist-info/METADATA", f"Name: {name}\nVersion: {version}\n")
        archive.writestr("../escaped.py", "BAD = True\n")
    return path


def listing(path: Path, index: str, runtimes: dict[str, list[Path]], tamper: str = "") -> Path:
    machine = {"python": f"cp{sys.version_info.major}{sys.version_info.minor}", "machine": os.uname().machine}
    data = {"format": 1, "runtimes": [
        {"name": name, **machine, "index": index, "wheels": [
            {"file": w.name, "size": w.stat().st_size,
             "sha256": tamper or hashlib.sha256(w.read_bytes()).hexdigest()} for w in wheels]}
        for name, wheels in runtimes.items()]}
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def index(tmp_path):
    folder = tmp_path / "index"
    folder.mkdir()
    server = FileServer()
    server.serve_dir("/simple/", folder)
    with server:
        yield folder, server.url + "simple/"


def test_install_switches_atomically_and_rolls_back(index, tmp_path):
    folder, url = index
    one, two = make_wheel(folder, "gpupkg", "1.0", "V = 1\n"), make_wheel(folder, "gpupkg", "2.0", "V = 2\n")
    runtimes = gpu_runtime.load_list(listing(tmp_path / "list.json", url, {"rt-1": [one], "rt-2": [two]}))
    base = tmp_path / "runtime"
    seen = []
    first = gpu_runtime.install(runtimes[0], base, progress=lambda done, total: seen.append((done, total)))
    assert (first / "gpupkg" / "__init__.py").read_text() == "V = 1\n"
    assert (first / "gpupkg_extra.py").exists()  # .data/purelib lands at the top, as pip puts it
    assert not (first / "gpupkg-1.0.data").exists() and not (tmp_path / "escaped.py").exists()
    assert seen[-1] == (one.stat().st_size, one.stat().st_size)
    assert gpu_runtime.current(base) == first and gpu_runtime.previous(base) is None
    assert not (base / "downloads").exists() and not (base / "rt-1.partial").exists()

    second = gpu_runtime.install(runtimes[1], base)
    assert gpu_runtime.current(base) == second and gpu_runtime.previous(base) == first
    assert gpu_runtime.rollback(base) == "rt-1" and gpu_runtime.current(base) == first
    assert gpu_runtime.rollback(base) == "rt-2" and gpu_runtime.current(base) == second  # and forth
    gpu_runtime.use_bundled(base)
    assert gpu_runtime.current(base) is None and gpu_runtime.previous(base) == second
    assert gpu_runtime.install(runtimes[1], base) == second  # installed already: switched, not fetched


def test_a_wheel_that_is_not_the_pinned_one_is_refused_and_nothing_switches(index, tmp_path):
    folder, url = index
    good = make_wheel(folder, "gpupkg", "1.0", "V = 1\n")
    base = tmp_path / "runtime"
    gpu_runtime.install(gpu_runtime.load_list(listing(tmp_path / "a.json", url, {"rt-1": [good]}))[0], base)
    bad = gpu_runtime.load_list(listing(tmp_path / "b.json", url, {"rt-2": [good]}, tamper="0" * 64))[0]
    with pytest.raises(gpu_runtime.GpuRuntimeError) as refused:
        gpu_runtime.install(bad, base)
    assert refused.value.code == "gpu_hash" and "not the pinned file" in refused.value.message
    assert gpu_runtime.current(base).name == "rt-1"  # the runtime in use stays
    assert not (base / "rt-2").exists() and not list((base / "downloads").glob("*"))
    missing = gpu_runtime.Runtime("rt-3", "cp311", "x86_64", url, (gpu_runtime.Wheel("gone.whl", "0" * 64, 10),))
    with pytest.raises(gpu_runtime.GpuRuntimeError) as gone:
        gpu_runtime.install(missing, base)
    assert gone.value.code == "gpu_download" and gpu_runtime.current(base).name == "rt-1"
    (tmp_path / "broken.json").write_text('{"format": 1, "runtimes": [{"name": 3}]}')
    with pytest.raises(gpu_runtime.GpuRuntimeError, match="cannot be read"):
        gpu_runtime.load_list(tmp_path / "broken.json")


ACTIVATE = """
import sys
from pathlib import Path
import importlib.machinery
from dedloc_core import gpu_runtime

class Bundled:  # stands in for the frozen bundle's importer, which comes before the path finders
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] == "gpupkg":
            return importlib.machinery.PathFinder.find_spec(fullname, path or [sys.argv[2]])

sys.meta_path.insert(0, Bundled())
if sys.argv[1] == "activate":
    gpu_runtime.activate(Path(sys.argv[3]))
import gpupkg
print(gpupkg.V)
"""


def test_the_activated_runtime_comes_before_the_bundled_packages(index, tmp_path):
    folder, url = index
    bundled = tmp_path / "bundled"
    (bundled / "gpupkg").mkdir(parents=True)
    (bundled / "gpupkg" / "__init__.py").write_text("V = 'bundled'\n")
    wheel = make_wheel(folder, "gpupkg", "1.0", "V = 'runtime'\n")
    base = tmp_path / "runtime"
    gpu_runtime.install(gpu_runtime.load_list(listing(tmp_path / "l.json", url, {"rt-1": [wheel]}))[0], base)
    for mode, expected in (("activate", "runtime"), ("plain", "bundled")):
        out = subprocess.run([sys.executable, "-c", ACTIVATE, mode, str(bundled), str(base)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == expected, (mode, out.stderr[-2000:])


@pytest.mark.slow
def test_the_real_torch_wheel_installs_and_the_worker_trains_with_it(tmp_path, corpus_server, spawn_worker,
                                                                    monkeypatch):
    if not TORCH_WHEEL.is_file():
        pytest.skip(f"needs {TORCH_WHEEL} (the CPU wheel of torch this machine installs from)")
    server = FileServer()
    server.serve_dir("/wheels/", TORCH_WHEEL.parent)
    home = tmp_path / "w0"
    with server:
        pinned = listing(tmp_path / "list.json", server.url + "wheels/", {"torch-cpu-standin": [TORCH_WHEEL]})
        env = {**os.environ, "DEDLOC_HOME": str(home)}
        out = subprocess.run([sys.executable, "-m", "dedloc_core.cli", "gpu-runtime", "install", "--list", str(pinned)],
                             capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = home / "data" / "gpu-runtime" / "torch-cpu-standin"
    assert "In use: " + str(folder) in out.stdout
    assert (folder / "torch" / "bin" / "torch_shm_manager").stat().st_mode & 0o111  # executables stay so
    probe = subprocess.run([sys.executable, "-c", "from dedloc_core import gpu_runtime; gpu_runtime.activate(); "
                            "import torch; print(torch.__file__)"], capture_output=True, text=True, timeout=120,
                           env=env)
    assert probe.stdout.strip().startswith(str(folder)), probe.stderr[-2000:]

    monkeypatch.setenv("DEDLOC_TEST_LOG_LEVEL", "INFO")  # its log lines of INFO come through the protocol
    worker = spawn_worker("w0", home)  # trains with the runtime's torch, and says so
    assert worker.send(start_command(corpus_server, home))
    said = worker.wait_for(lambda e: e.type == "log" and e.message.startswith("GPU runtime "), 120)
    assert said is not None and said.message.endswith(f"from {folder / 'torch'}"), said
    progress = worker.wait_for(lambda e: e.type == "progress", 120)
    assert progress is not None, (home / "worker.log").read_text()[-3000:]
    assert (progress.gpu_runtime, progress.device, progress.device_note) == \
        ("torch-cpu-standin", "CPU", "GPU support not installed")

    back = subprocess.run([sys.executable, "-m", "dedloc_core.cli", "gpu-runtime", "rollback"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert back.returncode == 0 and "bundled torch" in back.stdout
    assert gpu_runtime.current(home / "data" / "gpu-runtime") is None and folder.is_dir()  # kept as the way back


def test_the_shipped_list_pins_a_runtime_for_this_python_with_public_checked_wheels():
    runtime = gpu_runtime.for_this_machine(gpu_runtime.load_list())
    if sys.version_info[:2] != (3, 11) or os.uname().machine != "x86_64":
        pytest.skip("the shipped runtime is for CPython 3.11 on x86_64, as the bundle is")
    assert runtime is not None and any(w.file.startswith("torch-") for w in runtime.wheels)
    for wheel in runtime.wheels:
        assert wheel.url.startswith("https://files.pythonhosted.org/"), wheel
        assert wheel.url.endswith(wheel.file.replace("+", "%2B")), wheel
        assert len(wheel.sha256) == 64 and int(wheel.sha256, 16) >= 0 and wheel.size > 0, wheel
