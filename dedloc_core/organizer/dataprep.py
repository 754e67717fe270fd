"""``dedloc data prepare FOLDER --out DIR``: turn a folder of raw text into token shards.

Reads ``*.txt``, ``*.jsonl`` and ``*.parquet`` under FOLDER, trains a byte-level BPE tokenizer (or
takes ``--tokenizer``), packs the documents into rows of ``--seq-len`` tokens and writes
``tokenizer.json``, ``shard-NNNNN.npy``, ``eval.npy`` and, last, ``catalog-entry.json`` into DIR,
which ``dedloc backbone --data-dir DIR`` serves at ``/data/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from dedloc_core.errors import DedlocError, report

SPECIALS = {"causal": ["<|endoftext|>", "<pad>"], "masked": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]}
FAMILIES = {"causal": ("llama", "gpt2"), "masked": ("albert", "bert", "roberta")}
MIB = 1 << 20
NPY_HEADER = 128  # np.save's header for a 2-D array of a plain dtype
SHARD_NAME = re.compile(r"shard-\d{5}\.npy")


def fail(message: str, code: str) -> DedlocError:
    return DedlocError(message, title="Data preparation failed", code=f"dataprep.{code}")


def bounded(kind: type, low: float, high: float):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value
    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    top = argparse.ArgumentParser(prog="dedloc data", description="Prepare an organizer's training data.")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("prepare", help="tokenizer, token shards and a held-out shard from a folder of text",
                       description="Turn a folder of raw text into token shards for a language model.")
    p.add_argument("folder", type=Path, help="searched recursively for *.txt, *.jsonl and *.parquet")
    p.add_argument("--out", type=Path, required=True, help="where to write the shards (created if missing)")
    p.add_argument("--kind", choices=("causal", "masked"), default="causal", help="language model (default causal)")
    p.add_argument("--family", choices=sorted(FAMILIES["causal"] + FAMILIES["masked"]),
                   help="model family (default llama for causal, albert for masked)")
    p.add_argument("--seq-len", type=bounded(int, 16, 8192), default=128, help="tokens per row (default 128)")
    p.add_argument("--vocab-size", type=bounded(int, 256, 200_000), default=8000,
                   help="vocabulary of the tokenizer to train (default 8000; not used with --tokenizer)")
    p.add_argument("--min-frequency", type=bounded(int, 1, 1_000_000), default=2,
                   help="least count of a merged pair (default 2)")
    p.add_argument("--tokenizer", type=Path, help="an existing tokenizer.json to use as is instead of training one")
    p.add_argument("--eval-fraction", type=bounded(float, 0.0, 0.5), default=0.02,
                   help="share of rows held out in eval.npy, at least one row (default 0.02)")
    p.add_argument("--shard-mb", type=bounded(float, 0.001, 1_000_000), default=64.0,
                   help="largest train shard file, in MiB (default 64)")
    p.add_argument("--text-field", default="text",
                   help="the text's field in JSONL and its column in Parquet (default text)")
    p.add_argument("--seed", type=int, default=0, help="seed of the row shuffle (default 0)")
    args = top.parse_args(argv)
    args.family = args.family or FAMILIES[args.kind][0]
    if args.family not in FAMILIES[args.kind]:
        p.error(f"--family {args.family} is not a {args.kind} model; choose one of {', '.join(FAMILIES[args.kind])}")
    return args


def progress(iterable, desc: str, **kw):
    from tqdm import tqdm

    # disable=None: a bar only on a terminal, so logs and pipes stay clean
    return tqdm(iterable, desc=desc, file=sys.stderr, disable=None, **kw)


# ----------------------------------------------------------------------------------- reading
def read_jsonl(path: Path, field: str) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise fail(f"{path}:{number} is not a JSON object.", "bad_jsonl") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise fail(f"{path}:{number} has no text field {field!r} (see --text-field).", "bad_jsonl")
            docs.append(record[field])
    return docs


def read_parquet(path: Path, field: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise fail(f"{path} is a Parquet file, and reading it needs pyarrow, which is not installed. "
                   "Install pyarrow (pip install pyarrow) or convert the file to JSONL.", "no_pyarrow") from None
    table = pq.read_table(path)
    if field not in table.column_names:
        raise fail(f"{path} has no column {field!r} (see --text-field).", "bad_parquet")
    return [text for text in table.column(field).to_pylist() if isinstance(text, str)]


def read_documents(folder: Path, out: Path, field: str) -> tuple[list[str], int]:
    """The documents under ``folder`` in sorted path order, and how many files were skipped."""
    if not folder.is_dir():
        raise fail(f"{folder} is not a folder.", "no_folder")
    # DIR inside FOLDER: a second run must not read the first run's outputs
    out = out.resolve()
    inside = folder.resolve() in out.parents
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and not (inside and out in p.resolve().parents))
    docs: list[str] = []
    skipped = 0
    for path in progress(paths, "reading", unit=" files"):
        suffix = path.suffix.lower()
        try:
            if suffix == ".txt":
                docs.append(path.read_text(encoding="utf-8"))
            elif suffix == ".jsonl":
                docs.extend(read_jsonl(path, field))
            elif suffix == ".parquet":
                docs.extend(read_parquet(path, field))
            else:
                skipped += 1
        except UnicodeDecodeError:
            raise fail(f"{path} is not UTF-8 text.", "not_utf8") from None
    docs = [doc for doc in docs if doc]
    if not docs:
        raise fail(f"No documents in {folder}: it needs *.txt, *.jsonl or *.parquet files with text "
                   f"({skipped} other files skipped).", "no_documents")
    return docs, skipped


# --------------------------------------------------------------------------------- tokenizer
def train_tokenizer(docs: list[str], kind: str, vocab_size: int, min_frequency: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # no prefix space, so a row decodes to exactly the text it was cut from
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIALS[kind],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=sys.stderr.isatty())
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def load_tokenizer(path: Path, kind: str):
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a missing or malformed file
        raise fail(f"{path} is not a readable tokenizer.json ({exc}).", "bad_tokenizer") from None
    missing = [token for token in SPECIALS[kind] if tok.token_to_id(token) is None]
    if missing:
        raise fail(f"The tokenizer {path} lacks the special tokens a {kind} model needs: {', '.join(missing)}.",
                   "tokenizer_specials")
    return tok


# ----------------------------------------------------------------------------------- packing
def pack(docs: list[str], tok, kind: str, seq_len: int) -> tuple[np.ndarray, int]:
    """All rows, ``[rows, seq_len]``, and the number of tokens they were cut from."""
    parts: list[np.ndarray] = []
    eos = tok.token_to_id("<|endoftext|>" if kind == "causal" else "[SEP]")
    batch = 1000
    bar = progress(range(0, len(docs), batch), "encoding", total=(len(docs) + batch - 1) // batch, unit=" batches")
    for start in bar:
        for enc in tok.encode_batch(docs[start:start + batch], add_special_tokens=False):
            parts.append(np.array(enc.ids + [eos], dtype=np.int32))
    stream = np.concatenate(parts)
    if kind == "masked":
        stream = stream[:-1]  # [SEP] goes between documents; every row ends with its own
    width = seq_len if kind == "causal" else seq_len - 2
    n = len(stream) // width
    if n < 2:
        raise fail(f"The documents give {len(stream)} tokens, but a {kind} row of --seq-len {seq_len} needs "
                   f"{width}, so two rows (one to train on, one to evaluate) need {2 * width}.", "too_little_text")
    rows = stream[:n * width].reshape(n, width)
    if kind == "masked":
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        rows = np.hstack([np.full((n, 1), cls, np.int32), rows, np.full((n, 1), sep, np.int32)])
    return rows, len(stream)


# ----------------------------------------------------------------------------------- writing
def write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def file_entry(path: Path) -> dict:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return {"url": f"data/{path.name}", "sha256": digest.hexdigest(), "size": path.stat().st_size}


def model_config(family: str, vocab_size: int, seq_len: int, pad_id: int | None) -> dict:
    """A small config (a few million parameters) that trains on a CPU; keys as transformers names them."""
    if family == "llama":
        return {"vocab_size": vocab_size, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": seq_len,
                "tie_word_embeddings": True}
    if family == "gpt2":
        return {"vocab_size": vocab_size, "n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": seq_len}
    config = {"vocab_size": vocab_size}
    if family == "albert":
        config["embedding_size"] = 128
    config.update({"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024,
                   "max_position_embeddings": seq_len})
    if family == "roberta":
        # RoBERTa numbers positions from pad_token_id + 1
        config["max_position_embeddings"] = seq_len + max(2, pad_id + 1)
        config["pad_token_id"] = pad_id
    return config


def prepare(args: argparse.Namespace) -> dict:
    docs, skipped = read_documents(args.folder, args.out, args.text_field)
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer, args.kind)
    else:
        tok = train_tokenizer(docs, args.kind, args.vocab_size, args.min_frequency)
    vocab = tok.get_vocab_size()
    rows, tokens = pack(docs, tok, args.kind, args.seq_len)
    dtype = np.uint16 if vocab <= 65535 else np.int32
    row_bytes = args.seq_len * np.dtype(dtype).itemsize
    per_shard = int(args.shard_mb * MIB - NPY_HEADER) // row_bytes
    if per_shard < 1:
        raise fail(f"--shard-mb {args.shard_mb} is smaller than one row ({row_bytes + NPY_HEADER} bytes).",
                   "shard_too_small")

    rows = rows[np.random.default_rng(args.seed).permutation(len(rows))].astype(dtype)
    n_eval = min(max(1, round(args.eval_fraction * len(rows))), len(rows) - 1)
    train, held_out = rows[:-n_eval], rows[-n_eval:]

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # a catalog entry from an earlier run would point at files this run replaces
    (out / "catalog-entry.json").unlink(missing_ok=True)
    if args.tokenizer:
        data = args.tokenizer.read_bytes()  # byte for byte, so its hash is the given file's
        write_atomic(out / "tokenizer.json", lambda f: f.write(data))
    else:
        write_atomic(out / "tokenizer.json", lambda f: f.write(tok.to_str(pretty=True).encode("utf-8")))
    names = []
    for i in progress(range(0, len(train), per_shard), "writing", unit=" shards"):
        names.append(f"shard-{len(names):05d}.npy")
        write_atomic(out / names[-1], lambda f, part=train[i:i + per_shard]: np.save(f, part))
    write_atomic(out / "eval.npy", lambda f: np.save(f, held_out))
    for stale in out.iterdir():
        if SHARD_NAME.fullmatch(stale.name) and stale.name not in names:
            stale.unlink()

    pad_id = tok.token_to_id("[PAD]" if args.kind == "masked" else "<pad>")
    entry = {
        "recipe": f"{args.kind}-lm",
        "recipe_params": {"family": args.family, "seq_len": args.seq_len,
                          "config": model_config(args.family, vocab, args.seq_len, pad_id)},
        "data": {"shards": [file_entry(out / name) for name in names],
                 "tokenizer": file_entry(out / "tokenizer.json"),
                 "eval": file_entry(out / "eval.npy")},
    }
    text = json.dumps(entry, indent=1)
    write_atomic(out / "catalog-entry.json", lambda f: f.write((text + "\n").encode("utf-8")))
    print(text, flush=True)
    print(f"{len(docs):,} documents ({skipped:,} other files skipped), {tokens:,} tokens, {len(rows):,} rows "
          f"({len(train):,} train, {len(held_out):,} eval) in {len(names)} shard{'s' * (len(names) != 1)}, "
          f"vocabulary {vocab:,}.", file=sys.stderr)
    return entry


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        prepare(args)
    except (DedlocError, OSError, KeyboardInterrupt) as exc:  # bad files, too little text, a full disk
        return report(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
