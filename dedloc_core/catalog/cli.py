"""``dedloc catalog``: make organizer keys, sign a catalog, verify a signed catalog.

``register(subparsers)`` adds the ``catalog`` command to the main ``dedloc`` parser; each leaf
command sets ``func`` (``args.func(args) -> int``, the exit status). ``python -m
dedloc_core.catalog.cli ...`` runs the same commands. The private key passphrase comes from
``$DEDLOC_CATALOG_PASSPHRASE`` or is asked for on the terminal.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path

import msgspec

from dedloc_core import environ
from dedloc_core.errors import EXIT_EXPLAINED, CatalogError, DedlocError, report, user_message

from . import sources
from .model import PASSPHRASE_ENV
from .signing import (
    generate_keypair,
    key_id,
    load_private_key,
    load_trusted_keys,
    parse_public_key,
    sign_catalog,
    verify_catalog,
)
from .store import CatalogStore, fetch_catalog


def _passphrase(confirm: bool) -> str:
    env = environ.CATALOG_PASSPHRASE.optional()
    if env:
        return env
    try:
        first = getpass.getpass("Catalog key passphrase: ")
        if confirm and getpass.getpass("Repeat the passphrase: ") != first:
            raise CatalogError("The passphrases differ.", title="Bad key", code="bad_key")
    except EOFError:
        raise CatalogError(f"No passphrase: set ${PASSPHRASE_ENV} or run in a terminal.", title="Bad key",
                           code="bad_key") from None
    return first


def _reporting(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn a DedlocError or OSError into the CLIs' message on stderr and exit status (``errors.report``)."""

    @wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (DedlocError, OSError) as exc:
            return report(exc)

    return run


@_reporting
def _keygen(args: argparse.Namespace) -> int:
    out = Path(args.out)
    key_path, pub_path = out / f"{args.name}.key", out / f"{args.name}.pub"
    for path in (key_path, pub_path):
        if path.exists():
            raise CatalogError(f"{path} already exists; not overwriting a key.", title="Bad key",
                               code="bad_key")
    pem, pub_line = generate_keypair(_passphrase(confirm=True), comment=args.name)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(pem)
    os.chmod(key_path, 0o600)
    pub_path.write_text(pub_line + "\n", encoding="utf-8")
    print(f"key id {key_id(parse_public_key(pub_line))}\n"
          f"private key (encrypted): {key_path}\npublic key: {pub_path}")
    return 0


@_reporting
def _sign(args: argparse.Namespace) -> int:
    private = load_private_key(Path(args.key).read_bytes(), _passphrase(confirm=False))
    text = Path(args.input).read_text(encoding="utf-8")
    envelope = sign_catalog(text, private)
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_bytes(envelope)
    os.replace(tmp, out)
    print(f"signed {args.input} with key {key_id(private.public_key())} -> {out}")
    return 0


@_reporting
def _verify(args: argparse.Namespace) -> int:
    try:
        keys = load_trusted_keys(args.trusted_key or None)
        source = args.file
        data = (fetch_catalog(source) if source.startswith(("http://", "https://"))
                else Path(source).read_bytes())
        catalog = verify_catalog(data, keys)
    except CatalogError as exc:
        if args.json:
            msg = user_message(exc)
            print(json.dumps({"ok": False, "code": msg.code, "title": msg.title, "message": msg.message,
                              "hint": msg.hint}))
            return msg.exit_code
        raise
    if args.json:
        print(json.dumps({"ok": True, "catalog": msgspec.to_builtins(catalog)}))
        return 0
    print(f"catalog {catalog.catalog_id}, issued {catalog.issued_at.isoformat()}, "
          f"expires {catalog.expires_at.isoformat()}")
    for exp in catalog.experiments:
        print(f"  {exp.id:<24} {exp.status:<9} {exp.recipe:<12} {exp.title}")
    print(f"OK: {len(catalog.experiments)} experiment(s)")
    return 0


@_reporting
def _show(args: argparse.Namespace) -> int:
    result = CatalogStore().load_default()
    if result.catalog is None:
        return report(result.error or CatalogError("No catalog could be loaded.", code="malformed"))
    flag = " (expired)" if result.expired else ""
    print(f"catalog {result.catalog.catalog_id} from {result.source}{flag}")
    for exp in result.catalog.experiments:
        print(f"  {exp.id:<24} {exp.status:<9} {exp.recipe:<12} {exp.title}")
    return 0


@_reporting
def _add(args: argparse.Namespace) -> int:
    if args.source.startswith(f"{sources.SCHEME}:"):
        url, key = sources.parse_link(args.source)
    elif args.fingerprint:
        url, key = args.source, sources.fetch_key(args.source, args.fingerprint)
    else:
        raise CatalogError("Give a dedloc://add link, or a catalog URL with --fingerprint.", code="bad_url")
    catalog = sources.inspect(url, key)
    name = sources.organizer_of(catalog)
    print(f"catalog source: {url}\norganizer: {name}\nkey fingerprint: {sources.fingerprint(key)}")
    for exp in catalog.experiments:
        print(f"  {exp.id:<24} {exp.status:<9} {exp.recipe:<12} {exp.title}")
    if not args.yes:
        if not sys.stdin.isatty():
            raise CatalogError("Not added: confirm with --yes (no terminal to ask on).", code="not_confirmed",
                               title="Source not added")
        if input("Trust this organizer's experiments? [y/N] ").strip().lower() not in ("y", "yes"):
            print("not added")
            return EXIT_EXPLAINED
    source = sources.SourceList().add(url, key, name)
    sources.refresh_source(source)  # its first good copy
    print(f"added {source.label()} ({len(catalog.experiments)} experiment(s))")
    return 0


@_reporting
def _list(args: argparse.Namespace) -> int:
    added = sources.SourceList()
    if added.warning:
        print(added.warning, file=sys.stderr)
    builtin = sources.builtin_source()
    shipped = "the catalog shipped with the app"
    print("built-in: " + (f"{builtin.url} (key {builtin.fingerprint})" if builtin else shipped))
    for source in added.added:
        print(f"{source.label()}: {source.url} (key {source.fingerprint})")
    return 0


@_reporting
def _remove(args: argparse.Namespace) -> int:
    source = sources.SourceList().remove(args.source)
    print(f"removed {source.label()} ({source.url})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``catalog`` and its subcommands to a parser's subparsers."""
    parser = subparsers.add_parser("catalog", help="make keys, sign and verify experiment catalogs")
    commands = parser.add_subparsers(dest="catalog_command", required=True)
    keygen = commands.add_parser("keygen", help="make an organizer key pair (NAME.key, NAME.pub)")
    keygen.add_argument("--out", required=True, help="folder for the key files")
    keygen.add_argument("--name", default="organizer", help="file name stem and key comment")
    keygen.set_defaults(func=_keygen)
    sign = commands.add_parser("sign", help="sign a catalog JSON file")
    sign.add_argument("--key", required=True, help="the encrypted private key (NAME.key)")
    sign.add_argument("--in", dest="input", required=True, help="the catalog JSON")
    sign.add_argument("--out", required=True, help="where to write the signed catalog")
    sign.set_defaults(func=_sign)
    verify = commands.add_parser("verify", help="check a signed catalog (file or http(s) URL)")
    verify.add_argument("file")
    verify.add_argument("--trusted-key", action="append", metavar="PUB",
                        help="a trusted public key file or folder (default: the keys shipped with the app)")
    verify.add_argument("--json", action="store_true", help="print the result as JSON")
    verify.set_defaults(func=_verify)
    show = commands.add_parser("show", help="list the experiments of the catalog in use")
    show.set_defaults(func=_show)
    add = commands.add_parser("add", help="add an organizer's catalog (a dedloc:// link, or a URL and --fingerprint)")
    add.add_argument("source", help="dedloc://add?url=...&key=... or the catalog's http(s) URL")
    add.add_argument("--fingerprint", help="the organizer's key fingerprint (with a plain URL)")
    add.add_argument("--yes", action="store_true", help="trust it without asking")
    add.set_defaults(func=_add)
    listing = commands.add_parser("list", help="the catalog sources in use")
    listing.set_defaults(func=_list)
    remove = commands.add_parser("remove", help="remove an added catalog source (its URL or key fingerprint)")
    remove.add_argument("source")
    remove.set_defaults(func=_remove)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``catalog`` subcommands (``python -m dedloc_core.catalog.cli keygen|sign|verify ...``)."""
    parser = argparse.ArgumentParser(prog="dedloc")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(["catalog", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
