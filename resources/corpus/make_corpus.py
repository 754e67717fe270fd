"""Rebuild the shipped corpus from Debian's King James Bible (run by hand, never at install time).

Steps (any Debian or Ubuntu machine; no root needed for the last three)::

    apt-get download bible-kjv bible-kjv-text
    dpkg-deb -x bible-kjv_*.deb kjv && dpkg-deb -x bible-kjv-text_*.deb kjv
    python resources/corpus/make_corpus.py --bible kjv/usr/bin/bible --data-dir kjv/usr/lib

The ``bible`` program prints the compressed ``bible.data`` as text; this script parses that, keeps
the books chosen below (one verse a line, a heading line per chapter, a blank line between
chapters), splits the training text into ``SHARDS`` shards of nearly equal size on line boundaries,
writes the held-out books to ``eval.txt`` and records sizes and SHA-256 digests in ``manifest.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
from pathlib import Path

SHARDS = 4
# Narrative history of the Old Testament (Genesis to 2 Kings) and the whole New Testament,
# about 2.4 MB; two books of the same kinds are held out for evaluation (about 92 KB).
OLD_TESTAMENT = [
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings",
]  # fmt: skip
EVAL_BOOKS = ["Ruth", "Mark"]
_HEADING = re.compile(r"^(\S.*) (\d+)$")
_VERSE = re.compile(r"^\s+\d+ (.*)$")


def read_bible(bible: Path, data_dir: Path) -> dict[str, list[tuple[int, list[str]]]]:
    """Books in canonical order: ``{book: [(chapter, [verse, ...]), ...]}``."""
    text = subprocess.run(
        [str(bible), "-p", str(data_dir), "-l", "100000", "gen1:1-rev22:21"],
        check=True, capture_output=True, text=True, encoding="ascii",
    ).stdout  # fmt: skip
    books: dict[str, list[tuple[int, list[str]]]] = {}
    for line in text.splitlines():
        if heading := _HEADING.match(line):
            books.setdefault(heading.group(1), []).append((int(heading.group(2)), []))
        elif verse := _VERSE.match(line):
            books[next(reversed(books))][-1][1].append(" ".join(verse.group(1).split()))
    return books


def render(books: dict[str, list[tuple[int, list[str]]]], names: list[str]) -> list[str]:
    """The lines of ``names``: a heading per chapter, one verse a line, a blank line after each chapter."""
    lines: list[str] = []
    for name in names:
        for chapter, verses in books[name]:
            lines += [f"{name} {chapter}", *verses, ""]
    return lines


def split_lines(lines: list[str], parts: int) -> list[str]:
    """Cut ``lines`` into ``parts`` texts of nearly equal byte size, on line boundaries."""
    total = sum(len(line) + 1 for line in lines)
    texts, current, size = [], [], 0
    for line in lines:
        current.append(line)
        size += len(line) + 1
        if len(texts) < parts - 1 and size >= total * (len(texts) + 1) / parts:
            texts.append("\n".join(current) + "\n")
            current = []
    texts.append("\n".join(current) + "\n")
    return texts


def _entry(path: Path) -> dict[str, object]:
    data = path.read_bytes()
    return {"name": path.name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bible", type=Path, default=Path("/usr/bin/bible"))
    parser.add_argument("--data-dir", type=Path, default=Path("/usr/lib"))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()

    books = read_bible(args.bible, args.data_dir)
    new_testament = list(books)[list(books).index("Matthew") :]
    train = [b for b in OLD_TESTAMENT + new_testament if b not in EVAL_BOOKS]
    shards = []
    for i, text in enumerate(split_lines(render(books, train), SHARDS)):
        path = args.out / f"shard-{i:03d}.txt"
        path.write_text(text, encoding="ascii", newline="\n")
        shards.append(_entry(path))
    eval_path = args.out / "eval.txt"
    eval_path.write_text("\n".join(render(books, EVAL_BOOKS)) + "\n", encoding="ascii", newline="\n")
    manifest = {"shards": shards, "eval": _entry(eval_path)}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="ascii")
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
