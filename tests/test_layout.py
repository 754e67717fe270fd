"""The package layout holds its line (see ``dedloc_core/__init__.py``).

- Every light module (everything outside ``dedloc_core.engine``) imports in a fresh interpreter
  without loading torch, hivemind, cryptography or Qt. (The tray app's own start is checked in
  ``test_app.py::test_gui_process_never_imports_torch_or_hivemind``.)
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
ENGINE_STARTERS = {"dedloc_core.cli", "dedloc_core.organizer.backbone"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
LIGHT = sorted(m for m in MODULES if not (m == "dedloc_core.engine" or m.startswith("dedloc_core.engine.")))


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


def test_light_modules_load_no_heavy_package():
    code = f"""
import importlib, json, sys
heavy = {HEAVY!r}
culprits = {{}}
for name in {LIGHT!r}:
    before = {{h for h in heavy if h in sys.modules}}
    importlib.import_module(name)
    for h in heavy:
        if h in sys.modules and h not in before:
            culprits[h] = name
print(json.dumps(culprits))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    culprits = json.loads(out.stdout.strip().splitlines()[-1])
    assert culprits == {}, f"light modules load heavy packages (package: first module that did): {culprits}"
    assert len(LIGHT) > 25  # the walk found the light rooms


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
