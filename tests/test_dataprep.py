"""``dedloc data prepare``: real folders of text in, token shards, a tokenizer and a catalog entry out."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from dedloc_core.errors import EXIT_EXPLAINED
from dedloc_core.organizer import dataprep

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "resources" / "corpus"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    """About 300 KB of English in three .txt files and two .jsonl files (in subfolders), plus a file
    to skip; returns the folder and its documents in the order the command reads them."""
    lines = [line for name in ("shard-000.txt", "shard-002.txt")
             for line in (CORPUS / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "books").mkdir()
    (folder / "notes").mkdir()
    (folder / "README.md").write_text("not training data\n")
    docs: dict[Path, list[str]] = {}
    at = 0
    for i in range(3):
        path = folder / "books" / f"part-{i}.txt"
        docs[path] = ["\n".join(lines[at:at + 400]) + "\n"]
        path.write_text(docs[path][0], encoding="utf-8")
        at += 400
    for i in range(2):
        path = folder / "notes" / f"records-{i}.jsonl"
        docs[path] = [" ".join(lines[j:j + 1 + j % 7]) for j in range(at, at + 500, 5)]
        path.write_text("".join(json.dumps({"id": n, "text": d}) + "\n" for n, d in enumerate(docs[path])))
        at += 500
    return folder, [d for path in sorted(docs) for d in docs[path]]


def prepare(capsys, folder: Path, out: Path, *extra: str) -> tuple[int, dict | None, str]:
    code = dataprep.main(["prepare", str(folder), "--out", str(out), *extra])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else None, captured.err


def load(out: Path, entry: dict) -> tuple[list[np.ndarray], np.ndarray]:
    shards = [np.load(out / Path(s["url"]).name) for s in entry["data"]["shards"]]
    return shards, np.load(out / "eval.npy")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_causal_shards_decode_to_the_inputs_and_the_entry_describes_the_files(corpus, tmp_path, capsys):
    folder, docs = corpus
    out = tmp_path / "out"
    code, entry, err = prepare(capsys, folder, out, "--vocab-size", "2000", "--shard-mb", "0.1")
    assert code == 0, err
    assert entry == json.loads((out / "catalog-entry.json").read_text())
    assert entry["recipe"] == "causal-lm"
    params = entry["recipe_params"]
    assert params["family"] == "llama" and params["seq_len"] == 128
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.token_to_id("<pad>") == 1
    assert params["config"]["vocab_size"] == tok.get_vocab_size() <= 2000
    assert params["config"]["max_position_embeddings"] == 128

    for item in [*entry["data"]["shards"], entry["data"]["tokenizer"], entry["data"]["eval"]]:
        path = out / Path(item["url"]).name
        assert item["url"] == f"data/{path.name}"
        assert item["sha256"] == sha256(path) and item["size"] == path.stat().st_size
    assert [Path(s["url"]).name for s in entry["data"]["shards"]][:2] == ["shard-00000.npy", "shard-00001.npy"]
    assert all(s["size"] <= 0.1 * 2**20 for s in entry["data"]["shards"])

    shards, held_out = load(out, entry)
    rows = np.concatenate([*shards, held_out])
    assert all(s.dtype == np.uint16 and s.ndim == 2 and s.shape[1] == 128 for s in [*shards, held_out])
    # every document and its separator, cut into whole rows: nothing lost or counted twice
    tokens = sum(len(e.ids) + 1 for e in tok.encode_batch(docs, add_special_tokens=False))
    assert len(rows) == tokens // 128
    assert len(held_out) == max(1, round(0.02 * len(rows)))
    assert sum(len(s) for s in shards) == len(rows) - len(held_out)
    assert len({r.tobytes() for r in rows}) == len(rows)  # the eval rows are not train rows
    text = "\x00".join(docs)
    for row in rows:
        cuts = np.flatnonzero(row == 0)
        for piece in np.split(row, cuts):
            piece = piece[piece != 0]
            if len(piece):
                decoded = tok.decode(piece.tolist())
                assert decoded in text, decoded[:80]
    assert re.search(rf"{len(docs)} documents \(1 other files skipped\)", err), err


def test_masked_rows_are_framed_and_roberta_offsets_positions(corpus, tmp_path, capsys):
    folder, _ = corpus
    code, entry, err = prepare(capsys, folder, tmp_path / "albert", "--kind", "masked", "--vocab-size", "1000",
                               "--seq-len", "64")
    assert code == 0, err
    assert entry["recipe"] == "masked-lm" and entry["recipe_params"]["family"] == "albert"
    assert entry["recipe_params"]["config"]["embedding_size"] == 128
    tok = Tokenizer.from_file(str(tmp_path / "albert" / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == [0, 1, 2, 3, 4]
    shards, held_out = load(tmp_path / "albert", entry)
    for rows in [*shards, held_out]:
        assert rows.shape[1] == 64 and (rows[:, 0] == 2).all() and (rows[:, -1] == 3).all()
        assert not (rows[:, 1:-1] == 2).any()  # [CLS] only where a row starts

    code, entry, err = prepare(capsys, folder, tmp_path / "roberta", "--kind", "masked", "--family", "roberta",
                               "--vocab-size", "1000", "--seq-len", "64")
    assert code == 0, err
    config = entry["recipe_params"]["config"]
    assert config["max_position_embeddings"] == 66 and config["pad_token_id"] == 0


def test_a_given_tokenizer_is_used_as_is(corpus, tmp_path, capsys):
    folder, docs = corpus
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.txt").write_text(docs[0][:5000])
    code, first, err = prepare(capsys, small, tmp_path / "first", "--vocab-size", "400", "--min-frequency", "1")
    assert code == 0, err
    given = tmp_path / "first" / "tokenizer.json"

    out = tmp_path / "out"
    code, entry, err = prepare(capsys, folder, out, "--tokenizer", str(given), "--vocab-size", "5000")
    assert code == 0, err
    assert entry["data"]["tokenizer"]["sha256"] == sha256(given) == sha256(out / "tokenizer.json")
    vocab = Tokenizer.from_file(str(given)).get_vocab_size()
    assert vocab <= 400 and entry["recipe_params"]["config"]["vocab_size"] == vocab
    shards, _ = load(out, entry)
    assert max(int(s.max()) for s in shards) < vocab


def test_a_vocabulary_over_65535_is_stored_as_int32(corpus, tmp_path, capsys):
    folder, _ = corpus
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<pad>": 1, **{c: i + 2 for i, c in enumerate(sorted(alphabet))}}
    vocab.update({f"filler{i}": len(vocab) + i for i in range(70_000 - len(vocab))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "big.json"))
    code, entry, err = prepare(capsys, folder, tmp_path / "out", "--tokenizer", str(tmp_path / "big.json"))
    assert code == 0, err
    shards, held_out = load(tmp_path / "out", entry)
    assert all(s.dtype == np.int32 for s in [*shards, held_out])
    assert entry["recipe_params"]["config"]["vocab_size"] == 70_000


def test_a_given_tokenizer_without_mask_is_refused(corpus, tmp_path, capsys):
    folder, docs = corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs[:3], trainers.BpeTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]",
                                                                                           "[SEP]"]))
    tok.save(str(tmp_path / "no-mask.json"))
    code, _, err = prepare(capsys, folder, tmp_path / "out", "--kind", "masked", "--tokenizer",
                           str(tmp_path / "no-mask.json"))
    assert code == EXIT_EXPLAINED
    assert "[MASK]" in err and "[CLS]" not in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_parquet_without_pyarrow_says_what_to_do(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed, whatever this machine has
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("Some text. " * 100)
    (tmp_path / "in" / "b.parquet").write_bytes(b"PAR1 not really PAR1")
    code, _, err = prepare(capsys, tmp_path / "in", tmp_path / "out")
    assert code == EXIT_EXPLAINED
    assert "b.parquet" in err and "install pyarrow" in err.lower() and "JSONL" in err


def test_an_empty_folder_is_refused(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    code, _, err = prepare(capsys, tmp_path / "in", tmp_path / "out")
    assert code == EXIT_EXPLAINED and "No documents" in err
    (tmp_path / "in" / "notes.md").write_text("# not a document\n")
    code, _, err = prepare(capsys, tmp_path / "in", tmp_path / "out")
    assert code == EXIT_EXPLAINED and "No documents" in err and "1 other files skipped" in err


def test_too_little_text_names_the_token_counts(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "short.txt").write_text("A short note, far from two rows of text.")
    code, _, err = prepare(capsys, tmp_path / "in", tmp_path / "out", "--seq-len", "64")
    assert code == EXIT_EXPLAINED
    match = re.search(r"give (\d+) tokens", err)
    assert match and 0 < int(match.group(1)) < 128, err
    assert "needs 64" in err and "need 128" in err
    assert not (tmp_path / "out").exists()


def test_a_malformed_jsonl_line_is_named(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "docs.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "broken\n')
    code, _, err = prepare(capsys, tmp_path / "in", tmp_path / "out")
    assert code == EXIT_EXPLAINED and f"{path}:3" in err and "Traceback" not in err
    path.write_text('{"text": "fine"}\n{"body": "elsewhere"}\n')
    code, _, err = prepare(capsys, tmp_path / "in", tmp_path / "out")
    assert code == EXIT_EXPLAINED and f"{path}:2" in err and "'text'" in err
    code, _, err = prepare(capsys, tmp_path / "in", tmp_path / "out", "--text-field", "nope")
    assert code == EXIT_EXPLAINED and f"{path}:1" in err


def test_the_same_inputs_and_seed_give_the_same_shards(corpus, tmp_path, capsys):
    folder, _ = corpus
    runs = []
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        code, entry, err = prepare(capsys, folder, tmp_path / name, "--vocab-size", "1000", "--seed", seed)
        assert code == 0, err
        runs.append(entry["data"])
    assert runs[0] == runs[1]
    assert runs[2]["tokenizer"] == runs[0]["tokenizer"] and runs[2]["shards"] != runs[0]["shards"]


def test_a_failed_write_leaves_no_catalog_entry(corpus, tmp_path, capsys, monkeypatch):
    folder, _ = corpus
    out = tmp_path / "out"
    code, _, err = prepare(capsys, folder, out, "--vocab-size", "1000")
    assert code == 0, err

    def full_disk(*_args, **_kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dataprep.np, "save", full_disk)
    code, _, err = prepare(capsys, folder, out, "--vocab-size", "1000")
    assert code == EXIT_EXPLAINED and "Disk full" in err and "Traceback" not in err
    assert not (out / "catalog-entry.json").exists()
    assert not list(out.glob("*.tmp"))


def test_the_dedloc_command_runs_it(corpus, tmp_path):
    folder, _ = corpus
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dedloc_core.cli", "data", "prepare", str(folder), "--out", str(out),
                           "--vocab-size", "1000", "--kind", "causal", "--family", "gpt2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    entry = json.loads(proc.stdout)
    assert entry == json.loads((out / "catalog-entry.json").read_text())
    assert entry["recipe_params"]["config"] == {"vocab_size": entry["recipe_params"]["config"]["vocab_size"],
                                                "n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 128}
    assert "rows" in proc.stderr and "vocabulary" in proc.stderr
    usage = subprocess.run([sys.executable, "-m", "dedloc_core.cli", "data", "prepare", str(folder), "--out",
                            str(out), "--kind", "masked", "--family", "gpt2"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert usage.returncode == 2 and "--family gpt2" in usage.stderr and "Traceback" not in usage.stderr
