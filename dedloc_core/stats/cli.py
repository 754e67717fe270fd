"""``dedloc stats``: this computer's contribution totals in a terminal (for headless machines).

Reads the same stats store as the app's Statistics page (``stats.db``) and prints today, this week
and all time; ``--csv FILE`` also exports every hourly/daily bucket.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dedloc_core.errors import DedlocError, report

from .db import PERIOD_TITLES, StatsError, StatsStore, Totals, default_path


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


ROWS = [
    ("Samples", lambda t: f"{t.samples:,}"),
    ("CPU compute", lambda t: _hours(t.cpu_seconds)),
    ("GPU compute", lambda t: _hours(t.gpu_seconds)),
    ("Averaging rounds", lambda t: f"{t.rounds:,}"),
    ("Data sent", lambda t: _bytes(t.bytes_sent)),
    ("Data received", lambda t: _bytes(t.bytes_received)),
    ("Paused", lambda t: _hours(t.paused_seconds)),
]


def format_summary(summary: dict[str, Totals]) -> str:
    """The totals as a text table (one column per period), with pauses by reason below."""
    periods = list(PERIOD_TITLES)
    width = max(len(label) for label, _ in ROWS) + 2
    cells = {p: [fmt(summary[p]) for _, fmt in ROWS] for p in periods}
    col = {p: max(len(PERIOD_TITLES[p]), *(len(c) for c in cells[p])) + 2 for p in periods}
    lines = [" " * width + "".join(PERIOD_TITLES[p].rjust(col[p]) for p in periods)]
    for i, (label, _) in enumerate(ROWS):
        lines.append(label.ljust(width) + "".join(cells[p][i].rjust(col[p]) for p in periods))
    reasons = summary["all"].paused
    if reasons:
        lines.append("")
        lines.append("Paused (all time) by reason:")
        for reason, seconds in sorted(reasons.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {reason}: {_hours(seconds)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dedloc stats", description=__doc__.splitlines()[0])
    p.add_argument("--db", type=Path, default=None, help=f"stats file (default {default_path()})")
    p.add_argument("--experiment", default=None, help="only this experiment id")
    p.add_argument("--csv", type=Path, default=None, help="also export every bucket to this CSV file")
    args = p.parse_args(argv)
    path = args.db or default_path()
    if args.db is not None and not path.exists():
        return report(StatsError(f"No statistics file at {path}.", hint="Check the path given with --db."))
    try:
        with StatsStore(path) as store:
            experiments = store.experiments()
            print(f"Statistics from {path}" + (f" (experiment {args.experiment})" if args.experiment else ""))
            if experiments and not args.experiment:
                print("Experiments: " + ", ".join(experiments))
            print()
            print(format_summary(store.summary(experiment=args.experiment)))
            if args.csv:
                rows = store.export_csv(args.csv)
                print(f"\nExported {rows} rows to {args.csv}")
    except (DedlocError, OSError) as exc:
        return report(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
