"""The installers, for real: build the bundle, the .deb and the .tar.gz once with
installers/build_linux.sh, run the bundle's self-test, and check the packages' contents.

Marked ``installer`` (deselected by default; ``make installer-test`` runs it, a few minutes of CPU).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest

from dedloc_core.errors import EXIT_EXPLAINED

pytestmark = [pytest.mark.installer, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "dist"
BUNDLE = DIST / "dedloc"
EXE = BUNDLE / "dedloc"
NAME = "dedloc-volunteer"


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.fixture(scope="module")
def built() -> dict[str, Path]:
    """Run the one build command; every test below checks what it made."""
    if not shutil.which("dpkg-deb"):
        pytest.skip("dpkg-deb is not installed (the .deb needs it)")
    env = {**os.environ, "PYTHON": sys.executable}
    began = time.monotonic()
    out = subprocess.run(["bash", "installers/build_linux.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1500)
    took = time.monotonic() - began
    assert out.returncode == 0, f"build failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    debs = list(DIST.glob(f"{NAME}_*.deb"))
    tgzs = list(DIST.glob(f"{NAME}-*-linux-*.tar.gz"))
    assert EXE.is_file() and os.access(EXE, os.X_OK) and len(debs) == 1 and len(tgzs) == 1, out.stdout
    print(f"\n{out.stdout.strip()}\nbuild_linux.sh took {took:.0f} s; bundle {_size(BUNDLE) / 2**20:.0f} MiB, "
          f".deb {_size(debs[0]) / 2**20:.0f} MiB, .tar.gz {_size(tgzs[0]) / 2**20:.0f} MiB")
    return {"deb": debs[0], "tgz": tgzs[0]}


def run_exe(*args: str, exe: Path = EXE, timeout: float = 120, home: Path | None = None, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(QT_QPA_PLATFORM="offscreen")
    if home is not None:
        env["DEDLOC_HOME"] = str(home)
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=env, **kw)


def test_bundle_carries_the_worker_p2pd_and_resources(built):
    internal = BUNDLE / "_internal"
    p2pd = internal / "hivemind" / "hivemind_cli" / "p2pd"
    assert p2pd.is_file() and os.access(p2pd, os.X_OK)
    assert list((internal / "hivemind" / "proto").glob("*.proto"))
    assert (internal / "torch" / "bin" / "torch_shm_manager").is_file()
    for part in ("catalog/default.json", "trusted_keys/dedloc-project-2026.pub", "corpus/manifest.json",
                 "corpus/shard-000.txt", "icons/dedloc-volunteer.svg", "icons/dedloc-volunteer-256.png"):
        assert (internal / "resources" / part).is_file(), part
    # What the size diet leaves out.
    assert not (internal / "torch" / "include").exists()
    assert not (internal / "torch" / "test").exists()
    assert not list(internal.rglob("PySide6/Qt/translations/*.qm"))


def test_cli_and_app_entry_points(built, tmp_path):
    out = run_exe("--version")
    assert out.returncode == 0 and out.stdout.startswith("dedloc "), out.stderr
    out = run_exe("app", "--help")  # imports the Qt app (PySide6 in the bundle)
    assert out.returncode == 0 and "--hidden" in out.stdout, out.stderr[-2000:]
    out = run_exe("stats", home=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    out = run_exe("--catalog-child", home=tmp_path)  # how the frozen app checks the catalog
    assert out.returncode == 0, out.stderr[-2000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["source"] == "default" and answer["error"] is None and "tiny-lm-demo" in answer["catalog"]


def test_no_arguments_starts_the_tray_app_without_torch(built, tmp_path):
    """The launcher runs the executable with no arguments: the Qt app starts (offscreen here), does
    not load torch, and quits cleanly on SIGTERM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(QT_QPA_PLATFORM="offscreen", DEDLOC_HOME=str(tmp_path))
    proc = subprocess.Popen([str(EXE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = tmp_path / "log" / "app.log"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not log.exists():
            time.sleep(0.5)
        time.sleep(3)  # let it settle: window, catalog, stats
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "PySide6/Qt/lib/libQt6Widgets" in maps
        assert "libtorch_cpu" not in maps, "the GUI process loaded torch"
        assert "catalog child failed" not in log.read_text()
        rss_mb = psutil.Process(proc.pid).memory_info().rss / 2**20
        print(f"frozen app, idle: {rss_mb:.0f} MB resident")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_self_test_trains_alone_and_exits_zero(built, tmp_path):
    before = {p.pid for p in psutil.process_iter()}
    out = run_exe("--self-test", "--keep", str(tmp_path / "st"), timeout=600, home=tmp_path / "home")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-4000:]}"
    print(out.stdout)
    assert "frozen build" in out.stdout
    for step in ("catalog", "hardware", "data", "worker", "DHT", "training", "stop"):
        assert f"ok  {step}" in out.stdout, out.stdout
    assert "/ip4/127.0.0.1/" in out.stdout
    # The worker was this executable re-run with --worker, and nothing of it is left running.
    time.sleep(1)
    left = []
    for proc in psutil.process_iter(["pid", "cmdline", "exe"]):
        if proc.pid in before:
            continue
        cmd = " ".join(proc.info["cmdline"] or [])
        if str(BUNDLE) in cmd:  # p2pd too: it runs from the bundle
            left.append(cmd)
    assert not left, left


def test_self_test_trains_the_albert_recipe(built, tmp_path):
    """transformers is imported lazily by the albert-mlm recipe: the bundle must carry it."""
    out = run_exe("--self-test", "--experiment", "albert-mlm-tiny", "--steps", "1", timeout=600, home=tmp_path)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-4000:]}"
    assert "ok  training: 1 global step of albert-mlm alone" in out.stdout, out.stdout


@pytest.mark.parametrize("kind,family", [("causal", "llama"), ("masked", "bert")])
def test_an_organizers_declared_experiment_trains_in_the_bundle(built, tmp_path, kind, family):
    """The frozen ``data prepare`` (tokenizers) makes the shards; the frozen self-test builds the
    declared transformers model (imported by name through transformers' lazy module) and trains it."""
    from test_selftest import organizers_catalog

    options, recipe = organizers_catalog(tmp_path, kind, family,
                                         lambda *args: run_exe(*args, timeout=300, home=tmp_path / "home"))
    out = run_exe("--self-test", *options, "--steps", "1", timeout=600, home=tmp_path / "home")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-4000:]}"
    assert f"ok  training: 1 global step of {recipe} alone" in out.stdout, out.stdout


def test_self_test_fails_clearly(built, tmp_path):
    out = run_exe("--self-test", "--timeout", "0.5", timeout=120, home=tmp_path)
    assert out.returncode == EXIT_EXPLAINED
    assert "Self-test failed at: worker" in out.stderr or "Timed out" in out.stderr, out.stderr


def test_deb_contents_and_scratch_install(built, tmp_path):
    deb = built["deb"]
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    for path in ("./opt/dedloc-volunteer/dedloc", "./opt/dedloc-volunteer/_internal/hivemind/hivemind_cli/p2pd",
                 "./usr/bin/dedloc -> ../../opt/dedloc-volunteer/dedloc",
                 "./usr/share/applications/dedloc-volunteer.desktop",
                 "./usr/share/icons/hicolor/256x256/apps/dedloc-volunteer.png",
                 "./usr/share/icons/hicolor/scalable/apps/dedloc-volunteer.svg"):
        assert path in listing, path
    assert "root/root" in listing.splitlines()[0]
    control = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version", "Depends"],
                             capture_output=True, text=True, check=True).stdout
    assert "Package: dedloc-volunteer" in control and "Version: 0." in control
    # The glibc the bundle's libraries ask for: at least 2.17, at most the build machine's own.
    needed = re.search(r"libc6 \(>= ([0-9.]+)\)", control)
    here = subprocess.run(["ldd", "--version"], capture_output=True, text=True).stdout.split("\n")[0].split()[-1]
    assert needed, control
    assert (2, 17) <= tuple(map(int, needed[1].split("."))) <= tuple(map(int, here.split("."))), (needed[1], here)

    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    out = run_exe("--version", exe=root / "usr" / "bin" / "dedloc")  # through the /usr/bin symlink
    assert out.returncode == 0 and out.stdout.startswith("dedloc "), out.stderr

    desktop = root / "usr" / "share" / "applications" / "dedloc-volunteer.desktop"
    text = desktop.read_text()
    assert "Exec=/opt/dedloc-volunteer/dedloc app %u\n" in text and "Icon=dedloc-volunteer\n" in text
    assert "MimeType=x-scheme-handler/dedloc;\n" in text  # an organizer's dedloc://add link opens the app
    assert (root / "opt" / "dedloc-volunteer" / "dedloc").is_file()
    if shutil.which("desktop-file-validate"):
        check = subprocess.run(["desktop-file-validate", str(desktop)], capture_output=True, text=True)
        assert check.returncode == 0 and not check.stdout.strip(), check.stdout
    else:
        pytest.skip("desktop-file-validate is not installed (desktop-file-utils)")


def test_tar_gz_holds_the_bundle(built):
    with tarfile.open(built["tgz"]) as tar:
        names = set()
        for member in tar:
            names.add(member.name)
            if member.name == "dedloc/dedloc":
                assert member.mode & 0o111 and member.uid == 0
    assert {"dedloc/dedloc", "dedloc/_internal/hivemind/hivemind_cli/p2pd",
            "dedloc/_internal/resources/catalog/default.json"} <= names


def test_the_wsl_distro_runs_the_worker_with_nothing_of_this_machine(built, corpus_server, tmp_path):
    """The WSL2 distro (installers/build_wsl.sh), unpacked and entered with chroot in mount and PID
    namespaces of its own, as ``wsl --import`` would give it its own root: ``dedloc worker`` there
    trains, pauses and resumes through the protocol, with no file, library or variable of ours."""
    from test_worker_boundary import start, train_pause_resume

    from dedloc_core.workerproc import WorkerProcess

    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("chroot"):
        pytest.skip("chroot and mount namespaces need root and unshare")
    tars = list(DIST.glob(f"{NAME}-*-wsl-*.tar.gz"))
    assert len(tars) == 1, tars
    print(f"\nWSL distro {tars[0].name}: {_size(tars[0]) / 2**20:.0f} MiB")
    root = tmp_path / "distro"
    root.mkdir()
    subprocess.run(["tar", "-C", str(root), "-xzf", str(tars[0])], check=True)
    assert os.access(root / "usr" / "bin" / "dedloc", os.X_OK) and (root / "bin" / "sh").is_file()
    assert not (root / "opt" / NAME / "_internal" / "PySide6" / "Qt").exists()  # the tray app runs on Windows
    assert "default=root" in (root / "etc" / "wsl.conf").read_text()
    inner = (f"mount --rbind /dev {root}/dev && mount -t proc proc {root}/proc && "
             f"mount -t tmpfs tmpfs {root}/tmp && {shutil.which('chroot')} {root} /usr/bin/dedloc worker")
    command = ["unshare", "--mount", "--pid", "--fork", "--propagation", "private", "sh", "-c", inner]
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "DEDLOC_LOG_LEVEL": "INFO", "LANG": "C.UTF-8"}
    worker = WorkerProcess(command=command, env=env, stderr=open(tmp_path / "worker.log", "w"))
    try:
        worker.start(hello_timeout=120)
        train_pause_resume(worker, start(corpus_server.url))
        assert worker.stop(timeout=30).name == "OK"
    finally:
        worker.kill()
    assert list((root / "root").rglob("identity.key")), "the worker's identity is not in the distro's home"
