"""What this computer has: CPU, RAM, disk and NVIDIA GPUs (psutil and pynvml), and whether it meets
an experiment's hardware minimums. Probing may take a moment: callers run it off the GUI thread."""

from __future__ import annotations

import logging
import os
import platform
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from dedloc_core import paths

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_mb: int
    driver: str


@dataclass(frozen=True)
class Hardware:
    cpu_model: str
    cores: int
    threads: int
    ram_gb: float
    disk_free_gb: float
    gpus: list[Gpu] = field(default_factory=list)
    gpu_note: str = ""  # why no GPU is listed, in words

    def unmet(self, minimums) -> list[str]:
        """What this computer lacks for an experiment's ``HardwareMinimums`` (empty: it qualifies)."""
        lacks = []
        if self.ram_gb + 0.25 < minimums.ram_gb:
            lacks.append(f"{minimums.ram_gb:g} GB RAM (this computer has {self.ram_gb:.1f} GB)")
        if self.threads < minimums.cpu_cores:
            lacks.append(f"{minimums.cpu_cores} CPU cores (this computer has {self.threads})")
        if self.disk_free_gb < minimums.disk_gb:
            lacks.append(f"{minimums.disk_gb:g} GB free disk (this computer has {self.disk_free_gb:.1f} GB)")
        need = minimums.gpu_memory_gb
        if minimums.gpu_required and not self.gpus:
            lacks.append(f"an NVIDIA GPU with {need:g} GB" if need else "an NVIDIA GPU")
        elif minimums.gpu_required and need and max(g.memory_mb for g in self.gpus) / 1024 + 0.25 < need:
            most = max(g.memory_mb for g in self.gpus) / 1024
            lacks.append(f"a GPU with {need:g} GB (this computer's has {most:.1f} GB)")
        return lacks


def cpu_model() -> str:
    if platform.system() == "Linux":
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
    return platform.processor() or platform.machine() or "Unknown CPU"


def nvidia_gpus() -> tuple[list[Gpu], str]:
    """NVIDIA GPUs via NVML, or an empty list and the reason in words."""
    try:
        import pynvml
    except ImportError:
        return [], "No NVIDIA GPU found (NVML support is not installed)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        logger.info("NVML unavailable: %s", exc)
        return [], "No NVIDIA GPU found"
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total // 2**20
            gpus.append(Gpu(_text(pynvml.nvmlDeviceGetName(handle)), int(memory), driver))
        return gpus, "" if gpus else "No NVIDIA GPU found"
    except pynvml.NVMLError as exc:
        return [], f"NVIDIA driver error: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def probe(data_path: Path | None = None) -> Hardware:
    where = data_path or paths.cache_dir()
    gpus, note = nvidia_gpus()
    return Hardware(
        cpu_model=cpu_model(),
        cores=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
        threads=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        ram_gb=psutil.virtual_memory().total / 2**30,
        disk_free_gb=shutil.disk_usage(where).free / 2**30,
        gpus=gpus,
        gpu_note=note,
    )
