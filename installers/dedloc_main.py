"""Entry point of the frozen build: one executable that is the tray app, the worker and the CLI.

- no arguments: the tray app (``app.main``);
- ``--worker``: the training worker (``dedloc_core.engine.worker``), how the app re-runs this executable;
- ``--self-test``: the installation check (``dedloc_core.engine.selftest``);
- anything else: the ``dedloc`` command line (``dedloc_core.cli``).
"""

from __future__ import annotations

import multiprocessing
import sys


def main(argv: list[str]) -> int:
    if not argv:
        from app.main import main as app_main

        return app_main([])
    from dedloc_core.cli import main as cli_main

    return cli_main(argv)  # handles --worker and --self-test too


if __name__ == "__main__":
    multiprocessing.freeze_support()
    sys.exit(main(sys.argv[1:]))
