"""One translation of errors for people (``errors.user_message``), one format and documented exit
status for every command line, and the exception tree in ``errors``' docstring."""

from __future__ import annotations

import ast
import errno
import io
import subprocess
import sys
from pathlib import Path

from dedloc_core import errors
from dedloc_core.errors import (
    EXIT_EXPLAINED,
    EXIT_INTERRUPTED,
    EXIT_UNEXPECTED,
    CatalogError,
    DedlocError,
    report,
    user_message,
)
from dedloc_core.protocol import Error

ROOT = Path(__file__).resolve().parents[1]


def test_a_dedloc_error_keeps_its_words_and_gets_what_to_do():
    msg = user_message(CatalogError("The signature does not match.", title="Catalog tampered", code="tampered"))
    assert (msg.title, msg.message, msg.code, msg.exit_code) == (
        "Catalog tampered", "The signature does not match.", "tampered", EXIT_EXPLAINED)
    assert "last good catalog" in msg.hint
    assert user_message(DedlocError("x", hint="do y")).hint == "do y"


def test_a_full_disk_is_named_and_nothing_else_is_called_a_bug():
    full = user_message(OSError(errno.ENOSPC, "No space left on device", "/data/stats.sqlite3"))
    assert full.title == "Disk full" and "/data/stats.sqlite3" in full.message and full.code == "os.ENOSPC"
    assert full.exit_code == EXIT_EXPLAINED and "Free some disk space" in full.hint
    bug = user_message(ZeroDivisionError("division by zero"))
    assert bug.title == "Unexpected error" and "ZeroDivisionError" in bug.message and bug.exit_code == EXIT_UNEXPECTED
    assert user_message(KeyboardInterrupt()).exit_code == EXIT_INTERRUPTED


def test_a_worker_error_event_reads_as_the_worker_said():
    event = Error(code="corrupt", title="Training data unavailable", message="shard-000 is corrupt", hint="retry")
    msg = user_message(event)
    assert msg.line() == "Training data unavailable: shard-000 is corrupt" and msg.hint == "retry"


def test_report_prints_the_one_format():
    out = io.StringIO()
    assert report(CatalogError("Bad.", code="tampered"), out) == EXIT_EXPLAINED
    first, second = out.getvalue().splitlines()
    assert first == "Catalog rejected: Bad. [tampered]" and second.startswith("  What to do: ")


def run(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "DEDLOC_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "dedloc_core.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)


def test_every_cli_reports_in_the_same_format_and_status(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    for args in (["catalog", "verify", str(broken)], ["stats", "--db", str(tmp_path / "missing.db")],
                 ["--self-test", "--experiment", "nope"]):
        out = run(*args, home=tmp_path / "home")
        assert out.returncode == EXIT_EXPLAINED, (args, out.stderr)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert any(line.endswith("]") and ": " in line for line in lines), (args, out.stderr)
        assert "Traceback" not in out.stderr, out.stderr
    assert run("catalog", "verify", home=tmp_path).returncode == 2  # usage: argparse's status


def _error_classes() -> dict[str, str]:
    """Every DedlocError subclass defined in dedloc_core: name -> module file."""
    found: dict[str, str] = {}
    bases = {"DedlocError"}
    trees = [(p, ast.parse(p.read_text())) for p in (ROOT / "dedloc_core").rglob("*.py")]
    changed = True
    while changed:
        changed = False
        for path, tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in found and any(
                        isinstance(b, ast.Name) and b.id in bases for b in node.bases):
                    found[node.name] = str(path.relative_to(ROOT))
                    bases.add(node.name)
                    changed = True
    return found


def test_the_docstring_tree_lists_every_error_class():
    classes = _error_classes()
    assert len(classes) >= 10
    missing = [f"{name} ({where})" for name, where in classes.items() if name not in errors.__doc__]
    assert missing == [], f"add to the tree in dedloc_core/errors.py: {missing}"
