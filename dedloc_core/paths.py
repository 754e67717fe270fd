"""Where things live: per-user directories and the resources shipped with the app."""

from __future__ import annotations

import os
import tempfile
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

import platformdirs

from . import environ

APP_NAME = "dedloc-volunteer"


def _dir(kind: str) -> Path:
    override = environ.HOME.optional()
    if override:
        path = Path(override) / kind
    else:
        path = Path(getattr(platformdirs, f"user_{kind}_dir")(APP_NAME, appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def config_dir() -> Path:
    """User preferences (small, user-edited state)."""
    return _dir("config")


def data_dir() -> Path:
    """Machine state: identity, stats, last good catalog."""
    return _dir("data")


def cache_dir() -> Path:
    """Downloaded data shards and other things that can be fetched again."""
    return _dir("cache")


def log_dir() -> Path:
    return _dir("log")


def resource(*parts: str) -> Traversable:
    """A file shipped in the ``resources`` package (works in wheels and frozen builds)."""
    node = resources.files("resources")
    for part in parts:
        node = node.joinpath(part)
    return node


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so a crash leaves either the old or the new file, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
