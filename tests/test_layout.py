"""The package layout holds its line (see ``dedloc_core/__init__.py``).

- Every light module (everything outside ``dedloc_core.engine``) imports in a fresh interpreter
  without loading torch, hivemind, cryptography or Qt. (The tray app's own start is checked in
  ``test_app.py::test_gui_process_never_imports_torch_or_hivemind``.)
- ``app.main`` and every app module import without loading pydantic or ``ssl`` (the tray's memory:
  its models are msgspec Structs, and ``urllib.request`` is imported inside the functions that fetch).
- Outside the engine, only ``cli`` and ``organizer.backbone`` import it, inside a function.
- No import cycle among our modules, counting imports inside functions too.
- Every package says what its room is for.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dedloc_core"
HEAVY = ("torch", "hivemind", "cryptography", "PySide6")
NOT_IN_TRAY = ("pydantic", "pydantic_core", "ssl")  # about 20 MB resident in the tray (bench/README.md)
ENGINE_STARTERS = {"dedloc_core.cli", "dedloc_core.organizer.backbone"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
LIGHT = sorted(m for m in MODULES if not (m == "dedloc_core.engine" or m.startswith("dedloc_core.engine.")))
APP = ["app.main"] + sorted(module_name(p) for p in (ROOT / "app").rglob("*.py") if p.stem != "__main__")


def imports_of(name: str) -> list[tuple[str, bool]]:
    """(imported dedloc_core module, at module level?) for every import statement in ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` only mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES and "." in target:
                target = target.rpartition(".")[0]
            if target in MODULES and target != name:
                found.append((target, id(node) in top))
    return found


def first_loaders(modules: list[str], packages: tuple[str, ...]) -> dict[str, str]:
    """Import ``modules`` in turn in a fresh interpreter: {package: the first module that loaded it,
    and the line of ours whose import did (``app.main via dedloc_core/catalog/store.py:9``)}."""
    code = f"""
import importlib, json, sys, traceback
packages, root = {packages!r}, {str(ROOT) + os.sep!r}
lines = {{}}

class Spy:
    def find_spec(self, name, path=None, target=None):
        if name in packages and name not in lines:
            ours = [f for f in traceback.extract_stack() if f.filename.startswith(root)]
            lines[name] = f"{{ours[-1].filename[len(root):]}}:{{ours[-1].lineno}}" if ours else "?"
        return None

sys.meta_path.insert(0, Spy())
culprits = {{}}
for name in {modules!r}:
    before = {{p for p in packages if p in sys.modules}}
    importlib.import_module(name)
    for p in packages:
        if p in sys.modules and p not in before:
            culprits[p] = f"{{name}} via {{lines.get(p, '?')}}"
print(json.dumps(culprits))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QT_QPA_PLATFORM": "offscreen"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_light_modules_load_no_heavy_package():
    culprits = first_loaders(LIGHT, HEAVY)
    assert culprits == {}, f"light modules load heavy packages (package: first module that did): {culprits}"
    assert len(LIGHT) > 25  # the walk found the light rooms


def test_the_tray_app_loads_no_pydantic_or_ssl():
    culprits = first_loaders(APP, NOT_IN_TRAY)
    assert culprits == {}, ("the tray app's modules load what the tray must not hold (package: first module "
                            f"that did; app.main comes first): {culprits}")
    assert len(APP) > 15 and "app.windowhost" in APP  # the walk found the app


def test_only_the_entry_points_import_the_engine():
    bad = []
    for name in LIGHT:
        for target, top_level in imports_of(name):
            if not target.startswith("dedloc_core.engine"):
                continue
            if name not in ENGINE_STARTERS or top_level:
                bad.append(f"{name} -> {target}" + (" (module level)" if top_level else ""))
    assert bad == [], "light modules importing the engine: " + "; ".join(bad)


def find_cycles(graph: dict[str, list[str]]) -> list[str]:
    cycles: list[str] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in graph.get(node, []):
            if nxt in path:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    for name in graph:
        if name not in done:
            visit(name, [name])
    return cycles


def test_no_import_cycle():
    graph = {name: sorted({t for t, _ in imports_of(name)}) for name in MODULES}
    assert find_cycles(graph) == [], "import cycles: " + " | ".join(find_cycles(graph))


def test_cycle_finder_sees_the_old_worker_training_cycle(tmp_path, monkeypatch):
    """Relative imports inside functions count: the worker <-> training pair of before is found."""
    fake = {"dedloc_core.engine.worker": "def run():\n    from .training import Session\n",
            "dedloc_core.engine.training": "from .worker import run\n"}
    for name, text in fake.items():
        path = tmp_path / (name.rpartition(".")[2] + ".py")
        path.write_text(text)
        monkeypatch.setitem(MODULES, name, path)
    graph = {name: [t for t, _ in imports_of(name)] for name in fake}
    cycle = "dedloc_core.engine.worker -> dedloc_core.engine.training -> dedloc_core.engine.worker"
    assert find_cycles(graph) == [cycle]


def test_every_package_says_what_its_room_is_for():
    for init in PKG.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80, f"{init.relative_to(ROOT)} needs a docstring saying what lives there"
        subs = sorted(p.stem for p in init.parent.glob("*.py") if p.stem != "__init__")
        subs += sorted(p.name for p in init.parent.iterdir() if (p / "__init__.py").exists())
        missing = [s for s in subs if f"``{s}``" not in doc and f"``{s}/``" not in doc]
        assert missing == [], f"{init.relative_to(ROOT)}'s docstring does not mention {missing}"
