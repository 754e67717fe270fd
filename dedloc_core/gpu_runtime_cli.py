"""``dedloc gpu-runtime``: install, switch back or show this computer's GPU runtime (``gpu_runtime``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import gpu_runtime
from .errors import DedlocError, user_message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dedloc gpu-runtime", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("status", "install", "rollback", "use-bundled"))
    parser.add_argument("--list", type=Path, help="a list of runtimes other than the app's (format: gpu_runtime)")
    args = parser.parse_args(argv)
    try:
        if args.action == "install":
            runtime = gpu_runtime.for_this_machine(gpu_runtime.load_list(args.list))
            if runtime is None:
                raise gpu_runtime.GpuRuntimeError("No GPU runtime is published for this Python and machine.",
                                                  code="gpu_none")
            print(f"Installing {runtime.name} ({runtime.size / 1e9:.2f} GB to download)", flush=True)
            steps = [0]

            def progress(done: int, total: int) -> None:
                if done * 10 // max(total, 1) > steps[0]:
                    steps[0] = done * 10 // max(total, 1)
                    print(f"{done / 1e9:.2f} of {total / 1e9:.2f} GB", flush=True)

            print(f"In use: {gpu_runtime.install(runtime, progress=progress)}")
        elif args.action == "rollback":
            print(f"In use: {gpu_runtime.rollback() or 'the bundled torch (CPU)'}")
        elif args.action == "use-bundled":
            gpu_runtime.use_bundled()
            print("In use: the bundled torch (CPU)")
        else:
            now, back = gpu_runtime.current(), gpu_runtime.previous()
            print(f"In use: {now.name if now else 'the bundled torch (CPU)'}")
            print(f"Way back: {back.name if back else 'the bundled torch (CPU)'}")
        return 0
    except DedlocError as exc:
        message = user_message(exc)
        print(message.line(), file=sys.stderr)
        return message.exit_code
