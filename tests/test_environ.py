"""The ``DEDLOC_*`` environment variables: declared once in ``dedloc_core.environ`` and read only
through it (source text and syntax trees only, no engine import)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dedloc_core import environ

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = (ROOT / "dedloc_core", ROOT / "app")
ENV_NAME = re.compile(r"\bDEDLOC_[A-Z0-9_]+\b")
MODULE = ROOT / "dedloc_core" / "environ.py"
# Reads in the hivemind layer that still go to os.environ themselves: they are to call
# environ.HELPER_THREADS.text() and environ.SOCKET_DIR.optional(). The test fails once a file here
# reads no more, so that the list is emptied then.
NOT_YET: set[str] = set()


def _sources() -> list[Path]:
    return sorted(p for root in SOURCE_ROOTS for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_variable_is_declared_once_with_a_default_and_a_description():
    declared = [v for v in vars(environ).values() if isinstance(v, environ.Variable)]
    assert sorted(v.name for v in declared) == sorted(v.name for v in environ.VARIABLES)
    assert len({v.name for v in environ.VARIABLES}) == len(environ.VARIABLES)
    for var in environ.VARIABLES:
        assert ENV_NAME.fullmatch(var.name) and var.help.strip(), var


def test_every_dedloc_name_in_the_code_is_declared():
    declared = {v.name for v in environ.VARIABLES}
    unknown = sorted({f"{name} ({path.relative_to(ROOT)})" for path in _sources()
                      for name in ENV_NAME.findall(path.read_text(encoding="utf-8")) if name not in declared})
    assert not unknown, f"not declared in dedloc_core/environ.py: {unknown}"


def _env_names(trees: dict[Path, ast.AST]) -> set[str]:
    """Names bound to a variable's name anywhere in the code (``PASSPHRASE_ENV = "DEDLOC_..."``)."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _names_a_variable(node.value, set()):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _names_a_variable(node: ast.AST, env_names: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith("DEDLOC_")
    if isinstance(node, ast.Name):
        return node.id in env_names
    if isinstance(node, ast.Attribute):  # environ.HOME.name, invites.PASSPHRASE_ENV
        return node.attr in env_names or (node.attr == "name" and "environ" in ast.unparse(node.value))
    return False


def _is_os_environ(node: ast.AST) -> bool:
    return ast.unparse(node) in ("os.environ", "environ")


def _reads(tree: ast.AST, env_names: set[str]) -> list[str]:
    """``os.environ.get(X)``, ``os.getenv(X)`` and ``os.environ[X]`` where X names a DEDLOC_ variable."""
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "get" and _is_os_environ(func.value)) or \
                    ast.unparse(func) in ("os.getenv", "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_os_environ(node.value):
            key = node.slice
        if key is not None and _names_a_variable(key, env_names):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _all_reads() -> dict[str, list[str]]:
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in _sources() if path != MODULE}
    env_names = _env_names(trees)
    reads = {str(path.relative_to(ROOT)): _reads(tree, env_names) for path, tree in trees.items()}
    return {path: found for path, found in reads.items() if found}


def test_nothing_outside_the_module_reads_a_dedloc_variable_itself():
    reads = _all_reads()
    outside = {path: found for path, found in reads.items() if path not in NOT_YET}
    assert not outside, f"read DEDLOC_ variables through dedloc_core.environ: {outside}"
    assert set(reads) == NOT_YET, f"these read through dedloc_core.environ now: empty NOT_YET of {NOT_YET - set(reads)}"


def test_the_check_finds_each_way_of_reading(tmp_path):
    code = ('import os\nA = "DEDLOC_X"\nos.environ.get("DEDLOC_Y")\nos.getenv(A)\nos.environ[A]\n'
            'os.environ.get(environ.HOME.name)\nos.environ.get("PATH")\nenv = {A: "1"}\n')
    tree = ast.parse(code)
    assert [r.split(":")[0] for r in _reads(tree, _env_names({tmp_path: tree}))] == [
        "line 3", "line 4", "line 5", "line 6"]


@pytest.mark.parametrize(("value", "expected"), [(None, 1.0), ("0.25", 0.25), ("0", 1.0), ("x", 1.0), ("1e9", 1.0)])
def test_number_falls_back_to_the_default(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("DEDLOC_PROGRESS_PERIOD", raising=False)
    else:
        monkeypatch.setenv("DEDLOC_PROGRESS_PERIOD", value)
    assert environ.PROGRESS_PERIOD.number(0, 3600) == expected


def test_words_optional_flag_and_integer(monkeypatch):
    monkeypatch.setenv("DEDLOC_LISTEN", " ")
    assert environ.LISTEN.words() == ["/ip4/0.0.0.0/tcp/0"]
    monkeypatch.setenv("DEDLOC_LISTEN", "/ip4/1.2.3.4/tcp/1 /ip4/1.2.3.4/tcp/2")
    assert environ.LISTEN.words() == ["/ip4/1.2.3.4/tcp/1", "/ip4/1.2.3.4/tcp/2"]
    monkeypatch.setenv("DEDLOC_HOME", "")
    assert environ.HOME.optional() is None
    monkeypatch.setenv("DEDLOC_IDLE_LOOP", "0")
    assert not environ.IDLE_LOOP.flag()
    monkeypatch.setenv("DEDLOC_WORKER_NICE", "five")
    assert environ.WORKER_NICE.integer() == 19
