"""GPU support: a CUDA build of torch, installed on demand beside the app's own (CPU) torch.

The app ships a CPU build of torch: a few hundred MB, where a CUDA build with its NVIDIA libraries
is several GB that most volunteers (no NVIDIA GPU) would download for nothing. A volunteer whose
GPU the app found installs a *runtime*: the wheels of a pinned list (``resources/gpu_runtime.json``,
made by ``installers/pin_gpu_runtime.py``), each checked against its size and SHA-256, unpacked
into ``<data dir>/gpu-runtime/<name>``. The folder is complete (a marker file written last) before
``state.json`` names it current, in one atomic write; the runtime it replaces stays as the way back
(``rollback``), and ``use_bundled`` goes back to the app's own torch. The worker calls ``activate``
before it imports torch: the current runtime's packages then come first, also in the frozen
bundle (whose importer would otherwise find its own torch first). No torch is imported here.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import logging
import os
import platform
import shutil
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import paths
from .errors import DedlocError

logger = logging.getLogger(__name__)

FORMAT = 1
MARKER = ".complete"  # written last into a runtime's folder: its wheels are all unpacked
CHUNK = 1 << 20


class GpuRuntimeError(DedlocError):
    title = "GPU support not installed"
    hint = "The app goes on training on the CPU. Try again later; if it lasts, reinstall the app."


@dataclass(frozen=True)
class Wheel:
    file: str
    sha256: str
    size: int
    url: str = ""  # empty: the runtime's index followed by ``file``


@dataclass(frozen=True)
class Runtime:
    name: str  # the folder's name, e.g. "torch-2.13.0-cu130"
    python: str  # the wheels' Python tag, e.g. "cp311"
    machine: str  # platform.machine() of the wheels, e.g. "x86_64"
    index: str
    wheels: tuple[Wheel, ...]

    @property
    def size(self) -> int:
        return sum(w.size for w in self.wheels)


def load_list(path: Path | None = None) -> list[Runtime]:
    """The pinned runtimes (the app's list unless ``path``); GpuRuntimeError if it is malformed."""
    try:
        data = json.loads(path.read_text() if path else paths.resource("gpu_runtime.json").read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        return [Runtime(r["name"], r["python"], r["machine"], r.get("index", ""),
                        tuple(Wheel(w["file"], w["sha256"], int(w["size"]), w.get("url", "")) for w in r["wheels"]))
                for r in data["runtimes"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GpuRuntimeError(f"The list of GPU runtimes cannot be read: {exc}", code="gpu_list") from exc


def for_this_machine(runtimes: list[Runtime]) -> Runtime | None:
    """The first runtime built for this Python and machine (None: none is published for it)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return next((r for r in runtimes if r.python == tag and r.machine == platform.machine()
                 and sys.platform.startswith("linux")), None)


def base_dir() -> Path:
    return paths.data_dir() / "gpu-runtime"


def _state(base: Path) -> dict:
    try:
        state = json.loads((base / "state.json").read_text())
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def _complete(base: Path, name: object) -> Path | None:
    folder = base / name if isinstance(name, str) and name and "/" not in name and name not in (".", "..") else None
    return folder if folder is not None and (folder / MARKER).is_file() else None


def current(base: Path | None = None) -> Path | None:
    """The folder of the runtime in use, or None (the app's own torch)."""
    base = base or base_dir()
    return _complete(base, _state(base).get("current"))


def previous(base: Path | None = None) -> Path | None:
    base = base or base_dir()
    return _complete(base, _state(base).get("previous"))


def _switch(base: Path, name: str | None) -> None:
    old = _state(base).get("current")
    paths.atomic_write(base / "state.json", json.dumps({"current": name, "previous": old}).encode())


def install(runtime: Runtime, base: Path | None = None, progress: Callable[[int, int], None] | None = None) -> Path:
    """Download, check and unpack ``runtime``, then make it current; return its folder. The runtime
    in use until then stays the way back. On any failure nothing is switched."""
    base = base or base_dir()
    folder = base / runtime.name
    if _complete(base, runtime.name) is None:
        downloads, staging = base / "downloads", base / f"{runtime.name}.partial"
        downloads.mkdir(parents=True, exist_ok=True)
        done = [0]
        for wheel in runtime.wheels:
            _fetch(wheel, runtime.index, downloads / wheel.file, done, runtime.size, progress)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for wheel in runtime.wheels:
            _unpack(downloads / wheel.file, staging)
        (staging / MARKER).write_text(json.dumps({"name": runtime.name, "wheels": [w.file for w in runtime.wheels]}))
        shutil.rmtree(folder, ignore_errors=True)  # an incomplete earlier try
        os.replace(staging, folder)
        shutil.rmtree(downloads, ignore_errors=True)
    if _state(base).get("current") != runtime.name:
        _switch(base, runtime.name)
    logger.info("GPU runtime %s is in use (%s)", runtime.name, folder)
    return folder


def rollback(base: Path | None = None) -> str | None:
    """Go back to the runtime used before the last switch (None: the app's own torch); return its name."""
    base = base or base_dir()
    back = previous(base)
    _switch(base, back.name if back else None)
    return back.name if back else None


def use_bundled(base: Path | None = None) -> None:
    """Train with the app's own torch again; the installed runtime stays, as the way back."""
    _switch(base or base_dir(), None)


def _fetch(wheel: Wheel, index: str, target: Path, done: list[int], total: int, progress) -> None:
    import urllib.request  # (ssl: not in the tray until an install runs)

    url = wheel.url or index.rstrip("/") + "/" + wheel.file
    if target.is_file() and target.stat().st_size == wheel.size and _sha256(target) == wheel.sha256:
        done[0] += wheel.size  # downloaded by an earlier try
        return
    part, digest, size = target.with_name(target.name + ".part"), hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(url, timeout=60) as answer, open(part, "wb") as out:
            while chunk := answer.read(CHUNK):
                size += len(chunk)
                if size > wheel.size:
                    raise GpuRuntimeError(f"{wheel.file} from {url} is larger than the pinned {wheel.size} bytes.",
                                          code="gpu_size")
                digest.update(chunk)
                out.write(chunk)
                done[0] += len(chunk)
                if progress is not None:
                    progress(done[0], total)
        if size != wheel.size or digest.hexdigest() != wheel.sha256:
            raise GpuRuntimeError(f"{wheel.file} from {url} is not the pinned file ({size} bytes, SHA-256 "
                                  f"{digest.hexdigest()[:16]}...): it was not installed.", code="gpu_hash")
        os.replace(part, target)
    except OSError as exc:
        raise GpuRuntimeError(f"Cannot download {wheel.file} from {url}: {exc}", code="gpu_download") from exc
    finally:
        part.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _unpack(wheel: Path, into: Path) -> None:
    """A wheel's files as pip puts them in site-packages: its ``.data/purelib`` and ``platlib`` at the
    top, its scripts and headers left out; executable bits kept."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            name = member.filename
            parts = name.split("/")
            if name.startswith("/") or ".." in parts or member.is_dir():
                continue
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            target = into.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, CHUNK)
            mode = member.external_attr >> 16
            if mode & 0o111:
                target.chmod(0o755)


class _RuntimeFinder:
    """Finds the runtime's top-level packages (and their submodules) before any other importer."""

    def __init__(self, folder: Path):
        self.folder = str(folder)
        self.names = {p.name.removesuffix(".py") for p in folder.iterdir() if p.name.isidentifier()
                      or p.name.removesuffix(".py").isidentifier()}

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.names:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, path if "." in fullname else [self.folder])


_active: Path | None = None  # the runtime this process activated


def activate(base: Path | None = None) -> Path | None:
    """Make the current runtime's packages importable first (call before importing torch); its folder."""
    global _active
    folder = current(base)
    if folder is None or _active is not None:
        return _active
    sys.path.insert(0, str(folder))
    sys.meta_path.insert(0, _RuntimeFinder(folder))
    _active = folder
    return folder


def active() -> Path | None:
    """The runtime this process trains with (``activate``), None: the bundled torch."""
    return _active
