"""docs/hivemind/*.patch stay applicable to the hivemind we run, and the README lists each of them.

The patches are our bug fixes written against hivemind 1.1.12's source (see docs/hivemind/README.md).
This test never imports hivemind: it finds the installed package's folder, copies its sources and runs
``patch`` on the copy.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs" / "hivemind"
PATCHES = sorted(DOCS.glob("*.patch"))

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="the `patch` program is not installed")


def _installed_hivemind() -> Path:
    spec = importlib.util.find_spec("hivemind")  # locates the package without running its __init__
    assert spec is not None and spec.submodule_search_locations, "hivemind is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A copy of the installed hivemind's sources: ``<root>/hivemind/...``, as in a source checkout."""
    root = tmp_path_factory.mktemp("hivemind_src")
    shutil.copytree(_installed_hivemind(), root / "hivemind",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "p2pd"))
    return root


def _patch(root: Path, patch_file: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["patch", "-p1", "--fuzz=0", "--batch", *extra, "-i", str(patch_file)],
                          cwd=root, capture_output=True, text=True, timeout=30)


def test_there_are_patches() -> None:
    assert len(PATCHES) >= 13, f"expected the bug-fix patches in {DOCS}, found {[p.name for p in PATCHES]}"


@pytest.mark.parametrize("patch_file", PATCHES, ids=lambda p: p.stem)
def test_patch_applies_alone(pristine: Path, patch_file: Path) -> None:
    first = patch_file.read_text().splitlines()[0]
    assert first and not first.startswith(("---", "diff ")), f"{patch_file.name} starts without its description"
    result = _patch(pristine, patch_file, "--dry-run")
    assert result.returncode == 0, f"{patch_file.name} does not apply to hivemind 1.1.12:\n{result.stdout}"


def test_all_patches_apply_in_sequence_and_compile(pristine: Path, tmp_path: Path) -> None:
    root = tmp_path / "all"
    shutil.copytree(pristine, root)
    changed: set[str] = set()
    for patch_file in PATCHES:
        result = _patch(root, patch_file)
        assert result.returncode == 0, f"{patch_file.name} does not apply after the others:\n{result.stdout}"
        changed.update(re.findall(r"^\+\+\+ b/(\S+)", patch_file.read_text(), flags=re.MULTILINE))
    for name in sorted(changed):
        source = (root / name).read_text()
        compile(source, name, "exec")  # a syntax error in the patched file fails here


def test_readme_lists_every_patch() -> None:
    readme = (DOCS / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.-]+\.patch)` \|", readme, flags=re.MULTILINE))
    files = {p.name for p in PATCHES}
    assert listed == files, f"README table: missing {sorted(files - listed)}, without a file {sorted(listed - files)}"
