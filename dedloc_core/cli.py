"""The ``dedloc`` command. Each subcommand imports its module only when it runs."""

from __future__ import annotations

import argparse
import sys

from . import __version__

_DELEGATED = {
    "stats": "dedloc_core.stats.cli",
    "demo": "dedloc_core.organizer.demo",
    "worker": "dedloc_core.engine.worker",
    "backbone": "dedloc_core.organizer.backbone",
    "app": "app.main",
    "self-test": "dedloc_core.engine.selftest",
    "catalog-child": "dedloc_core.catalog.child",
    "data": "dedloc_core.organizer.dataprep",
    "gpu-runtime": "dedloc_core.gpu_runtime_cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--worker":  # how a frozen build re-runs itself as the worker
        argv[0] = "worker"
    if argv and argv[0] in ("--self-test", "--catalog-child"):  # the frozen build's spellings
        argv[0] = argv[0][2:]
    if argv and argv[0] in _DELEGATED:
        import importlib

        return importlib.import_module(_DELEGATED[argv[0]]).main(argv[1:])

    from dedloc_core.catalog import cli as catalog_cli
    from dedloc_core.organizer import invite_cli

    parser = argparse.ArgumentParser(prog="dedloc", description="DeDLOC Volunteer: lend your computer to "
                                     "open, collaborative deep-learning training.")
    parser.add_argument("--version", action="version", version=f"dedloc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("app", help="the tray app (the usual way to volunteer)")
    sub.add_parser("demo", help="a backbone and volunteers training together on this machine")
    sub.add_parser("worker", help="the training worker process (driven by the app over stdin)")
    sub.add_parser("backbone", help="the organizer's headless node")
    sub.add_parser("self-test", help="check this installation: hardware, a DHT on 127.0.0.1, a few training steps")
    sub.add_parser("stats", help="this computer's contribution totals (today, this week, all time)")
    sub.add_parser("data", help="prepare an organizer's data: tokenizer, token shards, held-out shard")
    sub.add_parser("gpu-runtime", help="install, switch back or show the GPU runtime (a CUDA build of torch)")
    catalog_cli.register(sub)
    invite_cli.register(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
