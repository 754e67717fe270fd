"""The docs stay docs: the README's variable table matches the code, the READMEs stay short, every
benchmark has its section, and product code carries no history. Reads text only (no engine import)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = (ROOT / "dedloc_core", ROOT / "app")
ENV_NAME = re.compile(r"\bDEDLOC_[A-Z][A-Z0-9_]*\b")
HISTORY = re.compile(r"stop [0-9]+|run [0-9]+ of|CI saw")  # issue 48's grep, as `grep -E` reads it


def _source_files() -> list[Path]:
    return sorted(p for root in SOURCE_ROOTS for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _text_files() -> list[Path]:
    """What `grep -r` reads in dedloc_core and app, less compiled files."""
    files = []
    for root in SOURCE_ROOTS:
        for path in root.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
                files.append(path)
    return sorted(files)


def _readme_env_table() -> list[str]:
    """The first column of the README's table under "## Environment variables"."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("## Environment variables")
    names = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            cell = line.split("|")[1].strip()
            match = re.fullmatch(r"`(DEDLOC_[A-Z0-9_]+)`", cell)
            if match:
                names.append(match.group(1))
    return names


def test_the_readme_lists_exactly_the_environment_variables_the_code_reads():
    in_code = {name for path in _source_files() for name in ENV_NAME.findall(path.read_text(encoding="utf-8"))}
    in_readme = _readme_env_table()
    twice = sorted({name for name in in_readme if in_readme.count(name) > 1})
    assert not twice, f"listed twice in README.md: {twice}"
    missing, stale = sorted(in_code - set(in_readme)), sorted(set(in_readme) - in_code)
    assert not missing, f"read in dedloc_core/ or app/, missing from README.md's table: {missing}"
    assert not stale, f"in README.md's table, read nowhere in dedloc_core/ or app/: {stale}"


def test_readme_is_at_most_300_lines():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_bench_readme_is_at_most_600_lines():
    assert len((ROOT / "bench" / "README.md").read_text(encoding="utf-8").splitlines()) <= 600


def test_every_bench_script_has_a_section_in_bench_readme():
    headings = [line for line in (ROOT / "bench" / "README.md").read_text(encoding="utf-8").splitlines()
                if line.startswith("#")]
    missing = [p.name for p in sorted((ROOT / "bench").glob("*.py"))
               if not any(f"`{p.name}`" in heading for heading in headings)]
    assert not missing, f"bench scripts without a heading in bench/README.md: {missing}"


def test_no_history_in_product_code():
    hits = []
    for path in _text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary, as grep skips it
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "comments narrate history (say why the code is so instead):\n" + "\n".join(hits)
